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
from jax.extend import source_info_util

from optax_accum import _arrays, _batch, _float64, _global_stats, _jaxpr, _validation, microbatching


class LeafError(NamedTuple):
  """One gradient leaf's error, a row of the report's table.

  Attributes:
    path: the leaf's path in the gradient tree, e.g. ``"['dense']['w']"``.
    shape: its shape.
    relative_error: the norm of its accumulated-minus-whole difference over
      the norm of the whole batch's gradient of this leaf, both evaluated in
      float64: what decides.
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
  r"""Checks that accumulating ``k`` micro-batches of ``fn`` gives the large batch; says why not.

  ``fn``, ``batch_argnums``, ``has_aux`` and ``normalize`` are what
  :func:`~optax_accum.microbatched` takes (``fn`` is
  ``jax.value_and_grad(loss_fn)``). ``check_large_batch(fn, k)(params,
  *args)`` compares, leaf by leaf, the gradient ``microbatched(fn, k, ...)``
  accumulates over its ``k`` micro-batches (strided rows) with ``fn``'s on
  the whole batch, :math:`G` (for ``"weighted"``, the gradient over the
  denominator). To explain a difference it calls ``fn`` on each micro-batch,
  combines their gradients :math:`g_i` as ``microbatched`` does,
  :math:`C = \sum_i c_i g_i` (:math:`c_i = 1/k` for ``"mean"``, 1 for
  ``"sum"``, the micro-batch's share of the denominator for ``"weighted"``),
  and calls ``fn`` on the batch's rows in two other orders (rows 0 and 1
  swapped; every row moved one on: together they make every order):

  * ``"equal"``: every leaf is :math:`G`'s within its tolerance.
  * ``"accumulation"``: :math:`C` is :math:`G`, ``microbatched``'s result is
    not: a bug in this package, which the check exists to catch too.
  * ``"order"``: ``fn`` on either order is not :math:`G`: the loss reads
    the batch axis as something other than a set of examples (pairs of views
    at rows ``2i`` and ``2i + 1``, time-major ``[T, B]`` data), and the
    micro-batches cut through it.
  * ``"scale"``: :math:`G` is a positive multiple of :math:`C`, e.g. a summed
    loss averaged again.
  * ``"weights"``: :math:`G` is a combination of the :math:`g_i` with other,
    non-negative weights, e.g. a loss normalised per micro-batch over its own
    real tokens (the weights are then the micro-batches' shares of them).
  * ``"coupling"``: no such combination fits: the loss or the model couples
    the examples of a batch (a contrastive loss, BatchNorm in training mode,
    hard-example mining, a batch-level balancing loss). Telling it from
    ``"weights"`` needs more gradient entries than micro-batches: with fewer,
    a gradient that is not the whole batch's raises ``ValueError``.

  The fix names what the trace shows, when it explains a ``"weights"`` or
  ``"coupling"``: a rounding (``round``, a cast to an 8-bit type: fp8, int8)
  of a value scaled by a statistic of the batch (fp8 current scaling,
  ``amax(|x|)`` of the whole tensor) first; then, for ``"weights"``, a
  selection by the batch's values (a ``cond`` or ``where`` on a statistic
  of the batch, ``top_k``, ``sort``, ``argmax``, ``max`` over the rows),
  which no ``normalize`` mends (unless the loss also divides by a statistic of
  the batch, a count: a guard around a mean per micro-batch). A statistic of
  the batch is a value of the batch whose shape does not follow its rows: the check traces ``fn`` on
  the whole batch and on a micro-batch and compares the shapes, equation by
  equation.

  **Every gradient is evaluated in float64**, whatever dtypes ``fn``
  computes in: ``fn`` is traced as it runs (your ``jax_enable_x64`` setting
  untouched), then its jaxpr is evaluated with every floating value,
  operation and dtype parameter in float64 (bfloat16 policies, a bfloat16
  embedding's scatter-add, ``preferred_element_type``), through
  ``jax.jit``, ``jax.checkpoint``, custom derivative rules, ``lax.cond``,
  ``lax.scan``, ``lax.while_loop`` and ``shard_map``; integer values and the
  bits of random numbers stay what they are, and a cast to an 8-bit float
  (fp8) stays a rounding in that type, as ``jnp.round`` does: a scale per
  row or from the previous step is ``"equal"`` (weights: with a straight-through
  gradient; ``astype``'s backward rounds the summed gradient), one from the
  batch's ``amax`` is not (each micro-batch has its grid). ``microbatched`` itself is
  evaluated the same way. A loss that is a sum over its examples then gives
  micro-batches and whole batch within about ``1e-15`` of each other, so no
  model of rounding is needed: each leaf's tolerance is ``1e-9`` of the
  larger of its gradient and the micro-batch gradients it sums, and any
  difference the algebra makes (a loss normalised per micro-batch, a
  statistic of the batch, labels stored as floats and cast to int, a mask
  compared with ``== 1.0``) stands out by orders of magnitude (a leaf below
  ``1e-12`` of the whole gradient, or a gradient that is zero in exact
  arithmetic everywhere, is float64 noise and not resolved). The report
  also shows each leaf's difference in your own dtypes, what training will
  see; it decides nothing. What cannot be evaluated in float64 (a
  ``pure_callback``, an FFI call, a Pallas kernel) raises ``ValueError``
  naming it and where it is: check the loss with its reference
  implementation (e.g. ``jax.nn.dot_product_attention(...,
  implementation="xla")``).

  **What "equal" proves**: on these arguments, accumulating the ``k``
  micro-batches gives the large batch's gradient, exactly up to float64
  rounding. Not that it does on every batch: a loss equal here by
  coincidence (a mask that happens to give every micro-batch the same count
  of real rows) can differ on the next; check a batch like the ones you
  train on, for every ``k`` you train with. Random numbers drawn per row
  (a dropout mask: their shape follows the batch, or a loop over the rows
  draws them) must come from keys in a batch argument: from a key argument,
  a captured key or ``jax.random.key(0)`` inside the loss they are other
  numbers for the same examples on the whole batch and on each micro-batch,
  and are refused (``ValueError``) before anything runs. Draws whose shape
  does not follow the batch (fixed random features, a projection drawn from
  a key argument) are the same for both, and checked like the rest.

  **Cost**: ``fn`` on the whole batch and ``microbatched(fn, k)`` once each
  in their own dtypes, compiled as training runs them, and in float64 ``fn``
  on the whole batch, in two other orders, and on each micro-batch, and ``microbatched``
  once; ``k`` more micro-batch calls for a ``"weights"`` or ``"coupling"``
  verdict. Three float64 programs are compiled (the whole batch, a
  micro-batch, ``microbatched``) and run on the host CPU
  (``jax.devices("cpu")[0]``) whatever device holds the arguments (an
  accelerator may emulate float64, and compiling it there can take
  minutes); the arguments go there leaf by leaf, and
  ``report.float64_on`` says where it ran. Arguments laid out over several
  devices (a mesh) are evaluated on those devices, laid out as they are; a
  loss holding its own ``shard_map`` over several devices, on that mesh's.
  The float64 program holds the float64 gradients (8 bytes per parameter
  each: the whole batch's, ``microbatched``'s, one micro-batch's at a
  time), a copy of the arguments and a float64 step's activations; numpy
  holds about 8 bytes per parameter whatever ``k``, the float64 :math:`C`,
  and one leaf at a time (``benchmarks/bench_large_batch.py`` measures
  both).

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

    def grads(out: Any, what: str) -> _Grads:
      value, den, _, tree = _batch.unpack(out, normalize, has_aux)
      if jnp.ndim(value) != 0:
        raise TypeError(
            f"`fn`'s value must be a scalar loss; got shape {jnp.shape(value)}. Pass"
            " `jax.value_and_grad(loss_fn)` of a scalar loss_fn (has_aux=True for (loss, aux)).")
      return _Grads.of(tree, what, den)

    def rows_of(order: np.ndarray) -> tuple[Any, ...]:  # the batch's rows in that order
      rows = dict(zip(b_nums, _rows(tuple(args[i] for i in b_nums), order), strict=True))
      return tuple(rows.get(i, a) for i, a in enumerate(args))

    def micro(j: int) -> tuple[Any, ...]:  # the strided split, as microbatched's
      return rows_of(np.arange(j, rows, k))

    def micro_batches() -> Iterator[_Grads]:
      for j in range(k):
        yield grads(on_micro(micro(j), wide), f"micro-batch {j}")

    own, wide = kwargs, kwargs  # fn's keywords; with global_stats, the whole batch's `stats=`
    if global_stats is not None:  # (pooled like microbatched's, the float64 sum in float64)
      pooled = _global_stats.summable(global_stats, args, _batch.shapes_at(args, b_nums, rows // k),
                                      b_nums, rows // k)[0]
      on_all = _in_float64(pooled, args, {}, b_nums, programs["stats"])[0](args)
      on_part = _in_float64(pooled, micro(0), {}, b_nums, programs["stats"])[0]
      wide = {**kwargs, "stats": _global_stats.check_sums(on_all, [on_part(micro(j))
                                                                   for j in range(k)])}
      own = {**kwargs, "stats": jax.tree.map(lambda n, w: w if jnp.issubdtype(
          w.dtype, jnp.integer) else jnp.asarray(n), pooled(*args), wide["stats"])}
    on_micro, _, seen = _in_float64(fn, micro(0), own, b_nums, programs["fn"])
    # The whole batch's trace, beside the micro-batch's: refuses draws per row.
    on_whole, as_trained, found = _in_float64(fn, args, own, b_nums, programs["fn"], seen)
    native = grads(as_trained(args), "the whole batch")  # what training sees
    whole = grads(on_whole(args, wide), "the whole batch")
    # A swap and a rotation generate every permutation: a loss both leave as it is reads its
    # rows as a set. (One random order missed some: for 2 rows the identity, for 6 one that
    # kept each pair of rows 2i, 2i + 1 together.)
    swap = np.arange(rows)
    swap[:2] = swap[:2][::-1]
    permuted = np.max([whole.distance(grads(on_whole(rows_of(order), wide), "a reordered batch"))
                       for order in (swap, np.roll(np.arange(rows), 1))], axis=0)
    stats = _Stats.of(whole, micro_batches(), normalize, k)
    on_accumulated, acc_as_trained, _ = _in_float64(accumulated, args, kwargs, b_nums,
                                                    programs["microbatched"])
    acc = _Grads.of(on_accumulated(args)[1], "microbatched")
    native_errors = _Grads.of(acc_as_trained(args)[1], "microbatched").distance(native)
    return _classify(k, normalize, whole, permuted, acc, stats, micro_batches, native_errors,
                     found)

  return check


def _in_float64(f: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                b_nums: tuple[int, ...], programs: dict[Any, Any],
                other: _Trail | None = None,
                ) -> tuple[Callable[..., Any], Callable[..., Any], _Trail]:
  """``f``'s outputs on arguments shaped like ``args``: in float64 (``_float64.evaluate``), and
  in ``f``'s own dtypes (its trace compiled as it is: what training sees).

  ``f`` is traced on ``args`` as they are, once per types of its arguments: ``programs``
  (``f``'s alone: no key names ``f``) keeps the float64 program of each and the trace's own,
  so a check called again on new batches compiles nothing (an eager ``microbatched``
  compiled its scan on every call). Its walk (:class:`_Trail`) is compared with
  ``other``'s, the trace of a micro-batch, when given: raises where ``f`` draws random
  numbers per row from a key no batch argument feeds.
  """
  inputs = _arrays.ArrayLeaves.of((args, kwargs))
  static = tuple(x for x in inputs.leaves if not isinstance(x, (jax.Array, np.ndarray)))
  key = (b_nums, inputs.treedef, tuple(map(jax.typeof, inputs.arrays)), static)
  if key not in programs:
    def traced(*values: Any) -> Any:
      a, kw = inputs.rebuild(values)
      return f(*a, **kw)

    closed, shape = jax.make_jaxpr(traced, return_shape=True)(*inputs.arrays)
    trail = _Trail(other)
    _walk(closed.jaxpr, [frozenset({_source(path, b_nums)}) for path in inputs.paths], trail)
    programs[key] = (_float64.evaluate(closed), jax.jit(jax_core.jaxpr_as_fun(closed)),
                     jax.tree.structure(shape), trail)
  wide, own, out, trail = programs[key]
  on = lambda run: lambda new, kw=kwargs: jax.tree.unflatten(
      out, run(*_arrays.ArrayLeaves.of((new, kw)).arrays))
  return on(wide), on(own), trail


@jax.jit
def _rows(batch: Any, order: jax.Array) -> Any:
  """The rows in ``order``, laid out over the devices as they are (sharded rows stay so): one
  program for every leaf of the batch arguments (an op per leaf compiled 4 to 5 programs)."""
  return jax.tree.map(lambda x: x.at[order].get(out_sharding=jax.typeof(x).sharding), batch)


# ------------------------------------------------------------- the gradients, leaf by leaf
class _Grads(NamedTuple):
  """One call's gradient: its differentiable leaves where ``fn`` left them, and their paths.

  The host sees one leaf at a time (:meth:`host`), as a flat float64 vector: the check
  keeps no gradient on the host but the float64 combination of the micro-batches'.
  """

  leaves: list[Any]
  paths: list[tuple[str, tuple[int, ...]]]  # (path in the gradient tree, shape)
  den: float  # "weighted"'s denominator (the gradient is over it); 1 otherwise
  what: str

  @classmethod
  def of(cls, tree: Any, what: str, den: Any = None) -> _Grads:
    found = [(path, g) for path, g in jax.tree_util.tree_flatten_with_path(tree)[0]
             if jnp.issubdtype(jnp.result_type(g), jnp.inexact)]  # float0: no gradient
    return cls([g for _, g in found],
               [(jax.tree_util.keystr(p), tuple(np.shape(g))) for p, g in found],
               1.0 if den is None else float(den), what)

  def host(self, n: int) -> np.ndarray:
    """Leaf ``n`` on the host (a complex one as its real and imaginary parts)."""
    x = _numpy(self.leaves[n])
    x = (np.array(x, np.complex128).reshape(-1).view(np.float64)  # a copy, written to below
         if np.iscomplexobj(x) else np.array(x, np.float64).reshape(-1))
    if not np.isfinite(x).all():
      raise ValueError(
          f"The gradient of {self.what} holds NaN or Inf at {self.paths[n][0]}: no comparison"
          " can mean anything. Check the loss on these arguments first (jax.debug_nans).")
    if self.den != 1.0:
      x *= 1.0 / self.den if self.den else 0.0
    return x

  def distance(self, other: _Grads) -> np.ndarray:
    """Each leaf's norm of ``self - other``."""
    out = []
    for n in range(len(self.leaves)):
      x = self.host(n)
      x -= other.host(n)
      out.append(np.linalg.norm(x))
    return np.array(out)


# ------------------------------------------------------------ streaming statistics
_SKETCH_ROWS = 1024  # CountSketch rows: the weights' least squares, at any size
_CHUNK = 1 << 16  # entries at a time: the temporaries stay a few MB on any model


def _numpy(x: Any) -> np.ndarray:
  """``x`` in numpy, read from a fresh copy: ``np.asarray`` of an array it cannot read in
  place (an accelerator's, one laid out over devices) keeps its copy cached on the array for
  the array's life, and the check would hold whole gradients (on a TPU: +8 B/entry). The copy
  is a transfer, no program: ``jnp.copy`` compiled one per leaf shape (18 for the decoder of
  ``bench_large_batch.py --decoder``)."""
  if not isinstance(x, jax.Array) or not x.is_fully_addressable:
    return np.asarray(x)  # (another process's shards: numpy's own rules, and its errors)
  return np.asarray(jax.device_put(x, may_alias=False))


def _sketch_leaf(n: int, x: np.ndarray, out: np.ndarray) -> None:
  """Adds leaf ``n``'s share of a gradient's CountSketch to ``out``: each entry, with a random
  sign, added to a random row.

  Linear, so an exact combination of the micro-batch gradients stays exact in it.
  """
  for start in range(0, x.size, _CHUNK):
    rng = np.random.default_rng((n, start))  # the same hash for every call
    part = x[start:start + _CHUNK]
    rows = rng.integers(0, _SKETCH_ROWS, part.size, dtype=np.int32)
    signs = rng.integers(0, 2, part.size, dtype=np.int8) * 2 - 1
    out += np.bincount(rows, part * signs, minlength=_SKETCH_ROWS)


class _Stats(NamedTuple):
  """What the check keeps of the micro-batch gradients: their float64 combination, sketched.

  ``combined`` is ``C = sum c_i g_i`` leaf by leaf, ``weights`` the ``c_i``: how
  ``microbatched`` combines the micro-batch gradients (``1/k``, 1, or each micro-batch's
  share of the denominators); ``sizes`` the ``sum c_i |g_i|`` of each leaf, the size of
  the terms ``C`` sums (larger than ``C``'s where they cancel); one sketch per micro-batch.
  """

  combined: list[np.ndarray]
  weights: np.ndarray
  sizes: np.ndarray
  sketches: np.ndarray  # [k, _SKETCH_ROWS]

  @classmethod
  def of(cls, whole: _Grads, micro: Iterator[_Grads], normalize: str, k: int) -> _Stats:
    combined = [np.zeros(np.size(g) * (2 if jnp.iscomplexobj(g) else 1)) for g in whole.leaves]
    weights, sketches = np.zeros(k), np.zeros((k, _SKETCH_ROWS))
    sizes = np.zeros(len(combined))
    for j, g in enumerate(micro):
      weights[j] = g.den if normalize == "weighted" else (1.0 / k if normalize == "mean" else 1.0)
      for n, total in enumerate(combined):
        x = g.host(n)
        _sketch_leaf(n, x, sketches[j])
        x *= weights[j]
        total += x
        sizes[n] += np.linalg.norm(x)
    if normalize == "weighted":  # over the sum of the denominators
      norm = float(weights.sum()) or 1.0  # no weight at all: C is 0
      for total in combined:
        total /= norm
      weights /= norm
      sizes /= norm
    return cls(combined, weights, sizes, sketches)


# ------------------------------------------------------------------------------ keys
_RANDOM = ("random_bits", "threefry2x32", "rng_bit_generator", "rng_uniform")
_BATCH, _CAPTURED = "a batch argument", "captured"
_STAT = "a statistic of the batch"  # of the batch, and its shape does not follow the rows
_SELECT = {"top_k": "axis", "sort": "dimension", "argmax": "axes", "argmin": "axes",
           "reduce_max": "axes", "reduce_min": "axes"}  # pick among the rows on these axes


class _Trail:
  """What a walk of one trace found, beside the trace of a micro-batch (``other``).

  The two traces hold the same equations in the same order (checked: ``aligned``), and
  a value's shape tells whether it follows the rows: a value of the batch whose shape
  does not is a statistic of the batch (labelled ``_STAT``). Compared with ``other``, it
  raises at random numbers drawn per row (their shape differs from the micro-batch's, or
  a loop over the rows or a ``while`` draws them) from a key no batch argument feeds, and
  records each selection among the rows or by a statistic of the batch (``cond``,
  ``select_n``, ``_SELECT``) and each rounding (``round``, a cast to an 8-bit type: fp8,
  int8) of a value that a statistic of the batch scales. Without ``other`` (the
  micro-batch itself, ``microbatched``) it only records the shapes.
  """

  def __init__(self, other: _Trail | None = None) -> None:
    self.shapes: list[Any] = []  # (primitive, operand shapes, result shapes), in walk order
    self.other, self.aligned = (iter(other.shapes) if other else None), other is not None
    self.in_loop = False  # inside a loop whose trip count may follow the rows
    self.at = ""  # the user's line of the equation being walked (inner ones have JAX's)
    self.selections: list[str] = []
    self.roundings: list[tuple[bool, str]] = []  # (of a sum over the rows?, what, where)
    self.divided = False  # by a statistic of the batch (a count): normalisation mends it

  def visit(self, eqn: Any, ins: list[frozenset]) -> tuple[Any, ...] | None:
    """Records ``eqn``; returns the micro-batch's shapes of it (None: not comparable)."""
    mine = (eqn.primitive.name, *([v.aval.shape for v in vs] for vs in (eqn.invars,
                                                                        eqn.outvars)),
            eqn.params.get("length"))  # a scan's: does it follow the rows?
    self.shapes.append(mine)
    theirs = next(self.other, None) if self.aligned else None
    self.aligned = theirs is not None and theirs[0] == mine[0]
    theirs = theirs if self.aligned else None
    name, p = mine[0], eqn.params
    where = self.at = source_info_util.summarize(eqn.source_info) or self.at
    first = ins[0] if ins and name != "rng_uniform" else frozenset()  # a key, a predicate
    if name in _RANDOM and self.other is not None and (self.in_loop or theirs != mine):
      _check_key(first)  # a draw per row
    axes = np.atleast_1d(p.get(_SELECT.get(name, ""), ())).tolist()
    among_rows = theirs and _BATCH in first and any(mine[1][0][a] != theirs[1][0][a] for a in axes)
    self.divided |= name == "div" and _STAT in ins[1]
    if among_rows or (_STAT in first and name in ("cond", "select_n")):
      self.selections.append(f"`{name}` at {where}")
    narrow = name == "convert_element_type" and np.dtype(p["new_dtype"]).itemsize == 1  # fp8, int8
    if name == "reduce_precision" and _float64.narrow(p):
      narrow, p = True, {"new_dtype": f"e{p['exponent_bits']}m{p['mantissa_bits']} (fp8)"}
    if _STAT in first and (name == "round" or narrow):  # summed: the value is a statistic
      summed = theirs is not None and theirs[1][0] == mine[1][0]  # (a weight's gradient)
      self.roundings.append((summed, f"`{name}` to {p.get('new_dtype', 'integers')} at {where}"))
    return theirs


def _source(path: Any, b_nums: tuple[int, ...]) -> str:
  """The label of an input leaf: a batch argument, or where a user finds it."""
  where, *rest = path
  at = jax.tree_util.keystr(tuple(rest[1:]))
  if where.idx == 0:  # positional
    i = rest[0].idx
    return _BATCH if i in b_nums else f"argument {i}{at}"
  return f"keyword `{rest[0].key}`{at}"


def _walk(jaxpr: jax_core.Jaxpr, labels: list[frozenset], trail: _Trail) -> list[frozenset]:
  """Propagates the input labels through ``jaxpr``; returns its outputs' labels.

  Each variable carries the inputs it comes from (a batch argument, another argument, a
  captured constant; none for a constant made inside), and ``_STAT`` for a statistic of
  the batch; ``trail`` records what the check needs of each equation.
  """
  return _jaxpr.interpret(_LABELS, jaxpr, [frozenset({_CAPTURED})] * len(jaxpr.constvars),
                          labels, trail)


def _labels(trail: _Trail, eqn: Any, ins: list[frozenset]) -> list[frozenset]:
  """The walk's one rule: an equation's output labels, the equation recorded by ``trail`` first.

  The labels go through the equation's jaxprs as ``_jaxpr.descend`` takes them, joined by
  union. A loop's body is walked once, with the carry's labels on entry: a label that
  reaches a key only through the carry is missed, which refuses a loss rather than passing
  one. A ``cond``'s outputs do not carry the branch index's labels: a value the batch only
  chooses carries no rows, and a key it chooses is drawn the same for every micro-batch
  (refused). An equation without jaxprs puts the union of its operands' labels on each
  output. A value of the batch whose shape the rows do not shape is a statistic.
  """
  in_loop, at = trail.in_loop, trail.at
  theirs = trail.visit(eqn, ins)  # sets trail.at for the inner jaxprs
  trail.in_loop |= eqn.primitive.name == "while" or (  # a scan: if its length follows
      eqn.primitive.name == "scan" and (theirs or (0,) * 4)[3] != trail.shapes[-1][3])
  outs = _jaxpr.descend(eqn, ins, lambda j, a: _walk(j, a, trail),
                        lambda labels: frozenset().union(*labels))
  trail.in_loop, trail.at = in_loop, at
  if theirs is None:
    return outs
  return [o | {_STAT} if _BATCH in o and v.aval.shape == s else o
          for o, v, s in zip(outs, eqn.outvars, theirs[2], strict=True)]


_LABELS = _jaxpr.Rules({}, _labels, lambda v: frozenset())  # one rule: the trail sees each equation


def _check_key(labels: frozenset) -> None:
  """Raises for random numbers per row unless their key comes from a batch argument."""
  if _BATCH in labels:
    return  # per-example keys, split with the batch: the same draws for each example
  named = sorted(x for x in labels if x != _CAPTURED)
  key = named[0] if named else "a key it captured" if labels else "a key it makes itself"
  raise ValueError(
      f"`fn` draws random numbers per row (a dropout mask) from {key}: the whole batch and"
      " each micro-batch draw other numbers for the same examples, which no accumulation"
      " matches. Check with dropout off (`deterministic=True`); to train, name the key in"
      " `microbatched(..., rng_argnums=...)`, or put per-example keys in a batch argument.")


# ---------------------------------------------------------------------- the verdict
_TOLERANCE = 1e-9  # of a leaf's size: float64 leaves about 1e-15 of it, the algebra >= 1e-4


def _classify(k: int, normalize: str, whole: _Grads, permuted: np.ndarray, acc: _Grads,
              stats: _Stats, micro_batches: Callable[[], Iterator[_Grads]],
              native: np.ndarray, found: _Trail) -> LargeBatchReport:
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
  scale = np.where(norms > 0, norms, np.where(tol > 0, tol / _TOLERANCE, 1.0))  # a zero leaf
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
  sketch = np.zeros(_SKETCH_ROWS)  # the whole batch's, sketched as each micro-batch's
  for n in leaves:
    _sketch_leaf(n, whole.host(n), sketch)
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
