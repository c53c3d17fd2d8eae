"""In-step microbatching: the large batch inside one jitted train step.

``microbatched(fn, k)`` wraps a value-and-grad function ``fn(params, batch,
*rest) -> (value, grads)``, splits ``batch`` into ``k`` equal micro-batches and
loops over them with ``lax.scan``. Gradients (and the loss) are summed into
zero-initialised accumulators whose shapes come from ``jax.eval_shape`` (no
micro-batch is peeled out of the loop) and whose dtypes never narrow the values
(bfloat16 sums in float32; float64 and complex values keep their dtype), then
reduced once: the peak of activation memory is that of one micro-batch, and the
result is the full-batch call's, up to float rounding.

Where to put the other two memory tricks:

* mixed precision (:mod:`optax_accum.precision`) goes *inside* ``fn``, around
  the loss: ``microbatched(jax.value_and_grad(mixed_precision(loss, policy)),
  k)``;
* ``jax.checkpoint`` goes *inside the loss*, around each block (layer) of the
  model — never around ``fn`` or the whole loss, which recomputes everything
  and saves nothing.

Across devices the gradients are reduced once, after the loop: inside
``shard_map``/``pmap`` with ``axis_name``, and under plain ``jit`` with the
batch sharded over Explicit mesh axes (or Auto axes named by ``axis_name``),
where the loop is run inside a ``shard_map`` over them.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from optax_accum import _arrays, _batch, _global_stats, _per_device, _validation, _window
from optax_accum import gradient_noise as noise_lib

__all__ = [
    "AUX_RULES",
    "AuxRule",
    "microbatched",
    "split_microbatches",
]

RNG_MODES = ("fold_in", "split")
AUX_RULES = ("mean", "sum", "max", "min", "last", "concat", "stack")


@dataclasses.dataclass(frozen=True)
class AuxRule:
  """A custom rule that reduces one aux output over the micro-batches.

  It runs the program ``c = init(shape); for i: c = update(c, aux_i, i);
  return finalize(c)``, where ``shape`` is the ``jax.ShapeDtypeStruct`` tree of
  one micro-batch's aux (the subtree at the rule's position in ``aux_rules``)
  and ``aux_i`` that subtree for micro-batch ``i``. The carry must be a pytree
  of arrays of fixed shapes. With ``axis_name``, a custom rule is not reduced
  across devices: do it in ``finalize`` if you need it.

  Attributes:
    init: ``shape_tree -> carry``.
    update: ``(carry, aux_i, i) -> carry``.
    finalize: ``carry -> output``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax_accum.microbatching import AuxRule, microbatched
    >>> first = AuxRule(
    ...     init=lambda s: jnp.zeros(s.shape, s.dtype),
    ...     update=lambda c, v, i: jnp.where(i == 0, v, c),
    ...     finalize=lambda c: c)
    >>> def loss(w, x):
    ...   return jnp.mean(w * x), jnp.max(x)
    >>> fn = jax.value_and_grad(loss, has_aux=True)
    >>> (l, aux), g = microbatched(fn, 2, has_aux=True, aux_rules=first)(
    ...     1.0, jnp.arange(4.0))
    >>> float(aux)  # the max of the first micro-batch, rows 0 and 2
    2.0
  """

  init: Callable[[Any], Any]
  update: Callable[[Any, Any, jax.Array], Any]
  finalize: Callable[[Any], Any]


def _is_rule(x: Any) -> bool:
  return isinstance(x, (str, AuxRule))


def split_microbatches(tree: Any, num_microbatches: int, split: str = "strided") -> Any:
  """Splits a batch pytree into a stacked ``[k, batch // k, ...]`` pytree.

  The same split :func:`microbatched` and
  :func:`~optax_accum.cached_microbatched` use, exposed for inspection and
  for reference computations: micro-batch ``i`` holds rows ``i, i + k,
  i + 2k, ...`` (a reshape to ``[batch // k, k, ...]``, so a batch sharded
  along its leading dim stays sharded without any data movement). ``split``
  is for the layout of ``microbatched``'s deprecated ``split="contiguous"``
  (rows ``i * m ... (i + 1) * m - 1``), which goes with it in 0.4.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_accum.microbatching import split_microbatches
    >>> split_microbatches(jnp.arange(6), 2).tolist()
    [[0, 2, 4], [1, 3, 5]]
  """
  k, split = _batch.check_num_microbatches(num_microbatches), _batch.check_split(split)
  rows = _batch.leading_rows({"`tree`": tree})[0]
  _batch.Batch((), (), rows, rows, ()).check_divides(k)  # (the whole batch: one device's rule)
  return _batch.split(tree, k, split)


def _acc_dtype(dtype: Any, requested: jnp.dtype | None, mean: bool = False) -> Any:
  """The dtype that sums values of ``dtype``: ``accumulate``'s rule for floats and complex.

  Integers (aux outputs, token counts) keep their own dtype in a sum, which is
  exact, and become float32 in a mean (or as a denominator).
  """
  if not jnp.issubdtype(dtype, jnp.inexact):
    return jnp.dtype(jnp.float32) if mean else jnp.dtype(dtype)
  return _arrays.accumulator_dtype(dtype, requested)


@dataclasses.dataclass(frozen=True)
class _Config:
  """The validated options of one :func:`microbatched` wrapper."""

  k: int
  batch_argnums: tuple[int, ...]
  rng_argnums: tuple[int, ...]
  has_aux: bool
  normalize: str
  aux_rules: Any
  split: str
  rng_mode: str
  acc_dtype: jnp.dtype | None
  axis_name: Any
  unroll: int | bool
  return_noise_stats: bool = False
  global_stats: Callable[..., Any] | None = None


class _Inputs(NamedTuple):
  """``fn``'s positional arguments, prepared for the loop."""

  args: list[Any]  # as given; batch and key positions are replaced per micro-batch
  splits: dict[int, Any]  # batch position -> its leaves reshaped by `_batch.reshape`
  keys: dict[int, Any]  # key position -> the key (fold_in) or k keys (split)


class _Carry(NamedTuple):
  """The loop carry: running sums and the aux rules' states."""

  num: Any
  den: Any
  grads: Any
  aux: list[Any]  # one state per aux rule
  noise: noise_lib.NoiseScaleState | tuple[()] = ()  # its open window's sums


class _AuxPlan(NamedTuple):
  """``aux_rules`` matched against the aux of one micro-batch."""

  rules: list[str | AuxRule]  # as given
  programs: list[AuxRule]  # what each rule runs (a built-in rule's own program)
  shapes: list[Any]  # the aux subtree (of ShapeDtypeStructs) under each rule
  where: list[str]  # each rule's position in the aux, for error messages
  treedef: Any  # the structure of `aux_rules`


# ---------------------------------------------------------------- options
def _check_aux_rules(aux_rules: Any) -> Any:
  for r in jax.tree.leaves(aux_rules, is_leaf=_is_rule):
    if not _is_rule(r) or (isinstance(r, str) and r not in AUX_RULES):
      raise ValueError(
          f"`aux_rules` holds {r!r}; each rule must be one of {AUX_RULES} or an"
          " `AuxRule(init, update, finalize)`. Pass one rule for the whole aux"
          " or a pytree of rules that is a prefix of the aux structure."
      )
  return aux_rules


# Options of 0.2.0 kept for one release (and their defaults).
_DEPRECATED_OPTIONS = {"split": "strided", "rng_mode": "fold_in", "accumulator_dtype": None,
                       "unroll": 1}


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
  Each batch argument (a pytree of arrays with a common leading dimension
  ``B``) is split into ``k`` micro-batches of ``B // k`` examples, micro-batch
  ``i`` holding rows ``i, i + k, ...`` (a reshape: a batch-sharded input stays
  on its devices); the other arguments go unchanged to every micro-batch.
  Values and gradients are summed into zero accumulators that never narrow
  the dtype (bfloat16 sums in float32), reduced once after the loop, and
  cast back to ``fn``'s dtypes. Peak activation memory is one micro-batch's,
  plus one gradient-sized accumulator. ``k = 1`` follows the same rules
  (aux rules, keys, reduction) but calls ``fn`` once, without a loop.

  Three normalisations (``normalize``):

  * ``"mean"`` (default): the mean over micro-batches of value and grads. For
    a loss that is a mean over examples, this *is* the full-batch call.
  * ``"sum"``: the sums (for a loss that sums over examples).
  * ``"weighted"``: token-weighted. ``fn``'s value is ``(numerator,
    denominator)`` (``(numerator, (denominator, aux))`` with ``has_aux``),
    e.g. ``jax.value_and_grad(loss_fn, has_aux=True)`` of a ``loss_fn``
    returning ``(sum of per-token losses, number of real tokens)``. The
    outputs are :math:`\sum_i n_i / \sum_i d_i` and
    :math:`\sum_i \nabla n_i / \sum_i d_i`, the full batch's mean over real
    tokens however the padding is spread; a total denominator of 0 gives
    zeros. They have the shape of a mean loss's ``value_and_grad``.

  Args:
    fn: a function ``(*args) -> (value, grads)`` or, with ``has_aux=True``,
      ``((value, aux), grads)``. Put ``jax.checkpoint`` (per model block) and
      mixed-precision casts inside the loss that ``fn`` differentiates.
    num_microbatches: ``k``, a positive int dividing the batch size.
    batch_argnums: position(s) of the batch argument(s) of ``fn`` (default 1,
      as in ``fn(params, batch)``). They must be passed positionally, and
      not name position 0: the params, given whole to every micro-batch
      (and whose layout the gradients are given back in).
    has_aux: whether ``fn``'s value carries an aux output.
    normalize: ``"mean"``, ``"sum"`` or ``"weighted"`` (see above).
    aux_rules: how each aux output is reduced over micro-batches: one rule for
      all, or a pytree of rules that is a prefix of the aux. Built-in rules:
      ``"mean"`` (of an integer output, a float32), ``"sum"``, ``"max"``,
      ``"min"``, ``"last"``, ``"concat"`` (per-example outputs, concatenated
      back in the original batch order) and ``"stack"`` (a new leading axis
      of ``k`` values, in micro-batch order); or an :class:`AuxRule` for
      anything else.
    rng_argnums: position(s) of PRNG key arguments (e.g. dropout keys).
      Micro-batch ``i`` gets ``jax.random.fold_in(key, i)``, never ``key``
      itself (not even with ``k = 1``); with ``axis_name``, ``key`` is first
      folded with ``lax.axis_index(axis_name)``, so devices differ too.
    axis_name: the mesh axis name (or tuple of names) the batch is split
      over across devices: inside ``shard_map``/``pmap`` name their axes;
      under plain ``jit``, Auto axes (see below). Each device loops over its
      own micro-batches, and the results are reduced **once, after the
      loop** (for ``"weighted"``, numerators, denominators and gradients
      before the one division). Aux rules ``mean``/``sum``/``max``/``min``
      are reduced across devices too; the others stay per device.
    return_noise_stats: also return the gradient noise statistics of this
      call's micro-batches, a :class:`~optax_accum.gradient_noise.WindowStats`
      (the sums ``accumulate(k, opt, track_noise_scale=True)`` keeps for a
      window of the same micro-batch gradients; fold them with
      :func:`optax_accum.gradient_noise.fold`). Each micro-batch adds one
      scalar to the loop carry. ``"weighted"`` weights micro-batch ``i`` by
      its denominator; across ``D`` devices they span all ``k * D``
      micro-batches.
    global_stats: ``stats_fn(params, *args)``: statistics of the whole batch
      that the loss needs (each expert's count of routed tokens for a
      load-balancing loss, the count of real tokens: a pytree of arrays of
      numbers, each a sum over the rows it is given). A statistics pass runs
      first: ``stats_fn`` on every micro-batch (``fn``'s positional
      arguments, with the micro-batch's rows and key), summed, and over
      ``axis_name`` (one ``psum``); then ``fn`` is called with one more
      keyword argument, ``stats=``, that sum, a constant. A loss that is a
      sum over its rows given ``stats`` (``normalize="sum"``, each term
      divided by its own global count from ``stats``), or a mean, is then
      the whole batch's exactly; ``"weighted"``'s denominator is such a
      statistic, for one term. A statistic kept per row (an axis of the rows)
      is summed over them. It costs a forward per micro-batch, no gradient
      (XLA drops what the statistics do not read). A statistic that is not
      an array of numbers, has a gradient (``jax.lax.stop_gradient`` takes
      it as a constant on purpose), follows the rows on no one axis, or is
      a max, min or mean over the rows (return sums and counts, divide in
      the loss) raises. Integers narrower than int32 are summed in int32
      (``stats=`` holds int32); other dtypes as ``accumulate`` sums them.
    **deprecated_options: 0.2's ``split``, ``rng_mode``, ``accumulator_dtype``
      and ``unroll``, accepted with a ``DeprecationWarning`` until 0.4.
      ``split="contiguous"`` and ``rng_mode="split"`` only reorder which rows
      and keys a micro-batch gets; ``accumulator_dtype`` narrower than the
      default rule loses precision; ``unroll`` is ``lax.scan``'s.

  Returns:
    A function with ``fn``'s signature returning ``(value, grads)`` (or
    ``((value, aux), grads)``), reduced over the micro-batches; with
    ``return_noise_stats=True``, ``((value, grads), stats)`` (or
    ``(((value, aux), grads), stats)``).

  Data parallel under plain jit: with the batch's leading dim sharded over
  **Explicit** mesh axes (visible in its type, e.g. ``float32[32@data,5]``),
  or over **Auto** ones named by ``axis_name``, the loop runs per device
  inside a ``shard_map`` over them: each device scans its own rows and the
  gradients are reduced once, after the loop. Params sharded over the data
  axes (FSDP) are all-gathered before it; each gradient comes back with its
  param's sharding, reduce-scattered onto it when that param is sharded
  over the data axes alone. ``fn`` then sees one device's rows: the results
  equal the full batch's for a per-example mean or sum (or ``"weighted"``),
  not for statistics across examples; per-example aux (``"concat"``, and
  ``"last"``/``"stack"`` of per-example values) comes back in batch order,
  other per-device aux raises. Without the name, Auto axes hide the split
  and ``jit`` reduces the gradients once per micro-batch; set that mesh
  (``jax.set_mesh``): under ``jit`` an Auto mesh the inputs are placed on is
  not in scope, and ``axis_name`` raises. A ``fn`` that cannot run on one
  device's rows (its loss runs its own ``shard_map`` over the data axes)
  gets whole micro-batches, as without a mesh: its own collectives then run
  once per micro-batch.

  Raises:
    ValueError: when called with a batch whose size ``num_microbatches`` does
      not divide, whose leaves disagree on the batch size, or with arguments
      that do not match ``batch_argnums``/``rng_argnums`` (overlapping, or
      naming position 0, the params). :func:`~optax_accum.cached_microbatched`
      raises the same errors for the same inputs.
    TypeError: when called with complex values and a real
      ``accumulator_dtype`` (a deprecated option).
    ValueError: under plain ``jit``, for batch leaves split differently over
      the mesh, ``axis_name`` naming axes the batch is not split over, of
      mixed kinds or bound nowhere (no mesh set, no shard_map), a mesh
      mixing Auto and Explicit axes where a split could not be seen, or a
      batch not divisible into ``k`` micro-batches per device.

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

    The same loss with its denominator as a global statistic (a mixture of
    experts' load-balancing loss needs each expert's token count this way):

    >>> def token_count(w, batch):
    ...   return {"tokens": jnp.sum(batch["mask"])}
    >>> def loss_over_all(w, batch, stats):
    ...   return loss_sum(w, batch)[0] / stats["tokens"]
    >>> fn = microbatched(jax.value_and_grad(loss_over_all), 4, normalize="sum",
    ...                   global_stats=token_count)
    >>> loss, grads = fn(w, batch)
    >>> bool(jnp.allclose(loss, num / den)), bool(jnp.allclose(grads, g / den))
    (True, True)

    Complex parameters accumulate in complex64 (the imaginary part is kept):

    >>> def loss_c(w, x):
    ...   return jnp.sum(jnp.abs(x @ w) ** 2)
    >>> wc = jnp.array([1.0 + 2.0j, -0.5j])
    >>> xc = jnp.arange(8.0).reshape(4, 2) * (1 - 1j)
    >>> _, gc = microbatched(jax.value_and_grad(loss_c), 2, normalize="sum")(wc, xc)
    >>> gc.dtype, bool(jnp.allclose(gc, jax.grad(loss_c)(wc, xc)))
    (dtype('complex64'), True)

    The noise statistics of the micro-batches, folded into a running
    estimate:

    >>> from optax_accum import gradient_noise
    >>> fn = microbatched(jax.value_and_grad(loss_fn), 4, return_noise_stats=True)
    >>> (loss, grads), stats = fn(w, batch)
    >>> int(stats.window_count)
    4
    >>> state = gradient_noise.fold(gradient_noise.init(), stats)
    >>> int(state.num_windows)
    1

    Data parallel under plain jit, with the batch sharded over an Explicit
    axis (8 devices): one gradient all-reduce, after the loop.

    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> from optax_accum.debug import hlo_collectives
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    >>> with jax.set_mesh(mesh):
    ...   big = {"x": jnp.arange(64.0).reshape(32, 2) / 64, "y": jnp.ones(32)}
    ...   big = jax.device_put(big, P("data"))
    ...   step = jax.jit(microbatched(jax.value_and_grad(loss_fn), 4))
    ...   loss, grads = step(jax.device_put(w, P()), big)
    ...   ops = [(c.op, c.context) for c in hlo_collectives(step.lower(w, big).compile())]
    >>> ops   # () is after the loop; inside it would read (('while', 'body'),)
    [('all-reduce', ())]
    >>> ref = jax.grad(loss_fn)(w, jax.device_get(big))
    >>> bool(jnp.allclose(grads, ref, atol=1e-6))
    True
  """
  unknown = sorted(set(deprecated_options) - set(_DEPRECATED_OPTIONS))
  if unknown:
    raise TypeError(
        f"`microbatched` got unexpected keyword argument(s) {unknown}; it takes"
        " batch_argnums, has_aux, normalize, aux_rules, rng_argnums, axis_name,"
        " return_noise_stats and global_stats.")
  if deprecated_options:
    warnings.warn(
        f"`microbatched`'s {', '.join(f'`{n}=`' for n in sorted(deprecated_options))} is"
        " deprecated and goes in 0.4: micro-batches are strided rows with keys"
        " `jax.random.fold_in(key, i)`, the accumulators follow the default dtype rule"
        " (never narrower than the values) and `lax.scan` is not unrolled.",
        DeprecationWarning, stacklevel=2)
  old = {**_DEPRECATED_OPTIONS, **deprecated_options}
  if not callable(fn):
    raise TypeError(f"`fn` must be callable (e.g. jax.value_and_grad(loss)); got {fn!r}.")
  config = _Config(
      k=_batch.check_num_microbatches(num_microbatches),
      batch_argnums=_validation.check_argnums(batch_argnums, "batch_argnums"),
      rng_argnums=_validation.check_argnums(rng_argnums, "rng_argnums", empty_ok=True),
      has_aux=_validation.check_flag(has_aux, "has_aux"),
      normalize=_validation.check_choice(
          normalize, "normalize", _validation.REDUCTIONS,
          "Use 'mean' for a mean loss, 'sum' for a summed loss, or 'weighted' when"
          " `fn`'s value is (numerator, denominator)."),
      aux_rules=_check_aux_rules(aux_rules),
      split=_batch.check_split(old["split"]),
      rng_mode=_validation.check_choice(old["rng_mode"], "rng_mode", RNG_MODES,
                                        "Use 'fold_in' (default) or 'split'."),
      acc_dtype=_validation.check_accumulator_dtype(old["accumulator_dtype"]),
      axis_name=axis_name,
      unroll=old["unroll"],
      return_noise_stats=_validation.check_flag(return_noise_stats, "return_noise_stats"),
      global_stats=_global_stats.check_fn(global_stats),
  )

  @functools.wraps(fn)
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    call = functools.partial(fn, **kwargs)
    with _arrays.mesh_context(args):
      batch = _batch.of(args, config.batch_argnums, config.rng_argnums,
                        axis_name=config.axis_name, in_step=True)
      batch.check_divides(config.k)
      now = config if config.global_stats is None else dataclasses.replace(
          config, global_stats=_global_stats.summable(
              config.global_stats, args, batch.positions, batch.per_device_rows // config.k))
      if not batch.axes:  # one device, or inside shard_map/pmap
        return _run(call, now, _split_inputs(now, args, batch))
      return _run_on_mesh(call, now, args, batch)

  # Equinox warns of a "JAX-transformed callable" when a function's
  # `__wrapped__` chain reaches a module with array-like fields (its
  # `filter_value_and_grad` wrapper has a bool): keep the name, not the link.
  del wrapped.__wrapped__
  return wrapped


# ------------------------------------------------- stage 1: split the batch
def _split_inputs(config: _Config, args: tuple[Any, ...], batch: _batch.Batch) -> _Inputs:
  """The batch arguments reshaped for ``_batch.index``, the keys prepared, the rest device-varying.

  Inside ``shard_map``/``pmap`` the other arguments are cast to device-varying:
  else the transpose of a replicated input would all-reduce its gradient on
  every micro-batch.
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
  return _Inputs(rest, splits, keys)


# --------------------------------- stage 2: one micro-batch with its own key
def _call_microbatch(
    call: Callable[..., Any], config: _Config, inputs: _Inputs, idx: jax.Array,
) -> Any:
  """``call`` (``fn`` with its keyword arguments) on micro-batch ``idx``."""
  micro = {i: jax.tree.map(lambda x: _batch.index(x, idx, config.split), tree)
           for i, tree in inputs.splits.items()}
  # Never the key given (not even for k = 1).
  keys = {i: key[idx] if config.rng_mode == "split" else _batch.microbatch_key(key, idx)
          for i, key in inputs.keys.items()}
  return call(*_batch.micro_args(inputs.args, micro, keys))


# ------------------------------------------------------ stage 3: the loop
def _run(
    call: Callable[..., Any], config: _Config, inputs: _Inputs, scatter: list[Any] | None = None,
) -> Any:
  """Loops over the micro-batches, then reduces once and normalises.

  ``scatter`` (one entry per gradient leaf, or None) names the leaves that are
  reduce-scattered over ``axis_name`` instead of all-reduced: ``(dim, axes)``.
  """
  leaves = _arrays.ArrayLeaves.of(inputs)  # only arrays are abstract (Equinox modules' functions)
  varying = any(_arrays.array_type(x).varying for x in leaves.arrays)
  if config.global_stats is not None:  # the statistics pass: a forward per micro-batch
    call = functools.partial(call, stats=_sum_stats(config, inputs, leaves, varying))
  step = functools.partial(_call_microbatch, call, config)
  shapes = _batch.unpack(jax.eval_shape(
      lambda *a: step(leaves.rebuild(a), jnp.zeros([], jnp.int32)), *leaves.arrays),
      config.normalize, config.has_aux)
  _validation.check_no_float0(shapes.grads, where="gradient `fn` returns")
  plan = _resolve_aux_rules(config, shapes.aux)

  def body(carry: _Carry, idx: jax.Array) -> _Carry:
    out = _batch.unpack(step(inputs, idx), config.normalize, config.has_aux)
    return _add(config, plan, carry, out, idx)

  carry = _loop(config, body, _init_carry(config, plan, shapes), varying)
  num, grads, stats = _normalize(config, carry, scatter)
  num = jax.tree.map(lambda x, s: x.astype(s.dtype), num, shapes.num)
  grads = jax.tree.map(lambda x, s: x.astype(s.dtype), grads, shapes.grads)
  aux = jax.tree.unflatten(plan.treedef, [
      rule.finalize(c) for rule, c in zip(plan.programs, carry.aux, strict=True)])
  out = ((num, aux) if config.has_aux else num), grads
  return (out, stats) if config.return_noise_stats else out


def _sum_stats(config: _Config, inputs: _Inputs, leaves: _arrays.ArrayLeaves,
               varying: bool) -> Any:
  """``global_stats`` summed over the micro-batches, then over ``axis_name`` (one ``psum``).

  Each micro-batch's statistics, on the rows and key ``fn`` gets, added in the
  dtypes ``_global_stats.sum_dtype`` gives (integers in int32 or wider); no gradient.
  """
  at = functools.partial(_call_microbatch, config.global_stats, config)
  shapes = jax.eval_shape(lambda *a: at(leaves.rebuild(a), jnp.zeros([], jnp.int32)),
                          *leaves.arrays)
  init = jax.tree.map(lambda s: _filled(s, _global_stats.sum_dtype(s.dtype, config.acc_dtype)),
                      shapes)
  total = _loop(config, lambda c, i: jax.tree.map(
      lambda t, x: t + jnp.asarray(x).astype(t.dtype), c, at(inputs, i)), init, varying)
  if config.axis_name is not None:
    total = lax.psum(total, config.axis_name)
  return lax.stop_gradient(total)


def _filled(s: jax.ShapeDtypeStruct, dtype: Any, fill: Any = 0) -> jax.Array:
  """``fill`` shaped like ``s``; under explicit sharding also sharded like ``s``.

  A ``lax.scan`` carry must keep its type, and under explicit sharding the
  type includes the sharding (a gradient sharded over a ``"model"`` axis).
  """
  return jnp.full(s.shape, fill, dtype, out_sharding=_arrays.array_type(s).explicit_spec)


def _init_carry(config: _Config, plan: _AuxPlan, shapes: _batch.Out) -> _Carry:
  """Zero accumulators shaped like one micro-batch's output, in the accumulator dtypes."""
  num, grads = jax.tree.map(lambda s: _filled(s, _acc_dtype(s.dtype, config.acc_dtype)),
                            (shapes.num, shapes.grads))
  den = None
  if shapes.den is not None:
    # An integer token count is summed as a float, like the value it divides.
    den = jnp.zeros([], _acc_dtype(shapes.den.dtype, config.acc_dtype, mean=True))
  aux = [rule.init(s) for rule, s in zip(plan.programs, plan.shapes, strict=True)]
  noise = noise_lib.init() if config.return_noise_stats else ()
  return _Carry(num, den, grads, aux, noise)


def _add(
    config: _Config, plan: _AuxPlan, carry: _Carry, out: _batch.Out, idx: jax.Array,
) -> _Carry:
  """One loop step: micro-batch ``idx``'s outputs ``out`` added to the carry."""
  num, den, grads = jax.tree.map(  # den: None (no leaves) unless normalize="weighted"
      lambda c, x: c + jnp.asarray(x).astype(c.dtype), (carry.num, carry.den, carry.grads),
      (out.num, out.den, out.grads))
  noise = _add_noise(carry.noise, out) if config.return_noise_stats else ()
  aux = [rule.update(c, v, idx) for rule, c, v in
         zip(plan.programs, carry.aux, plan.treedef.flatten_up_to(out.aux), strict=True)]
  return _Carry(num, den, grads, aux, noise)


def _add_noise(noise: noise_lib.NoiseScaleState, out: _batch.Out,
               ) -> noise_lib.NoiseScaleState:
  """One micro-batch's (weighted) squared gradient norm: a scalar, no gradient-sized buffer.

  Weighted: ``fn``'s grads are those of the numerator ``n``, the micro-batch's
  mean gradient is ``g = grad n / d`` and its weight ``w = d``, so
  ``w |g|^2 = |grad n|^2 / d``. A micro-batch of weight 0 is not counted.
  """
  sq = noise_lib.sq_norm(out.grads)
  den = None if out.den is None else jnp.asarray(out.den).astype(jnp.float32)
  # Weighted: |g|^2 = |grad n|^2 / d^2 (NaN for d = 0, which does not count).
  return noise_lib.add_micro_batch(noise, sq if den is None else sq / den / den, True, den)


def _loop(config: _Config, body: Callable[[_Carry, jax.Array], _Carry], init: _Carry,
          varying: bool) -> _Carry:
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
def _normalize(
    config: _Config, carry: _Carry, scatter: list[Any] | None,
) -> tuple[Any, Any, noise_lib.WindowStats | None]:
  """The sums to the outputs (before the cast back), and the window's noise statistics.

  One reduction over ``axis_name`` (``_window.all_reduce``: the value, the
  denominator, the noise sums and every gradient leaf not reduce-scattered),
  then the sums times ``_window.reduction_scale``, the rule ``accumulate``
  uses: ``1 / (k * devices)``, ``1 / denominator`` (0 for a denominator of 0)
  or 1.
  """
  noise = carry.noise
  # The count rides as a float32 scalar: one dtype, one all-reduce with the gradients.
  window = ((noise.window_sq_norms, noise.window_count.astype(jnp.float32))
            if config.return_noise_stats else ())
  (num, den, window), grads = (carry.num, carry.den, window), carry.grads
  devices = 1
  if config.axis_name is not None:
    (num, den, window), grads = _window.all_reduce(config.axis_name, (num, den, window), grads,
                                                   scatter)
    devices = lax.axis_size(config.axis_name)

  def scaled(x: jax.Array) -> jax.Array:
    return x * _window.reduction_scale(config.normalize, config.k * devices, den, x.dtype)

  num, grads = jax.tree.map(scaled, (num, grads))
  stats = _window_stats(config, window, den, grads, scatter) if config.return_noise_stats else None
  return num, grads, stats


def _window_stats(
    config: _Config, window: tuple[jax.Array, jax.Array], den: Any, grads: Any,
    scatter: list[Any] | None,
) -> noise_lib.WindowStats:
  """The micro-batches' noise statistics (over all devices), as ``accumulate`` keeps them.

  ``window`` is the open window's ``(sum of w |g|^2, count as a float)``. The window's
  mean gradient is the weighted or plain mean output; for ``normalize="sum"``
  it is the summed output over the count of micro-batches.
  """
  sq_norms, count = window
  leaves = jax.tree.leaves(grads)
  scatter = scatter or [None] * len(leaves)
  mean_sq = noise_lib.sq_norm([g for g, s in zip(leaves, scatter, strict=True) if s is None])
  scattered = [g for g, s in zip(leaves, scatter, strict=True) if s is not None]
  if scattered:  # each device holds a slice of these leaves
    mean_sq = mean_sq + lax.psum(noise_lib.sq_norm(scattered), config.axis_name)
  if config.normalize == "sum":
    mean_sq = mean_sq / jnp.maximum(count, 1.0) ** 2
  total = den.astype(jnp.float32) if config.normalize == "weighted" else count
  return noise_lib.WindowStats(sq_norms, count.astype(jnp.int32), total, mean_sq)


# ----------------------------------------------------- stage 6: aux rules
_CROSS_DEVICE = {"mean": lax.pmean, "sum": lax.psum, "max": lax.pmax, "min": lax.pmin}


def _resolve_aux_rules(config: _Config, aux_shapes: Any) -> _AuxPlan:
  """Matches the ``aux_rules`` prefix tree against the aux shape tree (no rules without aux)."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(
      config.aux_rules if config.has_aux else None, is_leaf=_is_rule)
  try:
    subtrees = treedef.flatten_up_to(aux_shapes)
  except (ValueError, TypeError) as e:
    raise ValueError(
        "`aux_rules` must be one rule or a pytree of rules that is a prefix of"
        f" the aux returned by `fn`; rules have structure {treedef} but the aux"
        f" is {jax.tree.structure(aux_shapes)}. ({e})"
    ) from e
  rules = [r for _, r in leaves]
  where = ["aux" + jax.tree_util.keystr(p) for p, _ in leaves]
  programs = [_program(config, r, s, w) for r, s, w in zip(rules, subtrees, where, strict=True)]
  return _AuxPlan(rules, programs, subtrees, where, treedef)


def _program(config: _Config, rule: str | AuxRule, shapes: Any, where: str) -> AuxRule:
  """What ``rule`` runs over the micro-batches: a built-in rule as an :class:`AuxRule`.

  Raises for ``"concat"`` of an aux leaf with no leading (per-example) dim.
  """
  if isinstance(rule, AuxRule):
    return rule
  scalars = [p for p, s in jax.tree_util.tree_flatten_with_path(shapes)[0] if not s.shape]
  if rule == "concat" and scalars:
    raise ValueError(
        "aux_rules='concat' needs per-example outputs with a leading batch dimension, but"
        f" the aux leaf at {where}{jax.tree_util.keystr(scalars[0])} has shape (). Use"
        " 'stack' to collect one value per micro-batch.")

  def init(shapes: Any) -> Any:
    return jax.tree.map(lambda s: _leaf_init(config, rule, s), shapes)

  def update(carry: Any, value: Any, idx: jax.Array) -> Any:
    def one(c: jax.Array, v: Any) -> jax.Array:
      v = jnp.asarray(v)  # a Python number too (a count the loss returns as an int)
      if rule in ("stack", "concat"):  # micro-batch idx's values, into a [k, ...] buffer
        return lax.dynamic_update_index_in_dim(c, v, idx, 0)
      if rule in ("max", "min"):
        return jnp.maximum(c, v) if rule == "max" else jnp.minimum(c, v)
      return v if rule == "last" else c + v.astype(c.dtype)
    return jax.tree.map(one, carry, value)

  def finalize(carry: Any) -> Any:
    if rule == "stack":
      return carry
    if rule == "concat":  # [k, m, ...] per micro-batch back to [k * m, ...] in batch order
      return _batch.unsplit(carry, config.split)
    return jax.tree.map(lambda c, s: _leaf_finalize(config, rule, c, s), carry, shapes)

  return AuxRule(init, update, finalize)


def _leaf_init(config: _Config, rule: str, s: jax.ShapeDtypeStruct) -> jax.Array:
  """A built-in rule's state for one aux leaf before the first micro-batch."""
  if rule in ("stack", "concat"):
    spec = _arrays.array_type(s).explicit_spec
    return jnp.zeros((config.k, *s.shape), s.dtype,
                     out_sharding=None if spec is None else P(None, *spec))
  if rule in ("mean", "sum"):
    return _filled(s, _acc_dtype(s.dtype, config.acc_dtype, mean=rule == "mean"))
  if rule == "last":
    return _filled(s, s.dtype)
  if jnp.issubdtype(s.dtype, jnp.inexact):
    start = -jnp.inf if rule == "max" else jnp.inf
  elif jnp.issubdtype(s.dtype, jnp.bool_):
    start = rule == "min"
  else:
    start = getattr(jnp.iinfo(s.dtype), "min" if rule == "max" else "max")
  return _filled(s, s.dtype, start)


def _leaf_finalize(config: _Config, rule: str, c: jax.Array, s: jax.ShapeDtypeStruct) -> Any:
  """A carried built-in rule's output for one aux leaf, reduced across devices."""
  if rule == "mean":
    c = c / config.k
  if rule in _CROSS_DEVICE and config.axis_name is not None:
    c = _CROSS_DEVICE[rule](c, config.axis_name)
  return c if rule == "mean" and not jnp.issubdtype(s.dtype, jnp.inexact) else c.astype(s.dtype)


# ---------------------------------------------- plain jit: the batch on a mesh
def _run_on_mesh(call: Callable[..., Any], config: _Config, args: tuple[Any, ...],
                 batch: _batch.Batch) -> Any:
  """Plain ``jit``: the loop run per device over the data ``axes``, reduced once after it.

  Each device scans over its own rows with ``axis_name`` set to the data axes
  (the ``shard_map`` path); outside, each gradient takes the sharding of the
  parameter it belongs to, reduce-scattered onto it inside when that param is
  sharded over the data axes alone. Under Auto axes the types hold no
  shardings: everything is all-reduced, and the partitioner places the result.
  """
  axes = batch.axes
  rows = batch.per_device_rows // config.k  # per device and micro-batch
  inner = dataclasses.replace(config, axis_name=_arrays.spec_entry(axes))
  try:
    shapes = _abstract_outputs(call, config, args, batch.positions, rows)
  except ValueError:  # not on one device's rows (`fn` runs its own shard_map over the data axes)
    whole = dataclasses.replace(config, axis_name=None)  # as written: every device's rows
    return _run(call, whole, _split_inputs(whole, args, batch))
  targets = scatter = None
  if _arrays.axis_kind(axes) == "Explicit":
    targets = _batch.param_specs(args[_batch.PARAMS], shapes.grads)
    scatter = targets and [_per_device.scatter_dim(spec, axes) for spec in targets]

  def body(*per_device_args: Any) -> Any:
    return _run(call, inner, _split_inputs(inner, per_device_args, batch), scatter)

  out = _per_device.run(body, args, batch.positions, axes,
                        _out_specs(inner, axes, shapes, scatter, rows))
  if targets is None:
    return out
  (value, grads), stats = out if config.return_noise_stats else (out, None)
  grads = _batch.to_params(grads, args[_batch.PARAMS])
  return ((value, grads), stats) if config.return_noise_stats else (value, grads)


def _abstract_outputs(call: Callable[..., Any], config: _Config, args: tuple[Any, ...],
                      b_nums: tuple[int, ...], rows: int) -> _batch.Out:
  """``fn``'s output shapes on one device's micro-batch of ``rows`` examples (for out_specs)."""
  stats = config.global_stats
  out = _batch.at_rows(call if stats is None else lambda *a: call(*a, stats=stats(*a)),
                       args, b_nums, rows)
  return _batch.unpack(out, config.normalize, config.has_aux)


def _out_specs(config: _Config, axes: tuple[Any, ...], shapes: _batch.Out,
               scatter: list[Any] | None, rows: int) -> Any:
  """``shard_map`` out_specs: reduced outputs replicated, per-example aux split like the batch."""
  rep = P()
  leaves, treedef = jax.tree.flatten(shapes.grads)
  grads = jax.tree.unflatten(treedef, [
      rep if s is None else P(*[None] * s[0], _arrays.spec_entry(s[1]))
      for s in scatter or [None] * len(leaves)])
  value = (rep, _aux_specs(config, axes, shapes.aux, rows)) if config.has_aux else rep
  return ((value, grads), rep) if config.return_noise_stats else (value, grads)


def _aux_specs(config: _Config, axes: tuple[Any, ...], aux: Any, rows: int) -> Any:
  """The out_specs of the aux: per rule, reduced (replicated) or split like the batch."""
  plan = _resolve_aux_rules(config, aux)
  parts = []
  for rule, shapes, where in zip(plan.rules, plan.shapes, plan.where, strict=True):
    if isinstance(rule, str) and rule in _CROSS_DEVICE:
      parts.append(P())
      continue
    bad = [where + jax.tree_util.keystr(p) for p, s in jax.tree_util.tree_flatten_with_path(
        shapes)[0] if rule != "concat" and (
            isinstance(rule, AuxRule) or not s.shape or s.shape[0] != rows)]
    if bad:
      raise ValueError(
          f"aux_rules={rule!r} at {bad[0]} keeps one value per device, and under plain"
          f" jit with the batch split over {axes} microbatched can only join per-example"
          f" values (a leading dim of the {rows} rows each device holds per"
          " micro-batch). Use 'mean', 'sum', 'max' or 'min' there, or call"
          " microbatched(..., axis_name=...) inside your own shard_map and choose"
          " its out_specs.")
    parts.append(P(*(None,) * (rule == "stack"), _arrays.spec_entry(axes)))
  return jax.tree.unflatten(plan.treedef, parts)
