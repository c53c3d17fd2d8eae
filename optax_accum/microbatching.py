"""In-step microbatching: the large batch inside one jitted train step.

``microbatched(fn, k)`` is a loop in stages, run once per call:

0. with ``global_stats``, the statistics pass (``_global_stats``): ``stats_fn``
   on every micro-batch, summed, one ``psum``; ``fn`` gets the sum as ``stats=``;
1. split the batch (``_batch``: a reshape, micro-batch ``i`` holding rows
   ``i, i + k, ...``), prepare the keys, mark the other arguments device-varying;
2. one micro-batch: ``fn`` on its rows and its key, traced once;
3. the loop (``lax.scan``): values and gradients summed into zero accumulators
   that never narrow them, the aux rules' states (``_aux_rules``), the noise sums;
4. one reduction across devices after the loop (``_window.all_reduce``), then
   the scale ``accumulate`` uses (``_window.reduction_scale``);
5. the outputs cast back to ``fn``'s dtypes and built into ``fn``'s structure.

Under plain ``jit`` with the batch sharded over mesh axes the stages run once
per device on its rows, in a ``shard_map`` over them (``_per_device.run``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jax_core
from jax.sharding import PartitionSpec as P

from optax_accum import _arrays, _aux_rules, _batch, _global_stats, _per_device, _validation
from optax_accum import gradient_noise as noise_lib
from optax_accum._aux_rules import AUX_RULES, AuxRule
from optax_accum._batch import split_microbatches
from optax_accum._legacy import microbatched_options
from optax_accum._window import all_reduce, reduction_scale

__all__ = ["AUX_RULES", "AuxRule", "microbatched", "split_microbatches"]


@dataclasses.dataclass(frozen=True)
class _Config:
  """The validated options of one :func:`microbatched` wrapper."""

  k: int
  has_aux: bool
  normalize: str
  aux_rules: Any
  axis_name: Any
  return_noise_stats: bool
  global_stats: Callable[..., Any] | None
  split: str  # 0.2's four options, deprecated (`_legacy`)
  rng_mode: str
  acc_dtype: jnp.dtype | None
  unroll: int | bool


class _Carry(NamedTuple):
  """The loop carry: running sums and the aux rules' states."""

  sums: tuple[Any, Any, Any]  # value (numerator), denominator (None unless weighted), grads
  aux: Any  # the aux rules' states
  noise: noise_lib.NoiseScaleState | tuple[()]  # its open window's sums


class _Result(NamedTuple):
  """What the loop gives back, in the one structure ``microbatched`` turns into ``fn``'s."""

  value: Any  # (value, aux) with has_aux
  grads: Any
  noise: noise_lib.WindowStats | tuple[()]  # () unless return_noise_stats


