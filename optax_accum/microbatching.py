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
import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_accum import _arrays, _validation, _window, gradient_noise

__all__ = [
    "AUX_RULES",
    "AuxRule",
    "microbatched",
    "split_microbatches",
]

SPLITS = ("strided", "contiguous")
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


def _check_choice(value: Any, name: str, choices: tuple[str, ...], hint: str) -> str:
  if value not in choices:
    raise ValueError(f"`{name}` must be one of {choices}; got {value!r}. {hint}")
  return value


def _as_argnums(argnums: Any, name: str) -> tuple[int, ...]:
  if isinstance(argnums, (int, np.integer)) and not isinstance(argnums, bool):
    return (int(argnums),)
  if isinstance(argnums, Sequence) and not isinstance(argnums, str) and all(
      isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in argnums):
    return tuple(int(a) for a in argnums)
  raise TypeError(
      f"`{name}` must be an int or a sequence of ints (positions of `fn`'s"
      f" arguments); got {argnums!r}. Pass e.g. `{name}=1`."
  )


def _resolve_argnums(argnums: tuple[int, ...], nargs: int, name: str) -> tuple[int, ...]:
  out = []
  for a in argnums:
    if not -nargs <= a < nargs:
      raise ValueError(
          f"`{name}` contains {a}, but the wrapped function was called with"
          f" {nargs} positional argument(s). Pass the batch (and keys)"
          f" positionally, or set `{name}` to their positions."
      )
    out.append(a % nargs)
  return tuple(out)


def _batch_size(batches: dict[int, Any], k: int) -> int:
  """The common leading dim of every leaf of the batch arguments."""
  sizes: list[tuple[str, int]] = []
  for argnum, tree in batches.items():
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not leaves:
      raise ValueError(
          f"The batch argument {argnum} of `fn` has no array leaves, so it"
          " cannot be split. Pass a pytree of arrays with a leading batch"
          " dimension, or fix `batch_argnums`."
      )
    for path, leaf in leaves:
      where = f"argument {argnum}{jax.tree_util.keystr(path)}"
      if jnp.ndim(leaf) == 0:
        raise ValueError(
            f"The batch leaf at {where} is a scalar; every batch leaf needs a"
            " leading batch dimension. Add one, or pass this value outside the"
            " batch (it is then given to every micro-batch unchanged)."
        )
      sizes.append((where, int(jnp.shape(leaf)[0])))
  first_where, size = sizes[0]
  for where, s in sizes[1:]:
    if s != size:
      raise ValueError(
          f"The batch leaves disagree on the batch size: {first_where} has"
          f" {size} rows but {where} has {s}. Every batch leaf must share its"
          " leading dimension."
      )
  if size % k != 0:
    divisors = [d for d in range(1, size + 1) if size % d == 0]
    raise ValueError(
        f"A batch of {size} examples cannot be split into num_microbatches={k}"
        f" equal micro-batches ({size} % {k} = {size % k}). Use a"
        f" num_microbatches that divides {size} (one of {divisors}), or pad the"
        " batch to a multiple of it and mask the padding (normalize='weighted')."
    )
  return size


def split_microbatches(tree: Any, num_microbatches: int, split: str = "strided") -> Any:
  """Splits a batch pytree into a stacked ``[k, batch // k, ...]`` pytree.

  The same split :func:`microbatched` uses, exposed for inspection and for
  reference computations. With ``split="strided"`` micro-batch ``i`` holds
  rows ``i, i + k, i + 2k, ...`` (a reshape to ``[batch // k, k, ...]``, so a
  batch sharded along its leading dim stays sharded without any data
  movement); with ``"contiguous"`` it holds rows ``i * m ... (i + 1) * m - 1``.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_accum.microbatching import split_microbatches
    >>> split_microbatches(jnp.arange(6), 2).tolist()
    [[0, 2, 4], [1, 3, 5]]
    >>> split_microbatches(jnp.arange(6), 2, "contiguous").tolist()
    [[0, 1, 2], [3, 4, 5]]
  """
  k = _validation.check_k(num_microbatches, "num_microbatches")
  _check_choice(split, "split", SPLITS, "Use 'strided' (default) or 'contiguous'.")
  _batch_size({0: tree}, k)
  return jax.tree.map(lambda x: _index(_reshape(x, k, split), slice(None), split), tree)


def _reshape(x: jax.Array, k: int, split: str) -> jax.Array:
  """``[B, ...]`` to ``[B // k, k, ...]`` (strided) or ``[k, B // k, ...]``."""
  x = jnp.asarray(x)
  m = x.shape[0] // k
  if split == "strided":
    return x.reshape((m, k, *x.shape[1:]))
  return x.reshape((k, m, *x.shape[1:]))


def _index(x: jax.Array, i: Any, split: str) -> jax.Array:
  """Micro-batch ``i`` of a reshaped leaf (all of them for ``i = slice``)."""
  if isinstance(i, slice):
    return jnp.swapaxes(x, 0, 1) if split == "strided" else x
  axis = 1 if split == "strided" else 0
  return lax.dynamic_index_in_dim(x, i, axis=axis, keepdims=False)


def _unstack_concat(stacked: jax.Array, split: str, what: str) -> jax.Array:
  """``[k, m, ...]`` per-micro-batch rows back to ``[k * m, ...]`` batch order."""
  if stacked.ndim < 2:
    raise ValueError(
        f"aux_rules='concat' needs per-example outputs with a leading batch"
        f" dimension, but the aux leaf at {what} has shape {stacked.shape[1:]}."
        " Use 'stack' to collect one value per micro-batch."
    )
  if split == "strided":
    stacked = jnp.swapaxes(stacked, 0, 1)
  return stacked.reshape((-1, *stacked.shape[2:]))


def _is_float(dtype: Any) -> bool:
  return jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating)


def _acc_dtype(dtype: Any, requested: jnp.dtype | None) -> Any:
  """The dtype that sums values of ``dtype``: the shared rule for floats and complex.

  ``requested=None`` never narrows (bf16/f16 -> f32, f64 -> f64, complex stays
  complex); an explicit dtype is used as given. Other dtypes (integer aux
  sums) keep their own, which is exact.
  """
  if _is_float(dtype):
    return _arrays.accumulator_dtype(dtype, requested)
  return dtype


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


class _Inputs(NamedTuple):
  """``fn``'s positional arguments, prepared for the loop."""

  args: list[Any]  # as given; batch and key positions are replaced per micro-batch
  splits: dict[int, Any]  # batch position -> its leaves reshaped by `_reshape`
  keys: dict[int, Any]  # key position -> the key (fold_in) or k keys (split)


