"""In-step microbatching: the large batch inside one jitted train step.

``microbatched(fn, k)`` wraps a value-and-grad function ``fn(params, batch,
*rest) -> (value, grads)``, splits ``batch`` into ``k`` equal micro-batches and
loops over them with ``lax.scan``. Gradients (and the loss) are summed into a
zero-initialised float32 accumulator whose shapes come from ``jax.eval_shape``
(no micro-batch is peeled out of the loop), then reduced once: the peak of
activation memory is that of one micro-batch, and the result is the
full-batch call's, up to float rounding.

Where to put the other two memory tricks:

* mixed precision (:mod:`optax_accum.precision`) goes *inside* ``fn``, around
  the loss: ``microbatched(jax.value_and_grad(mixed_precision(loss, policy)),
  k)``;
* ``jax.checkpoint`` goes *inside the loss*, around each block (layer) of the
  model — never around ``fn`` or the whole loss, which recomputes everything
  and saves nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_accum import _validation

__all__ = [
    "AUX_RULES",
    "AuxRule",
    "microbatched",
    "split_microbatches",
]

NORMALIZATIONS = ("mean", "sum", "weighted")
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
    >>> (l, aux), g = microbatched(fn, 2, has_aux=True, aux_rules=first,
    ...                            split="contiguous")(1.0, jnp.arange(4.0))
    >>> float(aux)  # the max of the first micro-batch [0, 1]
    1.0
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


def _acc_dtype(dtype: Any, acc_dtype: Any) -> Any:
  """Floats accumulate in ``acc_dtype`` (or their own), others in their own."""
  if _is_float(dtype) and acc_dtype is not None:
    return acc_dtype
  return dtype


class _Leafwise:
  """A built-in aux rule applied to every leaf of a subtree."""

  def __init__(self, name: str, k: int, acc_dtype: Any, split: str, axis_name: Any):
    self.name, self.k, self.acc_dtype = name, k, acc_dtype
    self.split, self.axis_name = split, axis_name

  @property
  def uses_scan_output(self) -> bool:
    return self.name in ("concat", "stack")

  def init(self, shapes: Any) -> Any:
    def one(s):
      if self.name in ("mean", "sum"):
        dt = _acc_dtype(s.dtype, self.acc_dtype)
        if self.name == "mean" and not _is_float(dt):
          dt = jnp.float32
        return jnp.zeros(s.shape, dt)
      if self.name in ("max", "min"):
        if _is_float(s.dtype):
          v = -jnp.inf if self.name == "max" else jnp.inf
        elif jnp.issubdtype(s.dtype, jnp.bool_):
          v = self.name == "min"
        else:
          info = jnp.iinfo(s.dtype)
          v = info.min if self.name == "max" else info.max
        return jnp.full(s.shape, v, s.dtype)
      if self.name == "last":
        return jnp.zeros(s.shape, s.dtype)
      return ()  # concat / stack: collected as scan outputs
    return jax.tree.map(one, shapes)

  def update(self, carry: Any, value: Any) -> Any:
    if self.uses_scan_output:
      return carry
    ops = {
        "mean": lambda c, v: c + v.astype(c.dtype),
        "sum": lambda c, v: c + v.astype(c.dtype),
        "max": jnp.maximum,
        "min": jnp.minimum,
        "last": lambda c, v: v,
    }
    return jax.tree.map(ops[self.name], carry, value)

  def finalize(self, carry: Any, stacked: Any, shapes: Any, prefix: str) -> Any:
    if self.name == "stack":
      return stacked
    if self.name == "concat":
      leaves = jax.tree_util.tree_flatten_with_path(stacked)
      out = [_unstack_concat(x, self.split, prefix + jax.tree_util.keystr(p))
             for p, x in leaves[0]]
      return jax.tree.unflatten(leaves[1], out)

    def one(c, s):
      if self.name == "mean":
        c = c / self.k
        if self.axis_name is not None:
          c = lax.pmean(c, self.axis_name)
        return c.astype(s.dtype) if _is_float(s.dtype) else c
      if self.axis_name is not None:
        red = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}.get(self.name)
        if red is not None:
          c = red(c, self.axis_name)
      return c.astype(s.dtype)
    return jax.tree.map(one, carry, shapes)


class _Custom:
  """Adapts an :class:`AuxRule` to the internal interface."""

  uses_scan_output = False

  def __init__(self, rule: AuxRule):
    self.rule = rule

  def init(self, shapes: Any) -> Any:
    return self.rule.init(shapes)

  def update(self, carry: Any, value: Any, i: jax.Array) -> Any:
    return self.rule.update(carry, value, i)

  def finalize(self, carry: Any, stacked: Any, shapes: Any, prefix: str) -> Any:
    del stacked, shapes, prefix
    return self.rule.finalize(carry)


def _resolve_aux_rules(
    aux_rules: Any, aux_shapes: Any, k: int, acc_dtype: Any, split: str, axis_name: Any,
) -> tuple[list[Any], list[Any], Any]:
  """Matches the ``aux_rules`` prefix tree against the aux shape tree."""
  rule_leaves, rule_def = jax.tree_util.tree_flatten(aux_rules, is_leaf=_is_rule)
  for r in rule_leaves:
    if not _is_rule(r) or (isinstance(r, str) and r not in AUX_RULES):
      raise ValueError(
          f"`aux_rules` holds {r!r}; each rule must be one of {AUX_RULES} or an"
          " `AuxRule(init, update, finalize)`. Pass one rule for the whole aux"
          " or a pytree of rules that is a prefix of the aux structure."
      )
  try:
    subtrees = rule_def.flatten_up_to(aux_shapes)
  except (ValueError, TypeError) as e:
    raise ValueError(
        "`aux_rules` must be one rule or a pytree of rules that is a prefix of"
        f" the aux returned by `fn`; rules have structure {rule_def} but the aux"
        f" is {jax.tree.structure(aux_shapes)}. ({e})"
    ) from e
  rules = [_Custom(r) if isinstance(r, AuxRule) else _Leafwise(r, k, acc_dtype, split, axis_name)
           for r in rule_leaves]
  return rules, subtrees, rule_def


def microbatched(
    fn: Callable[..., tuple[Any, Any]],
    num_microbatches: int,
    *,
    batch_argnums: int | Sequence[int] = 1,
    has_aux: bool = False,
    normalize: str = "mean",
    aux_rules: Any = "mean",
    split: str = "strided",
    rng_argnums: int | Sequence[int] = (),
    rng_mode: str = "fold_in",
    accumulator_dtype: Any = jnp.float32,
    axis_name: Any = None,
    unroll: int | bool = 1,
) -> Callable[..., tuple[Any, Any]]:
  r"""Runs a value-and-grad function over ``k`` micro-batches in one ``lax.scan``.

  ``fn(params, batch, *rest) -> (value, grads)`` is typically
  ``jax.value_and_grad(loss_fn)``. The wrapper has the same signature and
  outputs. Each batch argument (any pytree of arrays with a common leading
  batch dimension ``B``) is split into ``k`` micro-batches of ``B // k``
  examples; the other arguments are given unchanged to every micro-batch.
  Values and gradients are summed into float32 accumulators initialised to
  zero from ``jax.eval_shape`` and reduced once after the loop; the outputs
  are cast back to the dtypes ``fn`` returns. Peak activation memory is that
  of one micro-batch, plus one gradient-sized accumulator.

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

  ``num_microbatches=1`` calls ``fn`` once on the whole batch, unchanged
  (keys included); only the ``"weighted"`` division and the ``axis_name``
  reduction are applied.

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
    split: ``"strided"`` (default): micro-batch ``i`` holds rows ``i, i + k,
      ...``; a reshape that keeps a batch-sharded input on its devices.
      ``"contiguous"``: rows ``i * B/k`` to ``(i + 1) * B/k - 1`` (under a
      sharded batch this moves data between devices).
    rng_argnums: position(s) of PRNG key arguments (e.g. dropout keys). Each
      micro-batch gets its own key, never the same one twice.
    rng_mode: ``"fold_in"`` (default): micro-batch ``i`` gets
      ``jax.random.fold_in(key, i)``; ``"split"``: it gets
      ``jax.random.split(key, k)[i]``.
    accumulator_dtype: dtype of the floating accumulators (default float32).
      ``None`` accumulates in each output's own dtype.
    axis_name: a ``shard_map``/``pmap`` axis name (or tuple of names) over
      which the batch is split across devices. Each device accumulates its
      local micro-batches, and the results are reduced **once, after the
      loop**: ``pmean`` for ``"mean"``, ``psum`` for ``"sum"``, and for
      ``"weighted"`` a ``psum`` of numerators, denominators and gradients
      before the one division, so the normalisation is global. Non-batch
      arguments are cast to device-varying first, so that ``shard_map``'s
      autodiff does not insert an all-reduce into every micro-step. Aux rules
      ``mean``/``sum``/``max``/``min`` are reduced across devices too;
      ``last``, ``concat``, ``stack`` and custom rules stay per device.
    unroll: passed to ``lax.scan``.

  Returns:
    A function with ``fn``'s signature returning ``(value, grads)`` (or
    ``((value, aux), grads)``), reduced over the micro-batches.

  Raises:
    ValueError: when called with a batch whose size ``num_microbatches`` does
      not divide, whose leaves disagree on the batch size, or with arguments
      that do not match ``batch_argnums``/``rng_argnums``.

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
  k = _validation.check_k(num_microbatches, "num_microbatches")
  if callable(k):
    raise TypeError(
        "`num_microbatches` must be a positive int; schedules are not supported"
        " inside one step (shapes must be static). Pass e.g. `num_microbatches=4`."
    )
  batch_nums = _as_argnums(batch_argnums, "batch_argnums")
  if not batch_nums:
    raise ValueError("`batch_argnums` is empty; name at least one batch argument of `fn`.")
  rng_nums = _as_argnums(rng_argnums, "rng_argnums") if rng_argnums != () else ()
  if not isinstance(has_aux, bool):
    raise TypeError(f"`has_aux` must be a bool; got {has_aux!r}.")
  _check_choice(
      normalize, "normalize", NORMALIZATIONS,
      "Use 'mean' for a mean loss, 'sum' for a summed loss, or 'weighted' when"
      " `fn`'s value is (numerator, denominator).")
  _check_choice(split, "split", SPLITS, "Use 'strided' (default) or 'contiguous'.")
  _check_choice(rng_mode, "rng_mode", RNG_MODES, "Use 'fold_in' (default) or 'split'.")
  acc_dtype = _validation.check_accumulator_dtype(accumulator_dtype)
  # Fails early on malformed rule trees; matched against the aux at call time.
  for r in jax.tree.leaves(aux_rules, is_leaf=_is_rule):
    if not _is_rule(r) or (isinstance(r, str) and r not in AUX_RULES):
      raise ValueError(
          f"`aux_rules` holds {r!r}; each rule must be one of {AUX_RULES} or an"
          " `AuxRule(init, update, finalize)`."
      )
  weighted = normalize == "weighted"

  def unpack(out: Any) -> tuple[Any, Any, Any, Any]:
    """``fn``'s output to ``(numerator, denominator, aux, grads)``."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise TypeError(
          "`fn` must return `(value, grads)` like `jax.value_and_grad`; got"
          f" {jax.tree.structure(out)}."
      )
    value, grads = out
    aux = None
    if weighted:
      if not (isinstance(value, (tuple, list)) and len(value) == 2):
        raise TypeError(
            "normalize='weighted' needs `fn`'s value to be (numerator,"
            " denominator) — e.g. jax.value_and_grad(loss_fn, has_aux=True) with"
            " loss_fn returning (sum of token losses, number of real tokens) —"
            f" got a value with structure {jax.tree.structure(value)}."
        )
      num, den = value
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
      return num, den, aux, grads
    if has_aux:
      if not (isinstance(value, (tuple, list)) and len(value) == 2):
        raise TypeError(
            "has_aux=True needs `fn` to return ((value, aux), grads), like"
            " jax.value_and_grad(loss, has_aux=True); got a value with structure"
            f" {jax.tree.structure(value)}."
        )
      value, aux = value
    return value, None, aux, grads

  def pack(value: Any, aux: Any, grads: Any) -> tuple[Any, Any]:
    return ((value, aux) if has_aux else value), grads

  def safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
    den = den.astype(num.dtype)
    return jnp.where(den == 0, jnp.zeros_like(num), num / jnp.where(den == 0, 1, den))

  def reduce_all(num: Any, den: Any, grads: Any, count: int) -> tuple[Any, Any]:
    """Cross-device reduction, once, then the normalisation."""
    if normalize == "mean":
      num, grads = jax.tree.map(lambda x: x / count, (num, grads))
      if axis_name is not None:
        num, grads = lax.pmean((num, grads), axis_name)
      return num, grads
    if axis_name is not None:
      num, den, grads = lax.psum((num, den, grads), axis_name)
    if normalize == "sum":
      return num, grads
    return jax.tree.map(lambda x: safe_div(x, den), (num, grads))

  def make_varying(x: Any) -> Any:
    """Marks a replicated input device-varying (a no-op outside shard_map)."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    def one(leaf):
      if not isinstance(leaf, (jax.Array, np.ndarray)):
        return leaf
      have = _validation.varying_axes(leaf)
      return _pcast_varying(leaf, tuple(n for n in names if n not in have))
    return jax.tree.map(one, x)

  @functools.wraps(fn)
  def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    nargs = len(args)
    b_nums = _resolve_argnums(batch_nums, nargs, "batch_argnums")
    r_nums = _resolve_argnums(rng_nums, nargs, "rng_argnums")
    if set(b_nums) & set(r_nums):
      raise ValueError(
          f"`batch_argnums` {b_nums} and `rng_argnums` {r_nums} overlap; an"
          " argument is either split (batch) or a key (folded per micro-batch)."
      )
    _batch_size({i: args[i] for i in b_nums}, k)
    args = list(args)
    if axis_name is not None:
      for i in range(nargs):
        if i not in b_nums and i not in r_nums:
          args[i] = make_varying(args[i])

    if k == 1:
      num, den, aux, grads = unpack(fn(*args, **kwargs))
      if normalize == "mean" and axis_name is None:
        return pack(num, aux, grads)
      if has_aux:
        rules, subtrees, rule_def = _resolve_aux_rules(
            aux_rules, jax.eval_shape(lambda: aux), 1, acc_dtype, split, axis_name)
        aux = _single_aux(rules, rule_def.flatten_up_to(aux), subtrees, rule_def)
      num, grads = reduce_all(num, den, grads, 1)
      return pack(num, aux, grads)

    split_args = {i: jax.tree.map(lambda x: _reshape(x, k, split), args[i]) for i in b_nums}
    keys = {}
    for i in r_nums:
      key = args[i]
      if axis_name is not None:
        # Devices must not share the keys of their micro-batch i.
        key = jax.random.fold_in(key, lax.axis_index(axis_name))
      keys[i] = jax.random.split(key, k) if rng_mode == "split" else key

    def call(idx: jax.Array, static_args: list[Any], splits: dict[int, Any],
             keys: dict[int, Any]) -> Any:
      a = list(static_args)
      for j, tree in splits.items():
        a[j] = jax.tree.map(lambda x: _index(x, idx, split), tree)
      for j, key in keys.items():
        a[j] = key[idx] if rng_mode == "split" else jax.random.fold_in(key, idx)
      return fn(*a, **kwargs)

    out_shapes = jax.eval_shape(call, jnp.zeros([], jnp.int32), args, split_args, keys)
    num_s, den_s, aux_s, grads_s = unpack(out_shapes)
    if has_aux:
      rules, subtrees, rule_def = _resolve_aux_rules(
          aux_rules, aux_s, k, acc_dtype, split, axis_name)
    else:
      rules, subtrees, rule_def = [], [], None

    def zeros(s):
      return jnp.zeros(s.shape, _acc_dtype(s.dtype, acc_dtype))

    init = (
        jax.tree.map(zeros, (num_s, grads_s)),
        None if den_s is None else jnp.zeros([], jnp.float32),
        [r.init(s) for r, s in zip(rules, subtrees, strict=True)],
    )

    def body(carry: Any, idx: jax.Array) -> tuple[Any, Any]:
      (acc_num, acc_grads), acc_den, aux_carry = carry
      num, den, aux, grads = unpack(call(idx, args, split_args, keys))
      acc_num, acc_grads = jax.tree.map(
          lambda c, x: c + x.astype(c.dtype), (acc_num, acc_grads), (num, grads))
      if acc_den is not None:
        acc_den = acc_den + jnp.asarray(den).astype(jnp.float32)
      ys = []
      if rules:
        aux_parts = rule_def.flatten_up_to(aux)
        new_aux = []
        for r, c, v in zip(rules, aux_carry, aux_parts, strict=True):
          new_aux.append(r.update(c, v, idx) if isinstance(r, _Custom) else r.update(c, v))
          ys.append(v if r.uses_scan_output else ())
        aux_carry = new_aux
      return ((acc_num, acc_grads), acc_den, aux_carry), ys

    if _any_varying((args, split_args, keys)):
      # Inside shard_map the carry must vary over the same mesh axes as what
      # the body adds to it; match the zeros to one abstract step.
      out_carry = jax.eval_shape(lambda c: body(c, jnp.zeros([], jnp.int32))[0], init)
      init = jax.tree.map(_match_varying, init, out_carry)

    with jax.named_scope("microbatched"):
      carry, ys = lax.scan(body, init, jnp.arange(k, dtype=jnp.int32), unroll=unroll)
    (acc_num, acc_grads), acc_den, aux_carry = carry
    num, grads = reduce_all(acc_num, acc_den, acc_grads, k)
    num = jax.tree.map(lambda x, s: x.astype(s.dtype), num, num_s)
    grads = jax.tree.map(lambda x, s: x.astype(s.dtype), grads, grads_s)
    aux = None
    if rules:
      parts = [r.finalize(c, y, s, "aux")
               for r, c, y, s in zip(rules, aux_carry, ys, subtrees, strict=True)]
      aux = jax.tree.unflatten(rule_def, parts)
    return pack(num, aux, grads)

  return wrapped