def microbatched(
    fn: Callable[..., tuple[Any, Any]],
    num_microbatches: int,
    *,
    batch_argnums: int | Sequence[int] = 1,
    has_aux: bool = False,
    normalize: str = "mean",
    aux_rules: Any = "mean",
    rng_argnums: int | Sequence[int] = (),
    axis_name: Any = None,
    return_noise_stats: bool = False,
    global_stats: Callable[..., Any] | None = None,
    **deprecated_options: Any,
) -> Callable[..., Any]:
  r"""Runs a value-and-grad function over ``k`` micro-batches in one ``lax.scan``.

  ``fn(params, batch, *rest) -> (value, grads)`` is typically
  ``jax.value_and_grad(loss_fn)``; the wrapper has its signature and outputs.
  Micro-batch ``i`` holds rows ``i, i + k, ...`` of each batch argument (a
  reshape: a batch-sharded input stays on its devices); the other arguments
  go to every micro-batch. Values and gradients are summed in dtypes that
  never narrow them, reduced once after the loop (across devices too) and
  cast back to ``fn``'s. Peak activation memory is one micro-batch's, plus one
  gradient-sized accumulator. The guide: ``docs/guides/microbatching.md``.

  Args:
    fn: ``(*args) -> (value, grads)``, or ``((value, aux), grads)`` with
      ``has_aux``. ``jax.checkpoint`` and mixed precision go inside its loss.
    num_microbatches: ``k``, a positive int dividing the batch size (per device).
    batch_argnums: position(s) of the batch argument(s) (default 1), passed
      positionally; never 0, the params (the gradients come in their layout).
    has_aux: whether ``fn``'s value carries an aux output.
    normalize: ``"mean"`` (of the micro-batches: a mean loss's full batch),
      ``"sum"``, or ``"weighted"``: ``fn``'s value is ``(numerator,
      denominator)`` (``(numerator, (denominator, aux))`` with ``has_aux``) and
      the outputs :math:`\sum_i n_i / \sum_i d_i` and its gradient (zeros for
      a total of 0): a mean over real tokens however the padding is spread.
    aux_rules: how each aux output is reduced over the micro-batches: one rule,
      or a pytree of rules that is a prefix of the aux; each one of
      :data:`AUX_RULES` (``"concat"``: per-example outputs in batch order,
      ``"stack"``: one per micro-batch) or an :class:`AuxRule`.
    rng_argnums: position(s) of PRNG keys: micro-batch ``i`` gets
      ``jax.random.fold_in(key, i)``, never ``key`` (with ``axis_name``, the
      device index is folded in first).
    axis_name: the mesh axis (or axes) the batch is split over: those of
      ``shard_map``/``pmap``, or Auto axes under plain ``jit`` (Explicit ones
      the batch's type shows). Each device loops over its rows, and the
      results are reduced once, after the loop; aux rules ``mean``, ``sum``,
      ``max`` and ``min`` too.
    return_noise_stats: also return the micro-batches' gradient noise
      statistics, a :class:`~optax_accum.gradient_noise.WindowStats` (fold them
      with :func:`optax_accum.gradient_noise.fold`).
    global_stats: ``stats_fn(params, *args)``: statistics of the whole batch
      that the loss needs, each a sum over the rows (token counts, each
      expert's routed tokens). Summed over every micro-batch and device before
      the loop, and given to ``fn`` as the keyword ``stats=``, a constant.
    **deprecated_options: 0.2's ``split``, ``rng_mode``, ``accumulator_dtype``
      and ``unroll``, deprecated (a ``DeprecationWarning``) until 0.4.

  Returns:
    A function with ``fn``'s signature returning ``(value, grads)`` (or
    ``((value, aux), grads)``), reduced over the micro-batches; with
    ``return_noise_stats=True``, ``((value, grads), stats)`` (or
    ``(((value, aux), grads), stats)``).

  Raises:
    TypeError: for a keyword it does not take, an ``fn`` or ``global_stats``
      that is not callable; when called with complex values and a real
      ``accumulator_dtype`` (a deprecated option).
    ValueError: when called with a batch whose size ``num_microbatches`` does
      not divide, whose leaves disagree on the batch size, or with arguments
      that do not match ``batch_argnums``/``rng_argnums`` (overlapping, or
      naming position 0, the params): :func:`~optax_accum.cached_microbatched`
      raises the same errors for the same inputs. Under plain ``jit``, for
      batch leaves split differently over the mesh, ``axis_name`` naming axes
      the batch is not split over, of mixed kinds or bound nowhere (no mesh
      set, no shard_map), a mesh mixing Auto and Explicit axes where a split
      could not be seen, or a batch not divisible into ``k`` micro-batches per
      device. With ``global_stats``, for a statistic that has a gradient, is not
      linear in the rows (a max, a mean, a ratio of sums), or follows the rows
      on no one axis.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax_accum.microbatching import microbatched
    >>> def loss_fn(w, batch):
    ...   return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    >>> batch = {"x": jnp.arange(16.0).reshape(8, 2), "y": jnp.ones(8)}
    >>> w = jnp.array([0.1, -0.2])
    >>> grad_fn = jax.jit(microbatched(jax.value_and_grad(loss_fn), 4))
    >>> loss, grads = grad_fn(w, batch)
    >>> ref_loss, ref_grads = jax.value_and_grad(loss_fn)(w, batch)
    >>> bool(jnp.allclose(loss, ref_loss)), bool(jnp.allclose(grads, ref_grads))
    (True, True)

    Token-weighted (sum of per-token losses over real tokens):

    >>> def loss_sum(w, batch):
    ...   per_example = (batch["x"] @ w - batch["y"]) ** 2
    ...   return jnp.sum(per_example * batch["mask"]), jnp.sum(batch["mask"])
    >>> batch["mask"] = jnp.array([1., 1., 1., 1., 1., 0., 0., 0.])
    >>> fn = jax.value_and_grad(loss_sum, has_aux=True)
    >>> loss, grads = microbatched(fn, 4, normalize="weighted")(w, batch)
    >>> (num, den), g = fn(w, batch)
    >>> bool(jnp.allclose(loss, num / den)), bool(jnp.allclose(grads, g / den))
    (True, True)
  """
  if not callable(fn):
    raise TypeError(f"`fn` must be callable (e.g. jax.value_and_grad(loss)); got {fn!r}.")
  if global_stats is not None and not callable(global_stats):
    raise TypeError(f"`global_stats` must be None or a function `stats_fn(params, *args)`"
                    f" returning a micro-batch's statistics; got {global_stats!r}.")
  k = _batch.check_num_microbatches(num_microbatches)
  batch_argnums = _validation.check_argnums(batch_argnums, "batch_argnums")
  rng_argnums = _validation.check_argnums(rng_argnums, "rng_argnums", empty_ok=True)
  config = _Config(
      k=k,
      has_aux=_validation.check_flag(has_aux, "has_aux"),
      normalize=_validation.check_choice(
          normalize, "normalize", _validation.REDUCTIONS,
          "Use 'mean' for a mean loss, 'sum' for a summed loss, or 'weighted' when"
          " `fn`'s value is (numerator, denominator)."),
      aux_rules=_aux_rules.check(aux_rules),
      axis_name=axis_name,
      return_noise_stats=_validation.check_flag(return_noise_stats, "return_noise_stats"),
      global_stats=global_stats,
      **microbatched_options(deprecated_options),
  )

  @functools.wraps(fn)
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    call = functools.partial(fn, **kwargs)
    with _arrays.mesh_context(args):
      batch = _batch.of(args, batch_argnums, rng_argnums, axis_name=axis_name, in_step=True)
      batch.check_divides(config.k)
      if config.global_stats is not None:  # stage 0, before the loop
        # `fn` gets the sum as `stats=`; it travels as one more argument (into a shard_map).
        args += (_on_devices(lambda c, a: _statistics(c, a, batch), config, args, batch,
                             P() if batch.axes else None),)
        call = functools.partial(lambda f, *a: f(*a[:-1], stats=a[-1]), call)
      here, out_specs, scatter = _placement(call, config, args, batch)
      result = _on_devices(lambda c, a: _run(call, c, a, batch, scatter), here, args, batch,
                           out_specs)
      if out_specs is not None:  # (Explicit axes: the params' shardings)
        result = result._replace(grads=_batch.to_params(result.grads, args[_batch.PARAMS]))
    out = result.value, result.grads  # fn's output structure: the one place it is built
    return (out, result.noise) if config.return_noise_stats else out

  # Equinox warns of a "JAX-transformed callable" when a function's
  # `__wrapped__` chain reaches a module with array-like fields (its
  # `filter_value_and_grad` wrapper has a bool): keep the name, not the link.
  del wrapped.__wrapped__
  return wrapped