class _Out(NamedTuple):
  """One output of ``fn``, unpacked."""

  num: Any  # the value (the numerator with normalize="weighted")
  den: Any  # the scalar denominator with normalize="weighted", else None
  aux: Any  # the aux with has_aux=True, else None
  grads: Any


class _Carry(NamedTuple):
  """The loop carry: running sums and the aux rules' states."""

  num: Any
  den: Any
  grads: Any
  aux: list[Any]  # one state per aux rule
  noise: gradient_noise.NoiseScaleState | tuple[()] = ()  # its open window's sums


class _AuxPlan(NamedTuple):
  """``aux_rules`` matched against the aux of one micro-batch."""

  rules: list[str | AuxRule]
  shapes: list[Any]  # the aux subtree (of ShapeDtypeStructs) under each rule
  where: list[str]  # each rule's position in the aux, for error messages
  treedef: Any  # the structure of `aux_rules`


# ---------------------------------------------------------------- options
def _check_fn(fn: Any) -> None:
  if not callable(fn):
    raise TypeError(f"`fn` must be callable (e.g. jax.value_and_grad(loss)); got {fn!r}.")


def _check_num_microbatches(num_microbatches: Any) -> int:
  if isinstance(num_microbatches, (float, np.floating)):
    raise TypeError(
        "`num_microbatches` must be a positive int (it fixes the micro-batch"
        f" shapes); got {num_microbatches!r} of type {type(num_microbatches).__name__}."
        " Pass e.g. `num_microbatches=4`."
    )
  k = _validation.check_k(num_microbatches, "num_microbatches")
  if callable(k):
    raise TypeError(
        "`num_microbatches` must be a positive int; schedules are not supported"
        " inside one step (shapes must be static). Pass e.g. `num_microbatches=4`."
    )
  return k


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
) -> Callable[..., Any]:
  r"""Runs a value-and-grad function over ``k`` micro-batches in one ``lax.scan``.

  ``fn(params, batch, *rest) -> (value, grads)`` is typically
  ``jax.value_and_grad(loss_fn)``. The wrapper has the same signature and
  outputs. Each batch argument (any pytree of arrays with a common leading
  batch dimension ``B``) is split into ``k`` micro-batches of ``B // k``
  examples; the other arguments are given unchanged to every micro-batch.
  Micro-batch ``i`` holds rows ``i, i + k, ...`` (a reshape that keeps a
  batch-sharded input on its devices; split over devices, each device splits
  its own rows the same way, so together the devices' micro-batch ``i`` is
  the one-device micro-batch ``i``). Values and gradients are summed into
  accumulators initialised to zero from
  ``jax.eval_shape`` and reduced once after the loop; the outputs are cast
  back to the dtypes ``fn`` returns. Peak activation memory is that of one
  micro-batch, plus one gradient-sized accumulator.

  Three normalisations (``normalize``):

  * ``"mean"`` (default): the mean over micro-batches of value and grads. For
    a loss that is a mean over examples, this *is* the full-batch call.
  * ``"sum"``: the sums (for a loss that sums over examples).
  * ``"weighted"``: token-weighted. ``fn``'s value is ``(numerator,
    denominator)`` — what ``jax.value_and_grad(loss_fn, has_aux=True)``
    returns when ``loss_fn`` returns ``(sum of per-token losses, number of
    real tokens)`` — and its grads are those of the numerator. With
    ``has_aux=True`` the value is ``(numerator, (denominator, aux))``.
    Numerators, denominators and gradients are summed over micro-batches and
    divided once: the outputs are :math:`\sum_i n_i / \sum_i d_i` and
    :math:`\sum_i \nabla n_i / \sum_i d_i`, exactly the full batch's mean over
    real tokens however the padding is spread (the mean of per-micro-batch
    means is not). A total denominator of 0 gives zeros, not NaN. The
    outputs have the shape of a mean-loss ``value_and_grad``: ``(loss,
    grads)`` or ``((loss, aux), grads)``.

  ``num_microbatches=1`` follows the same rules as any other ``k``: the aux
  rules apply (``"stack"`` gives a leading axis of 1), the key is derived as
  for micro-batch 0, and the division and ``axis_name`` reduction run. It
  calls ``fn`` once, without a loop, so a mean loss gives exactly ``fn``'s
  outputs.

  Args:
    fn: a function ``(*args) -> (value, grads)`` or, with ``has_aux=True``,
      ``((value, aux), grads)``. Put ``jax.checkpoint`` (per model block) and
      mixed-precision casts inside the loss that ``fn`` differentiates.
    num_microbatches: ``k``, a positive int dividing the batch size.
    batch_argnums: position(s) of the batch argument(s) of ``fn`` (default 1,
      as in ``fn(params, batch)``). They must be passed positionally.
    has_aux: whether ``fn``'s value carries an aux output.
    normalize: ``"mean"``, ``"sum"`` or ``"weighted"`` (see above).
    aux_rules: how each aux output is reduced over micro-batches: one rule for
      all, or a pytree of rules that is a prefix of the aux. Built-in rules:
      ``"mean"``, ``"sum"``, ``"max"``, ``"min"``, ``"last"``, ``"concat"``
      (per-example outputs, concatenated back in the original batch order)
      and ``"stack"`` (a new leading axis of ``k`` values, in micro-batch
      order); or an :class:`AuxRule` for anything else.
    rng_argnums: position(s) of PRNG key arguments (e.g. dropout keys). Each
      micro-batch gets its own key, never the same one twice. The key passed
      in is never given to ``fn`` itself, not even with ``k = 1``: micro-batch
      ``i`` gets ``jax.random.fold_in(key, i)``. With ``axis_name``, ``key``
      is first made per device: ``jax.random.fold_in(key,
      lax.axis_index(axis_name))``.
    axis_name: the mesh axis name (or tuple of names) over which the batch is
      split across devices. Each device accumulates its local micro-batches,
      and the results are reduced **once, after the loop**: a mean for
      ``"mean"``, a sum for ``"sum"``, and for ``"weighted"`` a sum of
      numerators, denominators and gradients before the one division, so the
      normalisation is global. Inside ``shard_map``/``pmap`` name their axes:
      non-batch arguments are cast to device-varying first, so that
      ``shard_map``'s autodiff does not insert an all-reduce into every
      micro-step. Under plain ``jit`` see "Data parallel under plain jit"
      below: Explicit axes need no ``axis_name``; Auto axes are named here.
      Aux rules ``mean``/``sum``/``max``/``min`` are reduced across devices
      too; ``last``, ``concat``, ``stack`` and custom rules stay per device.
    return_noise_stats: also return the gradient noise statistics of this
      call's micro-batches, a :class:`~optax_accum.gradient_noise.WindowStats`
      (the same sums ``accumulate(k, opt, track_noise_scale=True)`` keeps for
      a window of the same micro-batch gradients). Fold them into a running
      estimate with :func:`optax_accum.gradient_noise.fold` and read it with
      :func:`optax_accum.noise_scale` (in micro-batches). Each micro-batch
      adds one scalar, its squared gradient norm, to the loop carry: no
      gradient-sized memory. ``"weighted"`` weights micro-batch ``i`` by its
      denominator (a micro-batch of denominator 0 is not counted);
      ``"sum"`` takes the window's mean gradient as the sum over ``k``. Split
      over ``D`` devices, the statistics span all ``k * D`` per-device
      micro-batches, and their scalars ride in the one reduction after the
      loop. Under plain ``jit`` they need ``fn`` to be a per-example mean or
      sum (as for the results).

  0.2's ``split``, ``rng_mode``, ``accumulator_dtype`` and ``unroll`` are
  still accepted, with a ``DeprecationWarning``, until 0.4.
  ``split="contiguous"`` and ``rng_mode="split"`` only reorder which rows and
  keys a micro-batch gets (every normalisation is the same sum);
  ``accumulator_dtype`` narrower than the default rule loses precision;
  ``unroll`` is ``lax.scan``'s.

  Returns:
    A function with ``fn``'s signature returning ``(value, grads)`` (or
    ``((value, aux), grads)``), reduced over the micro-batches; with
    ``return_noise_stats=True``, ``((value, grads), stats)`` (or
    ``(((value, aux), grads), stats)``).

  Data parallel under plain jit:

  * **Explicit axes** (``jax.make_mesh(..., axis_types=(AxisType.Explicit,
    ...))`` and ``jax.set_mesh``): a batch whose leading dim is sharded over
    mesh axes (visible in its type, e.g. ``float32[32@data,5]``) is split
    there. No argument is needed: the loop runs inside a ``shard_map`` over
    those axes (the ``axis_name`` path above), so each device scans its own
    rows and the gradients are reduced once, after the loop. Non-batch
    arguments are made whole over the data axes before it (FSDP params: one
    all-gather); each gradient comes back with the sharding of the argument
    of its structure (the params), reduce-scattered onto it when that param
    is sharded over the data axes alone (``P("data")``), else all-reduced
    and sliced.
  * **Auto axes** (the default): types do not show the batch's sharding, so
    name the data axes, ``microbatched(fn, k, axis_name="data")``, and the
    same ``shard_map`` is applied for you over ``jax.set_mesh``'s mesh.
    Without it, ``jit`` reduces the gradients inside the loop, once per
    micro-batch.

  Either way ``fn`` runs per device on that device's rows of each
  micro-batch, like under ``shard_map``: the results equal the full batch's
  for a loss that is a mean or sum over examples (or ``"weighted"``), not
  for batch statistics across examples; ``fn`` must not name the data axes
  in sharding annotations; per-example aux (``"concat"``, and ``"last"`` and
  ``"stack"`` of per-example values) is put back in batch order, other
  per-device aux raises. On jax 0.10, ``shard_map``'s boundary all-gathers
  operands sharded over *other* Explicit axes (tensor parallel), once per
  call, outside the loop.

  Raises:
    ValueError: when called with a batch whose size ``num_microbatches`` does
      not divide, whose leaves disagree on the batch size, or with arguments
      that do not match ``batch_argnums``/``rng_argnums``.
    TypeError: when called with complex values and a real
      ``accumulator_dtype``.
    ValueError: under plain ``jit``, for batch leaves split differently over
      the mesh, ``axis_name`` naming axes the batch is not split over or of
      mixed kinds, a mesh mixing Auto and Explicit axes where a split could
      not be seen, or a batch not divisible into ``k`` micro-batches per
      device.

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
  return _build(fn, num_microbatches, batch_argnums, has_aux, normalize, aux_rules,
                rng_argnums, axis_name, return_noise_stats, **_DEPRECATED_OPTIONS)


def _build(
    fn: Callable[..., tuple[Any, Any]], num_microbatches: int, batch_argnums: Any,
    has_aux: bool, normalize: str, aux_rules: Any, rng_argnums: Any, axis_name: Any,
    return_noise_stats: bool, *, split: str, rng_mode: str, accumulator_dtype: Any,
    unroll: int | bool,
) -> Callable[..., Any]:
  """:func:`microbatched` with every option, the deprecated ones included."""
  _check_fn(fn)
  batch_nums = _as_argnums(batch_argnums, "batch_argnums")
  if not batch_nums:
    raise ValueError("`batch_argnums` is empty; name at least one batch argument of `fn`.")
  for name, flag in (("has_aux", has_aux), ("return_noise_stats", return_noise_stats)):
    if not isinstance(flag, bool):
      raise TypeError(f"`{name}` must be a bool; got {flag!r}.")
  config = _Config(
      k=_check_num_microbatches(num_microbatches),
      batch_argnums=batch_nums,
      rng_argnums=_as_argnums(rng_argnums, "rng_argnums") if rng_argnums != () else (),
      has_aux=has_aux,
      normalize=_check_choice(
          normalize, "normalize", _validation.REDUCTIONS,
          "Use 'mean' for a mean loss, 'sum' for a summed loss, or 'weighted' when"
          " `fn`'s value is (numerator, denominator)."),
      aux_rules=_check_aux_rules(aux_rules),
      split=_check_choice(split, "split", SPLITS, "Use 'strided' (default) or 'contiguous'."),
      rng_mode=_check_choice(rng_mode, "rng_mode", RNG_MODES,
                             "Use 'fold_in' (default) or 'split'."),
      acc_dtype=_validation.check_accumulator_dtype(accumulator_dtype),
      axis_name=axis_name,
      unroll=unroll,
      return_noise_stats=return_noise_stats,
  )

  @functools.wraps(fn)
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    call = functools.partial(fn, **kwargs)
    with _arrays.mesh_context(args):
      place = _place(config, args)
      if place is not None:
        return _run_on_mesh(call, config, place, args)
      return _run(call, config, _split_inputs(config, args))

  # Equinox warns of a "JAX-transformed callable" when a function's
  # `__wrapped__` chain reaches a module with array-like fields (its
  # `filter_value_and_grad` wrapper has a bool): keep the name, not the link.
  del wrapped.__wrapped__
  return wrapped


def _accepting_deprecated_options(public: Callable[..., Any]) -> Callable[..., Any]:
  """``public`` that also takes 0.2's options, with a warning, until 0.4.

  The signature (and ``help``) stay ``public``'s: the old keywords are taken
  out before the call, so an unknown keyword is still an error.
  """
  signature = inspect.signature(public)

  @functools.wraps(public)
  def accepting(*args: Any, **kwargs: Any) -> Any:
    old = {name: kwargs.pop(name) for name in _DEPRECATED_OPTIONS if name in kwargs}
    unknown = sorted(set(kwargs) - set(signature.parameters))
    if unknown:
      raise TypeError(
          f"`microbatched` got unexpected keyword argument(s) {unknown}; it takes"
          " batch_argnums, has_aux, normalize, aux_rules, rng_argnums, axis_name and"
          " return_noise_stats.")
    if not old:
      return public(*args, **kwargs)
    warnings.warn(
        f"`microbatched`'s {', '.join(f'`{n}=`' for n in sorted(old))} is deprecated"
        " and goes in 0.4: micro-batches are strided rows with keys"
        " `jax.random.fold_in(key, i)`, the accumulators follow the default dtype rule"
        " (never narrower than the values) and `lax.scan` is not unrolled.",
        DeprecationWarning, stacklevel=2)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return _build(**bound.arguments, **{**_DEPRECATED_OPTIONS, **old})

  return accepting


microbatched = _accepting_deprecated_options(microbatched)


# ------------------------------------------------- stage 1: split the batch
def _positions(config: _Config, nargs: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """The positions of the batch arguments and of the keys, for ``nargs`` arguments."""
  b_nums = _resolve_argnums(config.batch_argnums, nargs, "batch_argnums")
  r_nums = _resolve_argnums(config.rng_argnums, nargs, "rng_argnums")
  if set(b_nums) & set(r_nums):
    raise ValueError(
        f"`batch_argnums` {b_nums} and `rng_argnums` {r_nums} overlap; an"
        " argument is either split (batch) or a key (folded per micro-batch)."
    )
  return b_nums, r_nums


def _split_inputs(config: _Config, args: tuple[Any, ...]) -> _Inputs:
  """Checks the batch arguments and reshapes them for ``_index``; prepares the keys."""
  nargs = len(args)
  b_nums, r_nums = _positions(config, nargs)
  _batch_size({i: args[i] for i in b_nums}, config.k)
  rest = list(args)
  if config.axis_name is not None:
    for i in range(nargs):
      if i not in b_nums and i not in r_nums:
        rest[i] = _make_varying(rest[i], config.axis_name)
  splits = {i: jax.tree.map(lambda x: _reshape(x, config.k, config.split), args[i])
            for i in b_nums}
  keys = {i: _device_key(config, args[i]) for i in r_nums}
  return _Inputs(rest, splits, keys)


def _make_varying(tree: Any, axis_name: Any) -> Any:
  """Marks a replicated input device-varying (a no-op outside shard_map)."""
  names = _arrays.axis_names(axis_name)

  def one(leaf: Any) -> Any:
    if not isinstance(leaf, (jax.Array, np.ndarray)):
      return leaf
    have = _arrays.varying_axes(leaf)
    return _arrays.pcast_varying(leaf, tuple(n for n in names if n not in have))
  return jax.tree.map(one, tree)


# --------------------------------- stage 2: one micro-batch with its own key
def _device_key(config: _Config, key: jax.Array) -> jax.Array:
  """A key argument made per device; with ``rng_mode="split"``, split ``k`` ways."""
  if config.axis_name is not None:
    # Devices must not share the keys of their micro-batch i.
    key = jax.random.fold_in(key, lax.axis_index(config.axis_name))
  return jax.random.split(key, config.k) if config.rng_mode == "split" else key


def _microbatch_key(config: _Config, key: jax.Array, idx: jax.Array) -> jax.Array:
  """Micro-batch ``idx``'s key; never the key given (not even for ``k = 1``)."""
  return key[idx] if config.rng_mode == "split" else jax.random.fold_in(key, idx)


