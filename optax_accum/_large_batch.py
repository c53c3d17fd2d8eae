"""Is accumulating ``k`` micro-batches of my loss the large batch? (``debug.check_large_batch``)

The check compares the gradient :func:`~optax_accum.microbatched` accumulates
with ``fn`` on the whole batch, leaf by leaf, both evaluated in float64 (the
float64 shadow of ``_float64``), and when they differ it says why. It runs
once, streaming the micro-batches to the host: a debugging tool, not a
training step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_core

from optax_accum import _arrays, _batch, _float64, _global_stats, _validation, microbatching
from optax_accum._host_gradients import SKETCH_ROWS, Grads, Stats, sketch_leaf
from optax_accum._row_trail import Trail, source, walk


class LeafError(NamedTuple):
  """One gradient leaf's error, a row of the report's table.

  Attributes:
    path: the leaf's path in the gradient tree, e.g. ``"['dense']['w']"``.
    shape: its shape.
    relative_error: the norm of its accumulated-minus-whole difference over
      the norm of the whole batch's gradient of this leaf (where that norm is
      within the tolerance, a leaf zero in exact arithmetic: float64 noise,
      over the size the tolerance is of), both evaluated in float64: what
      decides.
    tolerance: what float64 rounding may leave of a difference, relative
      likewise: ``1e-9`` of the largest of the leaf's gradient, the
      micro-batch gradients it sums (larger where they cancel) and ``1e-3``
      of the whole gradient tree's size (a gradient that is zero in exact
      arithmetic, a bias before BatchNorm, is float64 noise: a leaf smaller
      than ``1e-12`` of the tree is not resolved).
    native_error: the same difference as ``fn`` and ``microbatched`` compute
      it in their own dtypes, over the same norm: what training sees (for
      information; it decides nothing, its rounding is the dtypes').
  """

  path: str
  shape: tuple[int, ...]
  relative_error: float
  tolerance: float
  native_error: float


class LargeBatchReport(NamedTuple):
  """What :func:`check_large_batch` found.

  Attributes:
    equal: whether every leaf of the accumulated gradient is the whole batch's
      within its tolerance, in float64.
    cause: ``"equal"``; ``"accumulation"`` (the micro-batch gradients combine
      into the whole batch's but ``microbatched`` returned something else: a
      bug in optax_accum); ``"order"`` (the loss depends on the order of the
      rows: pairs or sequences laid along the batch axis, which the
      micro-batches split apart); ``"scale"`` (a positive multiple: the
      normalisation depends on the batch size); ``"weights"`` (the whole batch
      weighs the micro-batches unequally: per-micro-batch normalisation);
      ``"coupling"`` (no non-negative combination of micro-batch gradients
      gives it: the loss or the model couples the examples of a batch).
    max_relative_error: the ``relative_error`` of the leaf furthest above its
      tolerance (of the largest error-to-tolerance ratio).
    tolerance: that leaf's tolerance: ``equal`` is ``max_relative_error <=
      tolerance``.
    weights: for ``"weights"`` and ``"scale"``, the weight per micro-batch
      that makes their combination the whole batch's gradient, normalised to
      sum 1; ``None`` otherwise.
    fix: what to write instead, naming the API.
    leaves: one :class:`LeafError` per gradient leaf.
    num_microbatches: ``k``.
    float64_on: where the float64 evaluation ran: ``"cpu:0"``, the host CPU
      (arrays laid out over several devices are evaluated on them).
  """

  equal: bool
  cause: str
  max_relative_error: float
  tolerance: float
  weights: tuple[float, ...] | None
  fix: str
  leaves: tuple[LeafError, ...]
  num_microbatches: int
  float64_on: str

  def __str__(self) -> str:
    width = max([4, *(len(leaf.path) for leaf in self.leaves)])
    rows = [f"{'leaf':<{width}}  {'shape':<14}  float64 error  tolerance  in its dtypes"]
    rows += [f"{leaf.path:<{width}}  {leaf.shape!s:<14}  {leaf.relative_error:<13.2e}"
             f"  {leaf.tolerance:<9.2e}  {leaf.native_error:.2e}"
             f"{'' if leaf.relative_error <= leaf.tolerance else '  <--'}"
             for leaf in self.leaves]
    sign = "<=" if self.equal else ">"
    rows.append(f"k={self.num_microbatches}: relative error {self.max_relative_error:.2e}"
                f" {sign} tolerance {self.tolerance:.2e} (float64 evaluated on"
                f" {self.float64_on}): {self.cause}")
    if self.weights is not None:
      rows.append("weights per micro-batch: " + " ".join(f"{w:.4g}" for w in self.weights))
    rows.append(self.fix)
    return "\n".join(rows)

  def raise_if_different(self) -> None:
    """Raises ``AssertionError`` with the cause and the fix unless ``equal``."""
    if not self.equal:
      raise AssertionError(
          f"Accumulating {self.num_microbatches} micro-batches is not the large batch:"
          f" cause {self.cause!r} (relative error {self.max_relative_error:.3g},"
          f" tolerance {self.tolerance:.3g}). {self.fix}\n{self}")


def check_large_batch(
    fn: Callable[..., Any],
    num_microbatches: int,
    *,
    batch_argnums: int | Sequence[int] = 1,
    has_aux: bool = False,
    normalize: str = "mean",
    global_stats: Callable[..., Any] | None = None,
) -> Callable[..., LargeBatchReport]:
  """Checks that accumulating ``k`` micro-batches of ``fn`` gives the large batch; says why not.

  ``fn``, ``batch_argnums``, ``has_aux`` and ``normalize`` are what
  :func:`~optax_accum.microbatched` takes (``fn`` is
  ``jax.value_and_grad(loss_fn)``). ``check_large_batch(fn, k)(params,
  *args)`` compares, leaf by leaf and in float64 whatever dtypes ``fn``
  computes in, the gradient ``microbatched(fn, k, ...)`` accumulates with
  ``fn``'s on the whole batch, and names the cause of a difference:
  ``"accumulation"`` (a bug in this package), ``"order"`` (the loss reads
  the batch axis as more than a set of examples), ``"scale"`` (a positive
  multiple), ``"weights"`` (the micro-batches weighed unequally: a loss
  normalised per micro-batch) or ``"coupling"`` (the loss or the model
  couples the examples), with what to write instead. How it decides, what
  ``"equal"`` proves and what a call costs (three float64 programs, run on
  the host CPU): :doc:`/semantics/the_check`.

  Args:
    fn: ``(*args) -> (value, grads)`` like ``jax.value_and_grad(loss_fn)``
      (``((value, aux), grads)`` with ``has_aux``; the value ``(numerator,
      denominator)`` with ``normalize="weighted"``).
    num_microbatches: ``k``, a positive int dividing the batch size.
    batch_argnums: position(s) of the batch argument(s) (default 1).
    has_aux: whether ``fn``'s value carries an aux output (not compared).
    normalize: ``"mean"``, ``"sum"`` or ``"weighted"``, as in ``microbatched``.
    global_stats: ``stats_fn(params, *args)``, as in ``microbatched``: ``fn``
      is called with ``stats=``, the whole batch's statistics, on the whole
      batch and on every micro-batch alike (in float64: their float64 sum).
      Statistics that are not sums over the rows (a mean, a max) raise
      ``ValueError`` naming the leaf.

  Returns:
    ``check(*args, **kwargs) -> LargeBatchReport``, called with ``fn``'s
    arguments. ``str(report)`` is a per-leaf table and the verdict;
    ``report.raise_if_different()`` raises ``AssertionError`` with the cause
    and the fix.

  Raises:
    ValueError: (when called) for a batch ``k`` does not divide; ``fn``
      drawing random numbers per row from a key that is not in a batch
      argument; ``global_stats`` that are not sums over the rows; an
      operation that cannot be evaluated in float64; a gradient with NaN or
      Inf; a difference that too few gradient entries cannot explain.
    TypeError: (when called) when ``fn`` does not return ``(value, grads)``
      with a scalar value.

  Example:
    A loss normalised over each micro-batch's own real tokens:

    >>> import jax, jax.numpy as jnp
    >>> from optax_accum.debug import check_large_batch
    >>> def loss_fn(w, x, mask):   # a mean over the real rows of the batch it sees
    ...   return jnp.sum((x @ w) ** 2 * mask) / jnp.sum(mask)
    >>> x = jax.random.normal(jax.random.key(0), (8, 3))
    >>> mask = jnp.array([1., 1., 1., 1., 1., 1., 0., 0.])   # rows 6 and 7: padding
    >>> check = check_large_batch(jax.value_and_grad(loss_fn), 2, batch_argnums=(1, 2))
    >>> report = check(jnp.ones(3), x, mask)
    >>> report.cause, report.weights   # each micro-batch (even, odd rows) holds 3 real rows
    ('equal', None)
    >>> mask = jnp.array([1., 1., 1., 1., 1., 0., 1., 0.])   # 4 real rows, then 2
    >>> report = check(jnp.ones(3), x, mask)
    >>> report.cause, [round(w, 3) for w in report.weights]
    ('weights', [0.667, 0.333])
    >>> print(report.fix)   # doctest: +ELLIPSIS
    The whole batch weighs the micro-batches unequally...normalize='weighted'...
  """
  accumulated = microbatching.microbatched(  # checks the options; Equinox modules pass
      fn, num_microbatches, batch_argnums=batch_argnums, has_aux=has_aux, normalize=normalize,
      global_stats=global_stats)
  k = int(num_microbatches)
  nums = _validation.check_argnums(batch_argnums, "batch_argnums")
  # The float64 programs of each function the check traces, by the types of its arguments
  # ("stats": `pooled`, made anew on each call from `global_stats` and those types alone).
  programs: dict[str, dict[Any, Any]] = {"fn": {}, "stats": {}, "microbatched": {}}

  def check(*args: Any, **kwargs: Any) -> LargeBatchReport:
    batch = _batch.of(args, nums)  # the rules every entry point shares
    batch.check_divides(k)
    b_nums, rows = batch.positions, batch.rows

    def grads(out: Any, what: str) -> Grads:
      value, den, _, tree = _batch.unpack(out, normalize, has_aux)
      if jnp.ndim(value) != 0:
        raise TypeError(
            f"`fn`'s value must be a scalar loss; got shape {jnp.shape(value)}. Pass"
            " `jax.value_and_grad(loss_fn)` of a scalar loss_fn (has_aux=True for (loss, aux)).")
      return Grads.of(tree, what, den)

    def rows_of(order: np.ndarray) -> tuple[Any, ...]:  # the batch's rows in that order
      rows = dict(zip(b_nums, _rows(tuple(args[i] for i in b_nums), order), strict=True))
      return tuple(rows.get(i, a) for i, a in enumerate(args))

    def micro(j: int) -> tuple[Any, ...]:  # the strided split, as microbatched's
      return rows_of(np.arange(j, rows, k))

    def micro_batches() -> Iterator[Grads]:
      for j in range(k):
        yield grads(on_micro(micro(j), wide), f"micro-batch {j}")

    own, wide = kwargs, kwargs  # fn's keywords; with global_stats, the whole batch's `stats=`
    if global_stats is not None:  # (pooled like microbatched's, the float64 sum in float64)
      pooled = _global_stats.summable(global_stats, args, _batch.shapes_at(args, b_nums, rows // k),
                                      b_nums, rows // k, rows)[0]
      on_all = _in_float64(pooled, args, {}, b_nums, programs["stats"])[0](args)
      on_part = _in_float64(pooled, micro(0), {}, b_nums, programs["stats"])[0]
      wide = {**kwargs, "stats": _global_stats.check_sums(on_all, [on_part(micro(j))
                                                                   for j in range(k)])}
      own = {**kwargs, "stats": jax.tree.map(lambda n, w: w if jnp.issubdtype(
          w.dtype, jnp.integer) else jnp.asarray(n), pooled(*args), wide["stats"])}
    on_micro, _, seen = _in_float64(fn, micro(0), own, b_nums, programs["fn"])
    on_whole, as_trained, traced = _in_float64(fn, args, own, b_nums, programs["fn"])
    found = Trail()  # the whole batch's trace, beside the micro-batch's: refuses draws per row
    if k > 1:  # (one micro-batch is the whole batch)
      walk(traced, seen, [source(p, b_nums) for p in _arrays.ArrayLeaves.of((args, own)).paths],
           (rows, rows // k), found)
    out = as_trained(args)
    _batch.check_no_batch_gradient(_batch.unpack(out, normalize, has_aux).grads, args, b_nums, rows)
    native = grads(out, "the whole batch")  # what training sees
    whole = grads(on_whole(args, wide), "the whole batch")
    # A swap and a rotation generate every permutation: a loss both leave as it is reads its
    # rows as a set. (One random order missed some: for 2 rows the identity, for 6 one that
    # kept each pair of rows 2i, 2i + 1 together.)
    swap = np.arange(rows)
    swap[:2] = swap[:2][::-1]
    permuted = np.max([whole.distance(grads(on_whole(rows_of(order), wide), "a reordered batch"))
                       for order in (swap, np.roll(np.arange(rows), 1))], axis=0)
    stats = Stats.of(whole, micro_batches(), normalize, k)
    on_accumulated, acc_as_trained, _ = _in_float64(accumulated, args, kwargs, b_nums,
                                                    programs["microbatched"])
    acc = Grads.of(on_accumulated(args)[1], "microbatched")
    native_errors = Grads.of(acc_as_trained(args)[1], "microbatched").distance(native)
    return _classify(k, normalize, whole, permuted, acc, stats, micro_batches, native_errors,
                     found)

  return check


def _in_float64(f: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                b_nums: tuple[int, ...], programs: dict[Any, Any],
                ) -> tuple[Callable[..., Any], Callable[..., Any], jax_core.Jaxpr]:
  """``f``'s outputs on arguments shaped like ``args``: in float64 (``_float64.evaluate``), and
  in ``f``'s own dtypes (its trace compiled as it is: what training sees).

  ``f`` is traced on ``args`` as they are, once per types of its arguments: ``programs``
  (``f``'s alone: no key names ``f``) keeps the float64 program of each and the trace's own,
  so a check called again on new batches compiles nothing (an eager ``microbatched``
  compiled its scan on every call). Returns them with ``f``'s trace.
  """
  inputs = _arrays.ArrayLeaves.of((args, kwargs))
  static = tuple(x for x in inputs.leaves if not isinstance(x, (jax.Array, np.ndarray)))
  key = (b_nums, inputs.treedef, tuple(map(jax.typeof, inputs.arrays)), static)
  if key not in programs:
    def traced(*values: Any) -> Any:
      a, kw = inputs.rebuild(values)
      return f(*a, **kw)

    closed, shape = jax.make_jaxpr(traced, return_shape=True)(*inputs.arrays)
    programs[key] = (_float64.evaluate(closed), jax.jit(jax_core.jaxpr_as_fun(closed)),
                     jax.tree.structure(shape), closed.jaxpr)
  wide, own, out, traced = programs[key]
  on = lambda run: lambda new, kw=kwargs: jax.tree.unflatten(
      out, run(*_arrays.ArrayLeaves.of((new, kw)).arrays))
  return on(wide), on(own), traced


@jax.jit
def _rows(batch: Any, order: jax.Array) -> Any:
  """The rows in ``order``, laid out over the devices as they are (sharded rows stay so): one
  program for every leaf of the batch arguments (an op per leaf compiled 4 to 5 programs)."""
  return jax.tree.map(lambda x: x.at[order].get(out_sharding=jax.typeof(x).sharding), batch)


# ---------------------------------------------------------------------- the verdict
_TOLERANCE = 1e-9  # of a leaf's size: float64 leaves about 1e-15 of it, the algebra >= 1e-4


def _classify(k: int, normalize: str, whole: Grads, permuted: np.ndarray, acc: Grads,
              stats: Stats, micro_batches: Callable[[], Iterator[Grads]],
              native: np.ndarray, found: Trail) -> LargeBatchReport:
  """The cause: equal, accumulation, order, scale, weights or coupling, in that order.

  ``permuted``: each leaf's largest distance of a reordered batch's gradient from the whole's;
  ``native``: each leaf's distance in ``fn``'s own dtypes (shown, not decisive). For
  ``"weights"`` and ``"coupling"`` the fix names a rounding on a statistic of the batch
  first, then (``"weights"``) a selection by the batch's values (``found``).
  """
  leaves = range(len(whole.leaves))
  combined = stats.combined
  norms = np.array([np.linalg.norm(whole.host(n)) for n in leaves])
  # A leaf's size: its gradient's or its terms', and at least 1e-3 of the whole tree's (a
  # gradient that is zero in exact arithmetic, a bias before BatchNorm, is float64 noise).
  size = np.maximum(norms, stats.sizes)
  tol = _TOLERANCE * np.maximum(size, 1e-3 * np.linalg.norm(size))
  # Relative to the leaf's norm; a leaf whose norm is within float64's rounding (zero in exact
  # arithmetic: 1e-17, which would show errors of 1e8) to the size its tolerance is of.
  scale = np.where(norms > tol, norms, tol / _TOLERANCE)
  scale = np.where(scale > 0, scale, 1.0)  # every leaf zero
  errors = acc.distance(whole)
  ratio = np.divide(errors, tol, out=np.where(errors > 0, np.inf, 0.0), where=tol > 0)
  worst = int(np.argmax(ratio))
  table = tuple(LeafError(path, shape, float(e / s), float(t / s), float(n / s))
                for (path, shape), e, t, s, n in zip(whole.paths, errors, tol, scale, native,
                                                     strict=True))

  def report(cause: str, weights: np.ndarray | None, fix: str) -> LargeBatchReport:
    w = None if weights is None else tuple(float(x) for x in weights)
    if cause in ("weights", "coupling") and found.roundings:
      scaled = [t for summed, t in found.roundings if not summed]  # else a sum rounded
      fix = (_ROUNDING_FIX if scaled else _SUM_ROUNDING_FIX).format(", ".join(list(
          dict.fromkeys(scaled or [t for _, t in found.roundings]))[:2]))
    elif cause == "weights" and found.selections and not found.divided:  # not a guard's
      fix = _SELECTION_FIX.format(", ".join(list(dict.fromkeys(found.selections))[:2]))
    on = sorted({f"{d.platform}:{d.id}" for leaf in acc.leaves for d in leaf.devices()})
    return LargeBatchReport(cause == "equal", cause, table[worst].relative_error,
                            table[worst].tolerance, w, fix, table, k,
                            on[0] if len(on) == 1 else f"{len(on)} devices ({on[0]}, ...)")

  def off(fit: list[np.ndarray], factor: float = 1.0) -> np.ndarray:
    """Each leaf's distance of ``factor`` times ``fit`` from the whole batch's gradient."""
    return np.array([np.linalg.norm(factor * fit[n] - whole.host(n)) for n in leaves])

  if np.all(errors <= tol):
    return report("equal", None, "Nothing to fix: accumulating these micro-batches gives the"
                  " whole batch's gradient, exactly up to float64 rounding.")
  if np.all(off(combined) <= tol):
    return report("accumulation", None, _ACCUMULATION_FIX)
  if np.any(permuted > tol):
    return report("order", None, _ORDER_FIX)
  dot = sum(float(x @ x) for x in combined)
  s = sum(float(combined[n] @ whole.host(n)) for n in leaves) / dot if dot else 0.0
  if s > 0 and np.all(off(combined, s) <= tol):
    return report("scale", stats.weights / stats.weights.sum(), _scale_fix(k, normalize, s))
  entries = sum(x.size for x in combined)
  if entries <= k:  # k vectors of that few entries combine into any gradient
    raise ValueError(
        f"check_large_batch: the accumulated gradient is not the whole batch's (relative error"
        f" {table[worst].relative_error:.3g}), but {entries} gradient entries for"
        f" num_microbatches={k} cannot tell unequal weights from coupling: check with"
        f" num_microbatches < {entries}, or a model with more parameters.")
  # Non-negative weights only: the least-squares fit clamped at 0, then checked exactly.
  sketch = np.zeros(SKETCH_ROWS)  # the whole batch's, sketched as each micro-batch's
  for n in leaves:
    sketch_leaf(n, whole.host(n), sketch)
  w = np.maximum(np.linalg.lstsq(stats.sketches.T, sketch, rcond=None)[0], 0.0)
  if w.sum() > 0:
    fitted = [np.zeros_like(x) for x in combined]
    for wj, g in zip(w, micro_batches(), strict=True):  # the second pass: exact
      for n in leaves:
        fitted[n] += wj * g.host(n)
    if np.all(off(fitted) <= tol):
      return report("weights", w / w.sum(),
                    _WEIGHTED_FIX if normalize == "weighted" else _WEIGHTS_FIX)
  return report("coupling", None, _COUPLING_FIX)


def _scale_fix(k: int, normalize: str, scale: float) -> str:
  said = f"The whole batch's gradient is {scale:.4g} times the accumulated one"
  if normalize == "mean" and np.isclose(scale, k, rtol=1e-2):
    return (f"{said}: the loss is a sum, averaged again: use `normalize='sum'`"
            " (`reduction='sum'` across steps), or make the loss a mean.")
  if normalize == "sum" and np.isclose(scale, 1 / k, rtol=1e-2):
    return f"{said}: the loss is a mean, summed again: use `normalize='mean'` (`reduction='mean'`)."
  return (f"{said}: the loss's normalisation depends on the batch size (a constant divided by"
          " the rows it sees?): divide by the whole batch's size, or scale the loss.")


_ACCUMULATION_FIX = (
    "The micro-batch gradients combine into the whole batch's, but `microbatched` returned"
    " another. On a sharded batch it runs `fn` per device: a loss normalised over the rows it"
    " sees is normalised per device (return (sum, count), normalize='weighted'). If not, a"
    " bug in optax_accum: please report it with this table, jax's version and the loss.")
_ORDER_FIX = (
    "`fn` gives another gradient on the same rows in another order: it reads the batch axis"
    " as more than a set of examples (views at rows 2i and 2i + 1, time-major [T, B] data,"
    " rows picked by position), which the strided micro-batches (rows i, i + k, ...) cut."
    " Make axis 0 the examples (views as [B, 2, ...], time as [B, T, ...]).")
_WEIGHTED_FIX = (
    "The whole batch weighs the micro-batches unequally, and not by the denominators"
    " `fn` returns: return (sum of the per-example losses, the count they are divided"
    " by) so that the whole batch's loss is their ratio.")
_WEIGHTS_FIX = (
    "The whole batch weighs the micro-batches unequally (the weights above): the loss is"
    " normalised per micro-batch, e.g. over its own real tokens. Return (sum of per-token"
    " losses, number of real tokens) and use `microbatched(..., normalize='weighted')`"
    " (`accumulate(k, opt, reduction='weighted')`, `update(..., weight=count)` across steps).")
_ROUNDING_FIX = (
    "{} rounds on a scale taken from the batch (fp8 current scaling: amax(|x|) / 448): each"
    " micro-batch rounds on its own grid. Scale per row, or from the previous step (delayed"
    " scaling): the same for every micro-batch.")
_SUM_ROUNDING_FIX = (
    "{} rounds a sum over the batch (the gradient of a weight cast with `astype`: the cast's"
    " backward casts the gradient too, with no scale): each micro-batch rounds its own sum."
    " Cast with a straight-through gradient (w + stop_gradient(q - w)), or scale the"
    " gradient's cast as well.")
_SELECTION_FIX = (
    "`fn` selects by the values of the batch it sees ({}): each micro-batch selects among its"
    " own rows, which no normalisation mends. Select per example, or on the whole batch's"
    " statistics (`microbatched(..., global_stats=)`).")
_COUPLING_FIX = (
    "No combination of the micro-batch gradients gives the whole batch's: the loss or the"
    " model couples the examples of a batch. Comparing embeddings across the batch (CLIP,"
    " in-batch negatives): `cached_microbatched(embed_fn, loss_fn, k)`. A statistic of the"
    " batch (expert counts): `microbatched(fn, k, global_stats=stats_fn)`. BatchNorm in"
    " training mode: ghost batch norm, as in every framework; GroupNorm / LayerNorm are exact.")