# ----------------------------- stages 1 and 2: split the batch, one micro-batch
def _micro_batches(config: _Config, args: Sequence[Any], batch: _batch.Batch,
                   ) -> tuple[Callable[[jax.Array], list[Any]], bool]:
  """``idx ->`` ``fn``'s positional arguments for micro-batch ``idx``, and whether they vary.

  The batch arguments are reshaped once for ``_batch.index`` (no data moves),
  each micro-batch gets its own key, never the one given (not even for
  ``k = 1``), and inside ``shard_map``/``pmap`` the other arguments are cast
  to device-varying: else the transpose of a replicated input would
  all-reduce its gradient on every micro-batch. They vary over manual axes
  inside ``shard_map``: the loop's carry must then too.
  """
  rest = list(args)
  if config.axis_name is not None:
    axes = _arrays.axis_names(config.axis_name)
    rest = [x if i in batch.positions or i in batch.keys else _per_device.make_varying(x, axes)
            for i, x in enumerate(args)]
  splits = {i: jax.tree.map(lambda x: _batch.reshape(x, config.k, config.split), args[i])
            for i in batch.positions}
  # Per device: devices must not share micro-batch i's keys.
  keys = {i: _batch.device_key(args[i], config.axis_name) for i in batch.keys}
  if config.rng_mode == "split":  # deprecated: k keys, one per micro-batch
    keys = {i: jax.random.split(key, config.k) for i, key in keys.items()}

  def micro(idx: jax.Array) -> list[Any]:
    return _batch.micro_args(rest, {
        i: jax.tree.map(lambda x: _batch.index(x, idx, config.split), tree)
        for i, tree in splits.items()}, {
        i: key[idx] if config.rng_mode == "split" else _batch.microbatch_key(key, idx)
        for i, key in keys.items()})
  return micro, any(_arrays.array_type(x).varying for x in _arrays.ArrayLeaves.of(rest).arrays)