def _call_microbatch(
    call: Callable[..., Any], config: _Config, inputs: _Inputs, idx: jax.Array,
) -> Any:
  """``call`` (``fn`` with its keyword arguments) on micro-batch ``idx``."""
  args = list(inputs.args)
  for i, tree in inputs.splits.items():
    args[i] = jax.tree.map(lambda x: _index(x, idx, config.split), tree)
  for i, key in inputs.keys.items():
    args[i] = _microbatch_key(config, key, idx)
  return call(*args)


def _unpack(config: _Config, out: Any) -> _Out:
  """``fn``'s output to ``(numerator, denominator, aux, grads)``."""
  if not (isinstance(out, (tuple, list)) and len(out) == 2):
    raise TypeError(
        "`fn` must return `(value, grads)` like `jax.value_and_grad`; got"
        f" {jax.tree.structure(out)}."
    )
  value, grads = out
  if config.normalize == "weighted":
    return _Out(*_unpack_weighted(value, config.has_aux), grads)
  if not config.has_aux:
    return _Out(value, None, None, grads)
  if not (isinstance(value, (tuple, list)) and len(value) == 2):
    raise TypeError(
        "has_aux=True needs `fn` to return ((value, aux), grads), like"
        " jax.value_and_grad(loss, has_aux=True); got a value with structure"
        f" {jax.tree.structure(value)}."
    )
  return _Out(value[0], None, value[1], grads)