def _pcast_varying(x: jax.Array, names: tuple[Any, ...]) -> jax.Array:
  if not names:
    return x
  if hasattr(lax, "pcast"):
    return lax.pcast(x, names, to="varying")
  return lax.pvary(x, names)  # older jax


def _any_varying(tree: Any) -> bool:
  return any(_validation.varying_axes(x) for x in jax.tree.leaves(tree)
             if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)))


def _match_varying(init: jax.Array, target: jax.ShapeDtypeStruct) -> jax.Array:
  missing = _validation.varying_axes(target) - _validation.varying_axes(init)
  return _pcast_varying(init, tuple(sorted(missing, key=str)))


def _single_aux(rules: list[Any], parts: list[Any], shapes: list[Any], rule_def: Any) -> Any:
  """Applies the aux rules to a single (k = 1) micro-batch."""
  out = []
  for r, v, s in zip(rules, parts, shapes, strict=True):
    if isinstance(r, _Custom):
      out.append(r.finalize(r.update(r.init(s), v, jnp.zeros([], jnp.int32)), None, s, ""))
    elif r.name in ("stack", "concat"):
      stacked = jax.tree.map(lambda x: jnp.asarray(x)[None], v)
      out.append(r.finalize((), stacked, s, "aux"))
    else:
      out.append(r.finalize(r.update(r.init(s), v), None, s, "aux"))
  return jax.tree.unflatten(rule_def, out)