def _statistics(config: _Config, args: Sequence[Any], batch: _batch.Batch) -> Any:
  """Stage 0: ``global_stats`` checked and summed over every micro-batch, then over ``axis_name``.

  The check traces it on one micro-batch's types and on the whole batch's rows
  (``_global_stats.summable``); the pass evaluates the first trace on every
  micro-batch and adds it in the dtypes ``_arrays.sum_dtype`` gives (integers
  in int32 or wider). No gradient.
  """
  micro, varying = _micro_batches(config, args, batch)
  arrays = lambda i: _arrays.ArrayLeaves.of(tuple(micro(i))).arrays
  on = _global_stats.summable(config.global_stats, args, jax.eval_shape(arrays, jnp.zeros(
      [], jnp.int32)), batch.positions, batch.per_device_rows // config.k, batch.rows)[1]
  init = jax.tree.map(lambda s: _arrays.filled(s, _arrays.sum_dtype(s.dtype, config.acc_dtype)),
                      jax.eval_shape(lambda i: on(arrays(i)), jnp.zeros([], jnp.int32)))
  out = _loop(config, lambda c, i: jax.tree.map(lambda t, x: t + jnp.asarray(x).astype(t.dtype),
                                                c, on(arrays(i))), init, varying=varying)
  return lax.stop_gradient(out if config.axis_name is None else lax.psum(out, config.axis_name))


# ------------------------------------------------------ stage 3: the loop
def _run(call: Callable[..., Any], config: _Config, args: Sequence[Any], batch: _batch.Batch,
         scatter: list[Any] | None = None) -> _Result:
  """Stages 1 to 5: loops over the micro-batches, then reduces once and normalises.

  ``scatter`` (one entry per gradient leaf, or None) names the leaves that are
  reduce-scattered over ``axis_name`` instead of all-reduced: ``(dim, axes)``.
  """
  micro, varying = _micro_batches(config, args, batch)
  # `fn` traced once: its output's types and the loop's body, that trace evaluated. (k = 1
  # calls `fn` itself, without a loop: bitwise `fn`, eagerly too.)
  closed, out = jax.make_jaxpr(lambda i: call(*micro(i)), return_shape=True)(
      jnp.zeros([], jnp.int32))
  step = (lambda i: call(*micro(i))) if config.k == 1 else (
      lambda i: jax.tree.unflatten(jax.tree.structure(out), jax_core.jaxpr_as_fun(closed)(i)))
  shapes = _batch.unpack(out, config.normalize, config.has_aux)
  _batch.check_no_batch_gradient(shapes.grads, args, batch.positions,
                                 batch.per_device_rows // config.k)
  _validation.check_no_float0(shapes.grads, where="gradient `fn` returns")
  if config.has_aux and config.k > 1:
    _check_aux_rows(call, config, args, batch, shapes.aux)
  aux = _aux_rules.resolve(config.aux_rules if config.has_aux else None, shapes.aux, config)
  carry = _loop(config, functools.partial(_add, config, aux, step),
                _init_carry(config, aux, shapes), varying=varying)
  num, grads, stats = _normalize(config, carry, scatter)
  num, grads = jax.tree.map(lambda x, s: x.astype(s.dtype), (num, grads),
                            (shapes.num, shapes.grads))
  value = (num, aux.finalize(carry.aux)) if config.has_aux else num
  return _Result(value, grads, stats)


def _check_aux_rows(call: Callable[..., Any], config: _Config, args: Sequence[Any],
                    batch: _batch.Batch, aux: Any) -> None:
  """Raises where ``"mean"`` or ``"sum"`` would add up the examples of an aux leaf: its leading
  axis holds the micro-batch's rows (``fn`` traced again on twice them: it doubles)."""
  rows = batch.per_device_rows // config.k
  suspects = _aux_rules.summed_rows(config.aux_rules, aux, rows)
  if not suspects:
    return
  leaves = _arrays.ArrayLeaves.of(tuple(args))
  doubled = _batch.unpack(jax.eval_shape(lambda *v: call(*leaves.rebuild(v)), *_batch.shapes_at(
      args, batch.positions, 2 * rows)), config.normalize, True).aux
  grown = _aux_rules.summed_rows(config.aux_rules, doubled, 2 * rows)
  found = [s for s in suspects if s in grown]
  if found:
    raise ValueError(
        f"The aux leaf at {found[0][0]} holds the micro-batch's examples on its leading axis"
        f" ({rows} rows), and `aux_rules` {found[0][1]!r} would add other examples' rows"
        " together across micro-batches. Give per-example outputs `aux_rules='concat'` (a"
        " rule per leaf: `{'pred': 'concat', 'loss': 'mean'}`).")


def _init_carry(config: _Config, aux: AuxRule, shapes: _batch.Out) -> _Carry:
  """Zero accumulators shaped like one micro-batch's output, in the accumulator dtypes."""
  num, grads = jax.tree.map(lambda s: _arrays.filled(s, _arrays.sum_dtype(
      s.dtype, config.acc_dtype)), (shapes.num, shapes.grads))
  den = None
  if shapes.den is not None:
    # An integer token count is summed as a float, like the value it divides.
    den = jnp.zeros([], _arrays.sum_dtype(shapes.den.dtype, config.acc_dtype, mean=True))
  noise = noise_lib.init() if config.return_noise_stats else ()
  return _Carry((num, den, grads), aux.init(shapes.aux), noise)


def _add(config: _Config, aux: AuxRule, step: Callable[[jax.Array], Any], carry: _Carry,
         idx: jax.Array) -> _Carry:
  """One loop step: micro-batch ``idx``'s outputs (``step(idx)``, ``fn``'s) added to the carry."""
  out = _batch.unpack(step(idx), config.normalize, config.has_aux)
  sums = jax.tree.map(  # den: None (no leaves) unless normalize="weighted"
      lambda c, x: c + jnp.asarray(x).astype(c.dtype), carry.sums, (out.num, out.den, out.grads))
  noise = noise_lib.add_value_and_grad(carry.noise, out.grads, out.den) if (
      config.return_noise_stats) else ()
  return _Carry(sums, aux.update(carry.aux, out.aux, idx), noise)


def _loop(config: _Config, body: Callable[[Any, jax.Array], Any], init: Any, *,
          varying: bool) -> Any:
  """Runs ``body`` for micro-batches ``0 .. k - 1``."""
  with jax.named_scope("microbatched"):
    if config.k == 1:
      # One step needs no loop. A scan would compile `fn` as one program whose
      # fusions round differently from calling it: k = 1 stays bitwise `fn`.
      return body(init, jnp.zeros([], jnp.int32))
    if varying:
      # Inside shard_map the carry must vary over the same mesh axes as what
      # the body adds to it; match the zeros to one abstract step.
      out_carry = jax.eval_shape(lambda c: body(c, jnp.zeros([], jnp.int32)), init)
      init = jax.tree.map(_arrays.match_varying, init, out_carry)
    carry, _ = lax.scan(lambda c, i: (body(c, i), None), init,
                        jnp.arange(config.k, dtype=jnp.int32), unroll=config.unroll)
    return carry


# ------------------------------------------- stages 4 and 5: reduce, normalise
def _normalize(config: _Config, carry: _Carry, scatter: list[Any] | None,
               ) -> tuple[Any, Any, noise_lib.WindowStats | tuple[()]]:
  """The sums to the outputs (before the cast back), and the micro-batches' noise statistics.

  One reduction over ``axis_name`` (``_window.all_reduce``: the value, the
  denominator, the noise sums and every gradient leaf not reduce-scattered),
  then the sums times ``_window.reduction_scale``, the rule ``accumulate``
  uses: ``1 / (k * devices)``, ``1 / denominator`` (0 for a denominator of 0)
  or 1.
  """
  # The count rides as a float32 scalar: one dtype, one all-reduce with the gradients.
  window = ((carry.noise.window_sq_norms, carry.noise.window_count.astype(jnp.float32))
            if config.return_noise_stats else ())
  num, den, grads = carry.sums
  devices = 1
  if config.axis_name is not None:
    (num, den, window), grads = all_reduce(config.axis_name, (num, den, window), grads, scatter)
    devices = lax.axis_size(config.axis_name)
  num, grads = jax.tree.map(lambda x: x * reduction_scale(
      config.normalize, config.k * devices, den, x.dtype), (num, grads))
  if not config.return_noise_stats:
    return num, grads, ()
  leaves = jax.tree.leaves(grads)  # the mean gradient's squared norm, over every device
  scatter = scatter or [None] * len(leaves)
  mean_sq = noise_lib.sq_norm([g for g, s in zip(leaves, scatter, strict=True) if s is None])
  scattered = [g for g, s in zip(leaves, scatter, strict=True) if s is not None]
  if scattered:  # each device holds a slice of these leaves
    mean_sq = mean_sq + lax.psum(noise_lib.sq_norm(scattered), config.axis_name)
  return num, grads, noise_lib.window_of(*window, mean_sq, config.normalize, den)


# ---------------------------------------------- plain jit: the batch on a mesh
def _on_devices(stage: Callable[[_Config, Sequence[Any]], Any], config: _Config,
                args: Sequence[Any], batch: _batch.Batch, out_specs: Any) -> Any:
  """``stage(config, args)``; with ``out_specs``, once per device on its rows (a ``shard_map``
  over the data axes, reduced over them: ``axis_name``)."""
  if out_specs is None:
    return stage(config, args)
  inner = dataclasses.replace(config, axis_name=_arrays.spec_entry(batch.axes))
  return _per_device.run(lambda *a: stage(inner, a), args, batch.positions, batch.axes, out_specs)


def _placement(call: Callable[..., Any], config: _Config, args: Sequence[Any],
               batch: _batch.Batch) -> tuple[_Config, Any, list[Any] | None]:
  """Where the loop runs: ``(config, out_specs, scatter)`` for :func:`_on_devices` and :func:`_run`.

  Here (``out_specs`` None), unless plain ``jit`` has the batch split over mesh axes.

  Then each device scans over its own rows with ``axis_name`` set to the data
  axes (the ``shard_map`` path); outside, each gradient takes the sharding of
  the parameter it belongs to, reduce-scattered onto it inside when that param
  is sharded over the data axes alone. Under Auto axes the types hold no
  shardings: everything is all-reduced, and the partitioner places the
  result. A ``fn`` that cannot run on one device's rows (its own
  ``shard_map`` over the data axes) runs here on every device's rows.
  """
  if not batch.axes:  # one device, or inside shard_map/pmap
    return config, None, None
  rows = batch.per_device_rows // config.k  # per device and micro-batch
  leaves = _arrays.ArrayLeaves.of(tuple(args))  # only arrays are abstract (Equinox modules)
  try:
    shapes = _batch.unpack(jax.eval_shape(lambda *v: call(*leaves.rebuild(v)), *_batch.shapes_at(
        args, batch.positions, rows)), config.normalize, config.has_aux)
  except ValueError:  # not on one device's rows: as written, every device's rows
    return dataclasses.replace(config, axis_name=None), None, None
  scatter = None
  if _arrays.axis_kind(batch.axes) == "Explicit":
    targets = _batch.param_specs(args[_batch.PARAMS], shapes.grads)
    scatter = targets and [_per_device.scatter_dim(spec, batch.axes) for spec in targets]
  leaves, treedef = jax.tree.flatten(shapes.grads)
  grads = jax.tree.unflatten(treedef, [  # reduced outputs replicated, or scattered
      P() if s is None else P(*[None] * s[0], _arrays.spec_entry(s[1]))
      for s in scatter or [None] * len(leaves)])
  value = (P(), _aux_rules.out_specs(config.aux_rules, shapes.aux, batch.axes, rows)
           ) if config.has_aux else P()
  specs = _Result(value, grads, P() if config.return_noise_stats else ())
  return config, specs, scatter