def _unpack_weighted(value: Any, has_aux: bool) -> tuple[Any, Any, Any]:
  """``fn``'s value under ``normalize="weighted"`` to ``(numerator, denominator, aux)``."""
  if not (isinstance(value, (tuple, list)) and len(value) == 2):
    raise TypeError(
        "normalize='weighted' needs `fn`'s value to be (numerator,"
        " denominator) — e.g. jax.value_and_grad(loss_fn, has_aux=True) with"
        " loss_fn returning (sum of token losses, number of real tokens) —"
        f" got a value with structure {jax.tree.structure(value)}."
    )
  num, den = value
  aux = None
  if has_aux:
    if not (isinstance(den, (tuple, list)) and len(den) == 2):
      raise TypeError(
          "normalize='weighted' with has_aux=True needs `fn`'s value to be"
          " (numerator, (denominator, aux)); got a value with structure"
          f" {jax.tree.structure(value)}."
      )
    den, aux = den
  if jnp.ndim(den) != 0:
    raise ValueError(
        "normalize='weighted' needs a scalar denominator (e.g. the count of"
        f" real tokens); got shape {jnp.shape(den)}. Sum it before returning."
    )
  return num, den, aux


# ------------------------------------------------------ stage 3: the loop
def _run(
    call: Callable[..., Any], config: _Config, inputs: _Inputs, scatter: list[Any] | None = None,
) -> Any:
  """Loops over the micro-batches, then reduces once and normalises.

  ``scatter`` (one entry per gradient leaf, or None) names the leaves that are
  reduce-scattered over ``axis_name`` instead of all-reduced: ``(dim, axes)``.
  """
  step = functools.partial(_call_microbatch, call, config)
  shapes = _unpack(config, _eval_shape(step, inputs, jnp.zeros([], jnp.int32)))
  _validation.check_no_float0(shapes.grads, where="gradient `fn` returns")
  plan = _resolve_aux_rules(config, shapes.aux) if config.has_aux else None

  def body(carry: _Carry, idx: jax.Array) -> tuple[_Carry, list[Any]]:
    return _add(config, plan, carry, _unpack(config, step(inputs, idx)), idx)

  init = _init_carry(config, plan, shapes)
  carry, stacked = _loop(config, body, init, _any_varying(inputs))
  num, grads, stats = _normalize(config, carry, scatter)
  num = jax.tree.map(lambda x, s: x.astype(s.dtype), num, shapes.num)
  grads = jax.tree.map(lambda x, s: x.astype(s.dtype), grads, shapes.grads)
  aux = None if plan is None else _aux_outputs(config, plan, carry.aux, stacked)
  out = ((num, aux) if config.has_aux else num), grads
  return (out, stats) if config.return_noise_stats else out


def _eval_shape(f: Callable[..., Any], *args: Any) -> Any:
  """``jax.eval_shape(f, *args)`` where only the array leaves of ``args`` are abstract."""
  inputs = _arrays.ArrayLeaves.of(args)
  return jax.eval_shape(lambda *arrays: f(*inputs.rebuild(arrays)), *inputs.arrays)


def _filled(s: jax.ShapeDtypeStruct, dtype: Any, fill: Any = 0) -> jax.Array:
  """``fill`` shaped like ``s``; under explicit sharding also sharded like ``s``.

  A ``lax.scan`` carry must keep its type, and under explicit sharding the
  type includes the sharding (a gradient sharded over a ``"model"`` axis).
  """
  return jnp.full(s.shape, fill, dtype, out_sharding=_arrays.explicit_spec(s))


def _init_carry(config: _Config, plan: _AuxPlan | None, shapes: _Out) -> _Carry:
  """Zero accumulators shaped like one micro-batch's output, in the accumulator dtypes."""
  def zeros(s: jax.ShapeDtypeStruct) -> jax.Array:
    return _filled(s, _acc_dtype(s.dtype, config.acc_dtype))

  num, grads = jax.tree.map(zeros, (shapes.num, shapes.grads))
  den = None
  if shapes.den is not None:
    # An integer token count is summed as a float, like the value it divides.
    den_dtype = shapes.den.dtype if _is_float(shapes.den.dtype) else jnp.float32
    den = jnp.zeros([], _acc_dtype(den_dtype, config.acc_dtype))
  aux = [] if plan is None else [
      _aux_init(config, r, s) for r, s in zip(plan.rules, plan.shapes, strict=True)]
  noise = ()
  if config.return_noise_stats:
    noise = gradient_noise.init()
  return _Carry(num, den, grads, aux, noise)


def _add(
    config: _Config, plan: _AuxPlan | None, carry: _Carry, out: _Out, idx: jax.Array,
) -> tuple[_Carry, list[Any]]:
  """One loop step: ``out`` added to the carry; the outputs the loop stacks."""
  num, grads = jax.tree.map(
      lambda c, x: c + x.astype(c.dtype), (carry.num, carry.grads), (out.num, out.grads))
  den = None
  if carry.den is not None:
    den = carry.den + jnp.asarray(out.den).astype(carry.den.dtype)
  noise = _add_noise(carry.noise, out) if config.return_noise_stats else ()
  if plan is None:
    return _Carry(num, den, grads, [], noise), []
  parts = plan.treedef.flatten_up_to(out.aux)
  aux = [_aux_update(r, c, v, idx) for r, c, v in zip(plan.rules, carry.aux, parts, strict=True)]
  ys = [v if _collects(r) else () for r, v in zip(plan.rules, parts, strict=True)]
  return _Carry(num, den, grads, aux, noise), ys


def _add_noise(noise: gradient_noise.NoiseScaleState, out: _Out,
               ) -> gradient_noise.NoiseScaleState:
  """One micro-batch's (weighted) squared gradient norm: a scalar, no gradient-sized buffer.

  Weighted: ``fn``'s grads are those of the numerator ``n``, the micro-batch's
  mean gradient is ``g = grad n / d`` and its weight ``w = d``, so
  ``w |g|^2 = |grad n|^2 / d``. A micro-batch of weight 0 is not counted.
  """
  sq = gradient_noise.sq_norm(out.grads)
  if out.den is None:
    return gradient_noise.add_micro_batch(noise, sq, True, None)
  den = jnp.asarray(out.den).astype(jnp.float32)
  # |g|^2 = |grad n|^2 / d^2 (NaN for d = 0, which does not count).
  return gradient_noise.add_micro_batch(noise, sq / den / den, True, den)


def _loop(
    config: _Config,
    body: Callable[[_Carry, jax.Array], tuple[_Carry, list[Any]]],
    init: _Carry,
    varying: bool,
) -> tuple[_Carry, list[Any]]:
  """Runs ``body`` for micro-batches ``0 .. k - 1``; stacks its outputs on a new axis."""
  with jax.named_scope("microbatched"):
    if config.k == 1:
      # One step needs no loop. A scan would compile `fn` as one program whose
      # fusions round differently from calling it: k = 1 stays bitwise `fn`.
      carry, ys = body(init, jnp.zeros([], jnp.int32))
      return carry, jax.tree.map(lambda y: jnp.asarray(y)[None], ys)
    if varying:
      # Inside shard_map the carry must vary over the same mesh axes as what
      # the body adds to it; match the zeros to one abstract step.
      out_carry = jax.eval_shape(lambda c: body(c, jnp.zeros([], jnp.int32))[0], init)
      init = jax.tree.map(_arrays.match_varying, init, out_carry)
    return lax.scan(body, init, jnp.arange(config.k, dtype=jnp.int32), unroll=config.unroll)


# ------------------------------------------- stages 4 and 5: reduce, normalise
def _normalize(
    config: _Config, carry: _Carry, scatter: list[Any] | None,
) -> tuple[Any, Any, gradient_noise.WindowStats | None]:
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
) -> gradient_noise.WindowStats:
  """The micro-batches' noise statistics (over all devices), as ``accumulate`` keeps them.

  ``window`` is the open window's ``(sum of w |g|^2, count as a float)``. The window's
  mean gradient is the weighted or plain mean output; for ``normalize="sum"``
  it is the summed output over the count of micro-batches.
  """
  sq_norms, count = window
  leaves = jax.tree.leaves(grads)
  scatter = scatter or [None] * len(leaves)
  mean_sq = gradient_noise.sq_norm([g for g, s in zip(leaves, scatter, strict=True) if s is None])
  scattered = [g for g, s in zip(leaves, scatter, strict=True) if s is not None]
  if scattered:  # each device holds a slice of these leaves
    mean_sq = mean_sq + lax.psum(gradient_noise.sq_norm(scattered), config.axis_name)
  if config.normalize == "sum":
    mean_sq = mean_sq / jnp.maximum(count, 1.0) ** 2
  total = den.astype(jnp.float32) if config.normalize == "weighted" else count
  return gradient_noise.WindowStats(sq_norms, count.astype(jnp.int32), total, mean_sq)


def _all_reduce(config: _Config, tree: Any, op: Callable[[Any, Any], Any]) -> Any:
  """``op`` (``lax.psum``, ``pmean``, ...) over ``axis_name``; a no-op without it."""
  return tree if config.axis_name is None else op(tree, config.axis_name)


# ----------------------------------------------------- stage 6: aux rules
_COLLECTED = ("concat", "stack")  # rules whose values the loop stacks, not carries
_CROSS_DEVICE = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}
_LEAF_UPDATES = {
    "mean": lambda c, v: c + v.astype(c.dtype),
    "sum": lambda c, v: c + v.astype(c.dtype),
    "max": jnp.maximum,
    "min": jnp.minimum,
    "last": lambda c, v: v,
}


def _collects(rule: str | AuxRule) -> bool:
  return isinstance(rule, str) and rule in _COLLECTED


def _resolve_aux_rules(config: _Config, aux_shapes: Any) -> _AuxPlan:
  """Matches the ``aux_rules`` prefix tree against the aux shape tree."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(config.aux_rules, is_leaf=_is_rule)
  try:
    subtrees = treedef.flatten_up_to(aux_shapes)
  except (ValueError, TypeError) as e:
    raise ValueError(
        "`aux_rules` must be one rule or a pytree of rules that is a prefix of"
        f" the aux returned by `fn`; rules have structure {treedef} but the aux"
        f" is {jax.tree.structure(aux_shapes)}. ({e})"
    ) from e
  return _AuxPlan(rules=[r for _, r in leaves], shapes=subtrees,
                  where=["aux" + jax.tree_util.keystr(p) for p, _ in leaves],
                  treedef=treedef)


def _aux_init(config: _Config, rule: str | AuxRule, shapes: Any) -> Any:
  """The state of one rule before the first micro-batch."""
  if isinstance(rule, AuxRule):
    return rule.init(shapes)
  if _collects(rule):
    return ()
  return jax.tree.map(lambda s: _leaf_init(config, rule, s), shapes)


def _leaf_init(config: _Config, rule: str, s: jax.ShapeDtypeStruct) -> jax.Array:
  if rule in ("mean", "sum"):
    dtype = _acc_dtype(s.dtype, config.acc_dtype)
    if rule == "mean" and not _is_float(dtype):
      dtype = jnp.float32  # the mean of integers
    return _filled(s, dtype)
  if rule == "last":
    return _filled(s, s.dtype)
  if _is_float(s.dtype):
    start = -jnp.inf if rule == "max" else jnp.inf
  elif jnp.issubdtype(s.dtype, jnp.bool_):
    start = rule == "min"
  else:
    info = jnp.iinfo(s.dtype)
    start = info.min if rule == "max" else info.max
  return _filled(s, s.dtype, start)


def _aux_update(rule: str | AuxRule, carry: Any, value: Any, idx: jax.Array) -> Any:
  """One rule's state after micro-batch ``idx``, whose aux subtree is ``value``."""
  if isinstance(rule, AuxRule):
    return rule.update(carry, value, idx)
  if _collects(rule):
    return carry
  return jax.tree.map(_LEAF_UPDATES[rule], carry, value)


def _aux_outputs(config: _Config, plan: _AuxPlan, carries: list[Any], stacked: list[Any]) -> Any:
  """The aux output: each rule's final state (or stacked values) in the aux structure."""
  parts = [
      _aux_finalize(config, r, c, y, s, w)
      for r, c, y, s, w in zip(plan.rules, carries, stacked, plan.shapes, plan.where,
                               strict=True)
  ]
  return jax.tree.unflatten(plan.treedef, parts)


def _aux_finalize(
    config: _Config, rule: str | AuxRule, carry: Any, stacked: Any, shapes: Any, where: str,
) -> Any:
  """One rule's output from its state, or from its values stacked ``[k, ...]``."""
  if isinstance(rule, AuxRule):
    return rule.finalize(carry)
  if rule == "stack":
    return stacked
  if rule == "concat":
    leaves, treedef = jax.tree_util.tree_flatten_with_path(stacked)
    return jax.tree.unflatten(treedef, [
        _unstack_concat(x, config.split, where + jax.tree_util.keystr(p)) for p, x in leaves])

  def one(c: jax.Array, s: jax.ShapeDtypeStruct) -> jax.Array:
    if rule == "mean":
      c = _all_reduce(config, c / config.k, lax.pmean)
      return c.astype(s.dtype) if _is_float(s.dtype) else c
    if rule in _CROSS_DEVICE:
      c = _all_reduce(config, c, _CROSS_DEVICE[rule])
    return c.astype(s.dtype)
  return jax.tree.map(one, carry, shapes)


# ------------------------------------------------------------- shard_map
def _any_varying(tree: Any) -> bool:
  return any(_arrays.varying_axes(x) for x in jax.tree.leaves(tree)
             if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)))


# ---------------------------------------------- plain jit: the batch on a mesh
class _Placement(NamedTuple):
  """A batch split over mesh axes under plain ``jit``: the loop runs inside ``shard_map``."""

  axes: tuple[Any, ...]  # the data axes
  mesh: Any  # the mesh to ``shard_map`` over
  explicit: bool  # shardings are in the types: gradients go back to their params' shardings


def _leading_axes(leaf: Any) -> tuple[tuple[Any, ...], Any]:
  """The mesh axes the leading dim of ``leaf`` is sharded over per its type, and its mesh."""
  sharding = getattr(jax.typeof(leaf), "sharding", None)
  spec = getattr(sharding, "spec", None)
  lead = spec[0] if spec is not None and len(spec) else None
  names = () if lead is None else tuple(lead) if isinstance(lead, tuple) else (lead,)
  return names, getattr(sharding, "mesh", None)


def _batch_axes(args: tuple[Any, ...], b_nums: tuple[int, ...]) -> tuple[tuple[Any, ...], Any]:
  """The Explicit axes the batch is split over (``()`` if none), the same for every leaf."""
  found = [(f"argument {i}{jax.tree_util.keystr(path)}", *_leading_axes(leaf))
           for i in b_nums for path, leaf in jax.tree_util.tree_flatten_with_path(args[i])[0]]
  where, axes, mesh = found[0]
  for other, other_axes, _ in found[1:]:
    if other_axes != axes:
      raise ValueError(
          f"The batch leaves are split differently over the mesh: {where} has its"
          f" leading dim sharded over {axes or 'no axis'} but {other} over"
          f" {other_axes or 'no axis'}. Place every batch leaf the same way, e.g."
          f" jax.device_put(batch, P({_spec_entry(axes or other_axes)!r}))."
      )
  return axes, mesh


def _spec_entry(axes: tuple[Any, ...]) -> Any:
  return axes[0] if len(axes) == 1 else axes


def _place(config: _Config, args: tuple[Any, ...]) -> _Placement | None:
  """Where the batch lives: None to run as written (one device, or inside shard_map/pmap)."""
  b_nums, _ = _positions(config, len(args))
  _batch_size({i: args[i] for i in b_nums}, config.k)
  axes, mesh = _batch_axes(args, b_nums)
  if config.axis_name is None:
    if axes:
      return _Placement(axes, mesh, explicit=True)
    _check_no_hidden_split(args, b_nums)
    return None
  named = _arrays.axis_names(config.axis_name)
  current = jax.sharding.get_abstract_mesh()
  kinds = _arrays.axis_kinds(current, named)
  if kinds is None or kinds == {"Manual"}:  # inside shard_map, or pmap
    if axes:
      raise ValueError(
          f"The batch is sharded over the Explicit mesh axes {axes} while"
          f" `axis_name={config.axis_name!r}` names shard_map/pmap axes: both would"
          f" split it. Drop `axis_name` (microbatched reads the split from the"
          " batch's type), or replicate the batch over the Explicit axes.")
    return None
  if len(kinds) > 1 or (axes and set(axes) != set(named)):
    raise ValueError(
        f"`axis_name={config.axis_name!r}` names mesh axes of kinds {sorted(kinds)}"
        f" and the batch's type shows it sharded over {axes or 'no Explicit axis'}."
        " Name the axes the batch is split over, all of one kind: Explicit ones"
        " (then `axis_name` may be dropped) or Auto ones.")
  return _Placement(named, current, explicit=kinds == {"Explicit"})


def _check_no_hidden_split(args: tuple[Any, ...], b_nums: tuple[int, ...]) -> None:
  """Raises on a mesh that mixes Auto and Explicit axes with params in explicit types.

  An Auto axis does not appear in the batch's type: a batch split over it
  would go undetected, and the partitioner would reduce the gradients on
  every micro-batch.
  """
  mesh = jax.sharding.get_abstract_mesh()
  names = tuple(getattr(mesh, "axis_names", ()) or ())
  if not {"Auto", "Explicit"} <= (_arrays.axis_kinds(mesh, names) or set()):
    return
  for i, arg in enumerate(args):
    if i in b_nums:
      continue
    for leaf in jax.tree.leaves(arg):
      if isinstance(leaf, (jax.Array, np.ndarray)) and any(_arrays.spec_of(leaf)):
        auto = tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                     if str(t).endswith("Auto"))
        raise ValueError(
            f"The mesh mixes Auto axes {auto} with Explicit ones, argument {i} of"
            " `fn` is sharded in its type, and the batch's type shows no split of"
            " its leading dim: a split over an Auto axis cannot be seen, and the"
            " gradients would be reduced on every micro-batch. Make the data axes"
            " Explicit and shard the batch over them, or name them:"
            f" `microbatched(..., axis_name={_spec_entry(auto)!r})`.")


def _run_on_mesh(call: Callable[..., Any], config: _Config, place: _Placement,
                 args: tuple[Any, ...]) -> Any:
  """Plain ``jit``: the loop inside a ``shard_map`` over the data axes, reduced once after it.

  Each device scans over its own rows with ``axis_name`` set to the data axes
  (the tested ``shard_map`` path); outside, each gradient takes the sharding
  of the parameter it belongs to.
  """
  b_nums, r_nums = _positions(config, len(args))
  size = _batch_size({i: args[i] for i in b_nums}, config.k)
  sizes = dict(zip(place.mesh.axis_names, place.mesh.axis_sizes, strict=True))
  devices = math.prod(sizes[a] for a in place.axes)
  if size % (devices * config.k):
    raise ValueError(
        f"A batch of {size} examples split over {devices} devices (mesh axes"
        f" {place.axes}) and num_microbatches={config.k} needs a multiple of"
        f" {devices * config.k} examples: each device splits its own rows. Use a"
        f" num_microbatches that divides {size // devices or 1}, or pad the batch.")
  inner = dataclasses.replace(config, axis_name=_spec_entry(place.axes))
  arrays = _arrays.ArrayLeaves.of(tuple(args))
  is_batch = [path[0].idx in b_nums for path in arrays.paths]  # path[0]: fn's argnum
  shapes = _abstract_outputs(call, config, arrays, is_batch, size // devices // config.k)
  targets, scatter = _grad_targets(place, args, (*b_nums, *r_nums), shapes.grads)
  out_specs = _out_specs(inner, place.axes, shapes, scatter, size // devices // config.k)

  def body(*values: Any) -> Any:
    return _run(call, inner, _split_inputs(inner, arrays.rebuild(values)), scatter)

  values = [v if batch else _gather_data_axes(v, place) for v, batch in
            zip(arrays.arrays, is_batch, strict=True)]
  in_specs = tuple(jax.sharding.PartitionSpec(_spec_entry(place.axes)) if batch
                   else jax.sharding.PartitionSpec() for batch in is_batch)
  out = jax.shard_map(body, mesh=place.mesh, in_specs=in_specs, out_specs=out_specs,
                      axis_names=set(place.axes))(*values)
  return _to_param_shardings(config, out, targets)


def _gather_data_axes(x: Any, place: _Placement) -> Any:
  """A non-batch input made whole over the data axes (FSDP params: one all-gather).

  Under Explicit axes ``shard_map`` wants inputs typed as its ``in_specs``
  say; under Auto ones the partitioner does this itself.
  """
  if not place.explicit:
    return x
  spec = _arrays.spec_of(x)
  names = _arrays.axis_names
  entries = [None if e is None else tuple(n for n in names(e) if n not in place.axes)
             for e in spec]
  if all(e is None or len(e) == len(names(o)) for e, o in zip(entries, spec, strict=True)):
    return x
  return jax.reshard(x, jax.sharding.PartitionSpec(
      *[None if not e else _spec_entry(e) for e in entries]))


def _abstract_outputs(call: Callable[..., Any], config: _Config,
                      arrays: _arrays.ArrayLeaves, is_batch: list[bool], rows: int) -> _Out:
  """``fn``'s output shapes on one device's micro-batch of ``rows`` examples (for out_specs)."""
  def plain(x: Any, batch: bool) -> jax.ShapeDtypeStruct:
    shape = (rows, *jnp.shape(x)[1:]) if batch else jnp.shape(x)
    return jax.ShapeDtypeStruct(shape, jnp.result_type(x))

  shapes = [plain(x, b) for x, b in zip(arrays.arrays, is_batch, strict=True)]
  return _unpack(config, jax.eval_shape(lambda *v: call(*arrays.rebuild(v)), *shapes))


def _grad_targets(place: _Placement, args: tuple[Any, ...], skip: tuple[int, ...],
                  grads: Any) -> tuple[list[Any] | None, list[Any] | None]:
  """The gradients' target specs and their reduce-scatter dims, or ``(None, None)``.

  The targets are the shardings of the first argument (other than the batch
  and the keys) that has the gradients' structure and shapes: the params.
  A gradient whose param is sharded over exactly the data axes along one
  dimension (FSDP) is reduce-scattered onto it. Under Auto axes the types
  hold no shardings: everything is all-reduced, and the partitioner places
  the result.
  """
  if not place.explicit:
    return None, None
  g_leaves, g_def = jax.tree.flatten(grads)
  for i, arg in enumerate(args):
    leaves, treedef = jax.tree.flatten(arg)
    if i in skip or treedef != g_def or any(
        jnp.shape(p) != g.shape for p, g in zip(leaves, g_leaves, strict=True)):
      continue
    specs = [_arrays.spec_of(p) for p in leaves]
    return specs, [_scatter_dim(spec, place.axes) for spec in specs]
  return None, None


def _scatter_dim(spec: jax.sharding.PartitionSpec, axes: tuple[Any, ...]) -> Any:
  """``(dim, names)`` if ``spec`` shards one dim over exactly the data axes, else None.

  Only when no other dim is sharded: jax 0.10's ``psum_scatter`` fails to
  lower an operand that is also sharded over an Explicit axis inside a
  partial-manual ``shard_map``. Such a gradient is all-reduced, then sliced.
  """
  entries = [() if e is None else _arrays.axis_names(e) for e in spec]
  hits = [dim for dim, names in enumerate(entries) if set(names) == set(axes)]
  if len(hits) != 1 or sum(bool(names) for names in entries) != 1:
    return None
  return hits[0], entries[hits[0]]


def _out_specs(config: _Config, axes: tuple[Any, ...], shapes: _Out, scatter: list[Any] | None,
               rows: int) -> Any:
  """``shard_map`` out_specs: reduced outputs replicated, per-example aux split like the batch."""
  rep = jax.sharding.PartitionSpec()
  leaves, treedef = jax.tree.flatten(shapes.grads)
  scatter = scatter or [None] * len(leaves)
  grads = jax.tree.unflatten(treedef, [
      rep if s is None else jax.sharding.PartitionSpec(*[None] * s[0], _spec_entry(s[1]))
      for s in scatter])
  value = rep
  if config.has_aux:
    value = (rep, _aux_specs(config, axes, shapes.aux, rows))
  out = (value, grads)
  return (out, rep) if config.return_noise_stats else out


def _aux_specs(config: _Config, axes: tuple[Any, ...], aux: Any, rows: int) -> Any:
  """The out_specs of the aux: per rule, reduced (replicated) or split like the batch."""
  plan = _resolve_aux_rules(config, aux)
  split = _spec_entry(axes)
  parts = []
  for rule, shapes, where in zip(plan.rules, plan.shapes, plan.where, strict=True):
    if isinstance(rule, str) and rule in (*_CROSS_DEVICE, "mean"):
      parts.append(jax.sharding.PartitionSpec())
      continue
    leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
    bad = [where + jax.tree_util.keystr(p) for p, s in leaves if rule != "concat" and (
        isinstance(rule, AuxRule) or not s.shape or s.shape[0] != rows)]
    if bad:
      raise ValueError(
          f"aux_rules={rule!r} at {bad[0]} keeps one value per device, and under plain"
          f" jit with the batch split over {axes} microbatched can only join per-example"
          f" values (a leading dim of the {rows} rows each device holds per"
          " micro-batch). Use 'mean', 'sum', 'max' or 'min' there, or call"
          " microbatched(..., axis_name=...) inside your own shard_map and choose"
          " its out_specs.")
    lead = (None,) if rule == "stack" else ()
    parts.append(jax.sharding.PartitionSpec(*lead, split))
  return jax.tree.unflatten(plan.treedef, parts)


def _to_param_shardings(config: _Config, out: Any, targets: list[Any] | None) -> Any:
  """The wrapper's outputs with each gradient resharded to its param's sharding."""
  if targets is None:
    return out
  (value, grads), stats = (out, None) if not config.return_noise_stats else out
  leaves, treedef = jax.tree.flatten(grads)
  grads = jax.tree.unflatten(treedef, [
      jax.reshard(g, spec) for g, spec in zip(leaves, targets, strict=True)])
  return ((value, grads), stats) if config.return_noise_stats else (value, grads)
