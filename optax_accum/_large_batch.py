"""Is accumulating ``k`` micro-batches of my loss the large batch? (``debug.check_large_batch``)

The check compares the gradient :func:`~optax_accum.microbatched` accumulates
with ``fn`` on the whole batch, leaf by leaf, against a tolerance that only
floating point can explain, and when they differ it says why. It runs on the
host, once, streaming the micro-batches: a debugging tool, not a training step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_core

from optax_accum import _arrays, _batch, _validation, microbatching


class LeafError(NamedTuple):
  """One gradient leaf's error, a row of the report's table.

  Attributes:
    path: the leaf's path in the gradient tree, e.g. ``"['dense']['w']"``.
    shape: its shape.
    relative_error: the norm of its accumulated-minus-whole difference over
      the norm of the whole batch's gradient of this leaf.
    tolerance: the rounding this leaf's difference may hold, relative likewise.
  """

  path: str
  shape: tuple[int, ...]
  relative_error: float
  tolerance: float


class LargeBatchReport(NamedTuple):
  """What :func:`check_large_batch` found.

  Attributes:
    equal: whether every leaf of the accumulated gradient is the whole batch's
      within its tolerance.
    cause: ``"equal"``; ``"order"`` (the loss depends on the order of the rows:
      pairs or sequences laid along the batch axis, which the micro-batches
      split apart); ``"scale"`` (a positive multiple: the normalisation depends
      on the batch size); ``"weights"`` (the whole batch weighs the
      micro-batches unequally: per-micro-batch normalisation); ``"coupling"``
      (no non-negative combination of micro-batch gradients gives it: the loss
      or the model couples the examples of a batch); ``"accumulation"`` (the
      micro-batch gradients combine into the whole batch's but
      ``microbatched`` returned something else: a bug in optax_accum).
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
    rounding: the precision the tolerance assumes, e.g. ``"bfloat16 results,
      float32 sums over 32 rows"``.
  """

  equal: bool
  cause: str
  max_relative_error: float
  tolerance: float
  weights: tuple[float, ...] | None
  fix: str
  leaves: tuple[LeafError, ...]
  num_microbatches: int
  rounding: str

  def __str__(self) -> str:
    width = max([4, *(len(leaf.path) for leaf in self.leaves)])
    rows = [f"{'leaf':<{width}}  {'shape':<14}  relative error  tolerance"]
    rows += [f"{leaf.path:<{width}}  {leaf.shape!s:<14}  {leaf.relative_error:<14.2e}"
             f"  {leaf.tolerance:.2e}{'' if leaf.relative_error <= leaf.tolerance else '  <--'}"
             for leaf in self.leaves]
    sign = "<=" if self.equal else ">"
    rows.append(f"k={self.num_microbatches}: relative error {self.max_relative_error:.2e}"
                f" {sign} tolerance {self.tolerance:.2e} ({self.rounding}): {self.cause}")
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
) -> Callable[..., LargeBatchReport]:
  r"""Checks that accumulating ``k`` micro-batches of ``fn`` gives the large batch; says why not.

  ``fn``, ``batch_argnums``, ``has_aux`` and ``normalize`` are what
  :func:`~optax_accum.microbatched` takes (``fn`` is
  ``jax.value_and_grad(loss_fn)``). ``check_large_batch(fn, k)(params,
  *args)`` compares, leaf by leaf, the gradient ``microbatched(fn, k, ...)``
  accumulates over its ``k`` micro-batches (strided rows) with ``fn``'s on
  the whole batch, :math:`G` (for ``"weighted"``, the gradient over the
  denominator). To explain a difference it calls ``fn`` on each micro-batch,
  combines their gradients :math:`g_i` in float64 as ``microbatched`` does,
  :math:`C = \sum_i c_i g_i` (:math:`c_i = 1/k` for ``"mean"``, 1 for
  ``"sum"``, the micro-batch's share of the denominator for ``"weighted"``),
  and calls ``fn`` on the batch's rows permuted:

  * ``"equal"``: every leaf is :math:`G`'s within its tolerance.
  * ``"accumulation"``: :math:`C` is :math:`G`, ``microbatched``'s result is
    not: a bug in this package, which the check exists to catch too.
  * ``"order"``: ``fn`` on the permuted rows is not :math:`G`: the loss reads
    the batch axis as something other than a set of examples (pairs of views
    at rows ``2i`` and ``2i + 1``, time-major ``[T, B]`` data), and the
    micro-batches cut through it.
  * ``"scale"``: :math:`G` is a positive multiple of :math:`C`, e.g. a summed
    loss averaged again.
  * ``"weights"``: :math:`G` is a combination of the :math:`g_i` with other,
    non-negative weights, e.g. a loss normalised per micro-batch over its own
    real tokens (the weights are then the micro-batches' shares of them).
  * ``"coupling"``: no such combination fits: the loss or the model couples
    the examples of a batch (a contrastive loss, BatchNorm in training mode).
    Telling it from ``"weights"`` needs more gradient entries than
    micro-batches: with fewer, a gradient that is not the whole batch's
    raises ``ValueError``.

  **The tolerance is what rounding can explain, never a difference between
  the two sides.** Per leaf it is 4 times (a safety factor) the sum of two
  terms. The sums over the :math:`B` rows: :math:`u_s \sqrt{B}\, |G|`, their
  error growing with the square root of their length, :math:`u_s` the unit
  roundoff they accumulate in (float32 for 16-bit results: XLA and
  ``jnp.sum`` accumulate those in float32). And one rounding of every input,
  through the gradient's conditioning: how far ``fn``'s whole-batch gradient
  moves when every input is nudged by one unit roundoff :math:`u_r` of the
  coarsest dtype that ``fn``'s reductions over the rows (matmuls, sums) or
  its gradients come out in (the root mean square of two such calls). A
  residual near zero or rows that cancel amplify it as they amplify the
  computation's own roundings. :math:`u_r` is read from ``fn``'s jaxpr: the
  inputs' dtypes, elementwise casts and reductions over the params alone do
  not count. Neither a coupling nor the row order can produce any of it.
  Each leaf is held to its own tolerance, so a small leaf that is wholly
  wrong is found whatever its share of the whole. A float32 loss finds a
  defect of 0.01%, a bfloat16 one of a few percent.

  **What "equal" proves**: on these arguments, accumulating the ``k``
  micro-batches gives the large batch's gradient up to rounding. Not that it
  does on every batch: a loss equal here by coincidence (a mask that happens
  to give every micro-batch the same count of real rows) can differ on the
  next; check a batch like the ones you train on, for every ``k`` you train
  with. Randomness must be deterministic per example: ``fn`` drawing random
  numbers from a key that is not part of a batch argument (a key argument, a
  key captured by a closure, ``jax.random.key(0)`` inside the loss) draws
  other masks on the whole batch and on each micro-batch and is refused
  (``ValueError``) before anything runs; per-example keys inside a batch
  argument are split with it and fine.

  **Cost**: ``k + 4`` calls of ``fn`` (the whole batch, twice nudged, once
  permuted, each micro-batch, streamed) and one of ``microbatched(fn, k)``;
  ``k`` more for a ``"weights"`` or ``"coupling"`` verdict; one trace of
  ``fn``. Pass ``fn`` jitted to compile it once per shape. The host holds
  about 8 bytes per parameter whatever ``k``, the float64 :math:`C`, and one
  leaf at a time (``benchmarks/bench_large_batch.py`` measures it): under 1 GiB
  at 1e8 parameters. Parameters and batches may be sharded over the devices
  of one process.

  Args:
    fn: ``(*args) -> (value, grads)`` like ``jax.value_and_grad(loss_fn)``
      (``((value, aux), grads)`` with ``has_aux``; the value ``(numerator,
      denominator)`` with ``normalize="weighted"``).
    num_microbatches: ``k``, a positive int dividing the batch size.
    batch_argnums: position(s) of the batch argument(s) (default 1).
    has_aux: whether ``fn``'s value carries an aux output (not compared).
    normalize: ``"mean"``, ``"sum"`` or ``"weighted"``, as in ``microbatched``.

  Returns:
    ``check(*args, **kwargs) -> LargeBatchReport``, called with ``fn``'s
    arguments. ``str(report)`` is a per-leaf table and the verdict;
    ``report.raise_if_different()`` raises ``AssertionError`` with the cause
    and the fix.

  Raises:
    ValueError: (when called) for a batch ``k`` does not divide; ``fn``
      drawing random numbers from a key that is not in a batch argument; a
      gradient with NaN or Inf; a difference that too few gradient entries
      cannot explain.
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
  accumulated = jax.jit(microbatching.microbatched(  # checks the options
      fn, num_microbatches, batch_argnums=batch_argnums, has_aux=has_aux, normalize=normalize))
  k = int(num_microbatches)
  nums = _validation.check_argnums(batch_argnums, "batch_argnums")

  def check(*args: Any, **kwargs: Any) -> LargeBatchReport:
    batch = _batch.of(args, nums)  # the rules every entry point shares
    batch.check_divides(k)
    b_nums, rows = batch.positions, batch.rows
    splits = {i: _batch.split(args[i], k) for i in b_nums}
    rounding = _rounding(fn, args, kwargs, b_nums, rows)  # refuses hidden randomness

    def grads(what: str, rows_at: dict[int, Any]) -> _Grads:
      out = fn(*[rows_at.get(i, a) for i, a in enumerate(args)], **kwargs)
      value, den, _, tree = _batch.unpack(out, normalize, has_aux)
      if jnp.ndim(value) != 0:
        raise TypeError(
            f"`fn`'s value must be a scalar loss; got shape {jnp.shape(value)}. Pass"
            " `jax.value_and_grad(loss_fn)` of a scalar loss_fn (has_aux=True for (loss, aux)).")
      return _Grads.of(tree, what, den)

    def micro_batches() -> Iterator[_Grads]:
      for j in range(k):
        yield grads(f"micro-batch {j}",
                    {i: jax.tree.map(lambda x, j=j: x[j], splits[i]) for i in b_nums})

    whole = grads("the whole batch", {})
    nudged = [whole.distance(grads("the nudged batch", {
        i: _nudge(a, rounding.result, seed) for i, a in enumerate(args)}))
        for seed in range(_NUDGES)]
    order = np.random.default_rng(0).permutation(rows)
    permuted = whole.distance(grads("the permuted batch", {
        i: jax.tree.map(lambda x: _rows(x, order), args[i]) for i in b_nums}))
    stats = _Stats.of(whole, micro_batches(), normalize, k)
    acc = _Grads.of(accumulated(*args, **kwargs)[1], "microbatched")
    # The tolerance: the sums over the rows, whose error grows with the square root of
    # their length, and what the gradient's conditioning does to one rounding of every input.
    sums = rounding.sums * np.sqrt(rows) * np.array([np.linalg.norm(whole.host(n))
                                                     for n in range(len(whole.leaves))])
    tol = _SAFETY * (sums + np.sqrt(np.mean(np.square(nudged), axis=0)))
    return _classify(k, normalize, whole, permuted, acc, stats, tol, rounding, micro_batches)

  return check


def _rows(x: Any, order: np.ndarray) -> jax.Array:
  """``x``'s rows in ``order``, laid out over the devices as ``x`` is (sharded rows stay so)."""
  x = jnp.asarray(x)
  return x.at[order].get(out_sharding=jax.typeof(x).sharding)


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
    x = np.asarray(self.leaves[n])
    x = (np.ascontiguousarray(x, np.complex128).reshape(-1).view(np.float64)
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


def _sketch(grads: _Grads) -> np.ndarray:
  """A CountSketch of ``grads``: each entry, with a random sign, added to a random row.

  Linear, so an exact combination of the micro-batch gradients stays exact in it.
  """
  out = np.zeros(_SKETCH_ROWS)
  for n in range(len(grads.leaves)):
    _sketch_leaf(n, grads.host(n), out)
  return out


def _sketch_leaf(n: int, x: np.ndarray, out: np.ndarray) -> None:
  """Adds leaf ``n``'s share of the sketch to ``out``."""
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
  share of the denominators); one sketch per micro-batch.
  """

  combined: list[np.ndarray]
  weights: np.ndarray
  sketches: np.ndarray  # [k, _SKETCH_ROWS]

  @classmethod
  def of(cls, whole: _Grads, micro: Iterator[_Grads], normalize: str, k: int) -> _Stats:
    combined = [np.zeros(np.size(g) * (2 if jnp.iscomplexobj(g) else 1)) for g in whole.leaves]
    weights, sketches = np.zeros(k), np.zeros((k, _SKETCH_ROWS))
    for j, g in enumerate(micro):
      weights[j] = g.den if normalize == "weighted" else (1.0 / k if normalize == "mean" else 1.0)
      for n, total in enumerate(combined):
        x = g.host(n)
        _sketch_leaf(n, x, sketches[j])
        x *= weights[j]
        total += x
    if normalize == "weighted":  # over the sum of the denominators
      norm = float(weights.sum()) or 1.0  # no weight at all: C is 0
      for total in combined:
        total /= norm
      weights /= norm
    return cls(combined, weights, sketches)


# --------------------------------------------------------------- rounding and keys
_SAFETY = 4.0
_NUDGES = 2  # calls on nudged inputs: how much rounding the gradient's conditioning amplifies


def _nudge(tree: Any, unit: float, seed: int) -> Any:
  """Each float leaf times ``1 + unit * e``, ``e`` uniform in [-1, 1] per element.

  The whole batch's gradient at such inputs differs from its own by what rounding at
  ``unit`` can do to this computation: cancellation (a residual near zero, a gradient
  whose rows cancel) amplifies it, and neither a coupling nor the row order can cause it.
  """
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(jax.random.key(seed), len(leaves))

  def one(x: Any, key: jax.Array) -> Any:
    if not (isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating)):
      return x
    noise = jax.random.uniform(key, jnp.shape(x), jnp.float32, -1.0, 1.0)
    return (x * (1 + unit * noise)).astype(x.dtype)

  return jax.tree.unflatten(treedef, [one(x, key) for x, key in zip(leaves, keys, strict=True)])


_RANDOM = ("random_bits", "threefry2x32", "rng_bit_generator", "rng_uniform")
_REDUCTIONS = ("dot_general", "reduce_sum", "conv_general_dilated", "cumsum", "psum")
_BATCH, _CAPTURED = "a batch argument", "captured"


class _Rounding(NamedTuple):
  """The unit roundoffs the tolerance assumes: of each result, and of the sums over rows."""

  result: float
  sums: float
  text: str


def _rounding(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              b_nums: tuple[int, ...], rows: int) -> _Rounding:
  """What ``fn``'s batch-dependent reductions round to, from its jaxpr; raises on hidden keys.

  Each variable of the jaxpr carries the inputs it comes from (a batch argument, another
  argument, a captured constant; none for a constant made inside), so the check knows
  which reductions sum over data and which keys random numbers are drawn from.
  """
  inputs = _arrays.ArrayLeaves.of((args, kwargs))

  def traced(*values: Any) -> Any:
    a, kw = inputs.rebuild(values)
    return fn(*a, **kw)

  labels = [frozenset({_source(path, b_nums)}) for path in inputs.paths]
  closed = jax.make_jaxpr(traced)(*inputs.arrays)
  dtypes = {np.dtype(v.aval.dtype) for v in closed.jaxpr.outvars}  # the gradients' own
  _walk(closed.jaxpr, labels, dtypes)
  floats = [d for d in dtypes if jnp.issubdtype(d, jnp.inexact)] or [np.dtype(np.float32)]
  coarse = max(floats, key=lambda d: float(jnp.finfo(d).eps))
  sums = min(float(jnp.finfo(coarse).eps), float(jnp.finfo(np.float32).eps))
  text = (f"{coarse.name} sums over {rows} rows" if sums == jnp.finfo(coarse).eps else
          f"{coarse.name} results, float32 sums over {rows} rows")
  return _Rounding(float(jnp.finfo(coarse).eps) / 2, sums / 2, text)


def _source(path: Any, b_nums: tuple[int, ...]) -> str:
  """The label of an input leaf: a batch argument, or where a user finds it."""
  where, *rest = path
  at = jax.tree_util.keystr(tuple(rest[1:]))
  if where.idx == 0:  # positional
    i = rest[0].idx
    return _BATCH if i in b_nums else f"argument {i}{at}"
  return f"keyword `{rest[0].key}`{at}"


def _walk(jaxpr: jax_core.Jaxpr, labels: list[frozenset], dtypes: set[Any]) -> list[frozenset]:
  """Propagates the input labels through ``jaxpr``; returns its outputs' labels.

  Adds to ``dtypes`` the dtypes of reductions over data a batch argument feeds, and
  raises where random bits are drawn from a key no batch argument feeds.
  """
  env = dict(zip(jaxpr.invars, labels, strict=True))
  env.update((v, frozenset({_CAPTURED})) for v in jaxpr.constvars)

  def read(v: Any) -> frozenset:
    return frozenset() if isinstance(v, jax_core.Literal) else env.get(v, frozenset())

  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    every = frozenset().union(*ins)
    name = eqn.primitive.name
    if name in _RANDOM:
      _check_key(ins[0] if ins and name != "rng_uniform" else frozenset())
    if name in _REDUCTIONS and _BATCH in every:
      dtypes.update(np.dtype(v.aval.dtype) for v in eqn.outvars)
    outs = _walk_inner(eqn, ins, every, dtypes)
    env.update(zip(eqn.outvars, outs or [every] * len(eqn.outvars), strict=True))
  return [read(v) for v in jaxpr.outvars]


def _walk_inner(eqn: Any, ins: list[frozenset], every: frozenset,
                dtypes: set[Any]) -> list[frozenset] | None:
  """The labels of an equation's outputs, from its inner jaxprs (None: ``every`` on each).

  A call (jit, checkpoint, custom rules, shard_map, a scan's body) maps its operands one
  to one; a ``cond`` its operands after the branch index; a ``while`` its constants and
  carry. A loop's body is walked once, with the carry's labels on entry: a label that
  reaches a key only through the carry is missed, which refuses a loss rather than
  passing one. Anything else, an equation without inner jaxprs too, gets ``every``, the
  union of its operands' labels, on each output; its inner jaxprs are walked with it.
  """
  subs = list(jax_core.jaxprs_in_params(eqn.params))
  name = eqn.primitive.name
  if name == "cond":
    outs = [_walk(s, ins[1:], dtypes) for s in subs]
    # Not the branch index's labels: a value the batch only chooses carries no rows, and a
    # key it chooses is drawn the same for every micro-batch (refused).
    return [frozenset().union(*o) for o in zip(*outs, strict=True)]
  if name == "while":
    c, b = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    carry = ins[c + b:]
    _walk(eqn.params["cond_jaxpr"].jaxpr, ins[:c] + carry, dtypes)
    outs = _walk(eqn.params["body_jaxpr"].jaxpr, ins[c:c + b] + carry, dtypes)
    return [a | b for a, b in zip(outs, carry, strict=True)]
  if len(subs) == 1 and len(subs[0].invars) == len(ins):
    outs = _walk(subs[0], ins, dtypes)
    if len(outs) == len(eqn.outvars):
      return outs
  for s in subs:
    _walk(s, [every] * len(s.invars), dtypes)
  return None


def _check_key(labels: frozenset) -> None:
  """Raises unless the key random bits are drawn from comes from a batch argument."""
  if _BATCH in labels:
    return  # per-example keys, split with the batch: the same draws for each example
  named = sorted(x for x in labels if x != _CAPTURED)
  if named:
    where = f"{named[0]} is a PRNG key `fn` draws random numbers from"
  elif labels:
    where = ("`fn` draws random numbers from a key it captured (a closure, a global, a"
             " module's Rngs)")
  else:
    where = "`fn` draws random numbers from a key it makes itself (jax.random.key(seed) inside)"
  raise ValueError(
      f"{where}: the whole batch and every micro-batch then draw from the same key, other"
      " random numbers for the same examples (dropout masks), which no accumulation can"
      " match, and the check would blame the loss. Check a deterministic call (dropout off,"
      " e.g. `deterministic=True`); to train, pass the key as an argument and name it in"
      " `microbatched(..., rng_argnums=...)`, which folds it per micro-batch, or put"
      " per-example keys in a batch argument.")


# ---------------------------------------------------------------------- the verdict
def _classify(k: int, normalize: str, whole: _Grads, permuted: np.ndarray, acc: _Grads,
              stats: _Stats, tol: np.ndarray, rounding: _Rounding,
              micro_batches: Callable[[], Iterator[_Grads]]) -> LargeBatchReport:
  """The cause: equal, accumulation, order, scale, weights or coupling, in that order.

  ``permuted``: each leaf's distance of the permuted batch's gradient from the whole's.
  """
  leaves = range(len(whole.leaves))
  combined = stats.combined
  scale = np.array([np.linalg.norm(whole.host(n)) for n in leaves])
  scale = np.where(scale > 0, scale, tol / _SAFETY + (tol == 0))  # a zero leaf: its rounding
  errors = acc.distance(whole)
  ratio = np.divide(errors, tol, out=np.where(errors > 0, np.inf, 0.0), where=tol > 0)
  worst = int(np.argmax(ratio))
  table = tuple(LeafError(path, shape, float(e / s), float(t / s))
                for (path, shape), e, t, s in zip(whole.paths, errors, tol, scale, strict=True))

  def report(cause: str, weights: np.ndarray | None, fix: str) -> LargeBatchReport:
    w = None if weights is None else tuple(float(x) for x in weights)
    return LargeBatchReport(cause == "equal", cause, table[worst].relative_error,
                            table[worst].tolerance, w, fix, table, k, rounding.text)

  def off(fit: list[np.ndarray], factor: float = 1.0) -> np.ndarray:
    """Each leaf's distance of ``factor`` times ``fit`` from the whole batch's gradient."""
    return np.array([np.linalg.norm(factor * fit[n] - whole.host(n)) for n in leaves])

  if np.all(errors <= tol):
    return report("equal", None, "Nothing to fix: accumulating these micro-batches gives the"
                  " whole batch's gradient, up to rounding.")
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
        f"check_large_batch: the accumulated gradient is not the whole batch's (relative"
        f" error {table[worst].relative_error:.3g} > tolerance {table[worst].tolerance:.3g}),"
        f" but with {entries} gradient entries for num_microbatches={k} unequal weights"
        f" cannot be told from coupling. Check with num_microbatches < {entries}, or on a"
        " model with more parameters.")
  # Non-negative weights only: the least-squares fit clamped at 0, then checked exactly.
  w = np.maximum(np.linalg.lstsq(stats.sketches.T, _sketch(whole), rcond=None)[0], 0.0)
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
  said = f"The whole batch's gradient is {scale:.4g} times the accumulated one."
  if normalize == "mean" and np.isclose(scale, k, rtol=1e-2):
    return (f"{said} The loss sums over the examples and the micro-batches are averaged again:"
            " use `microbatched(..., normalize='sum')` (`accumulate(k, opt, reduction='sum')`"
            " across steps), or make the loss a mean.")
  if normalize == "sum" and np.isclose(scale, 1 / k, rtol=1e-2):
    return (f"{said} The loss is a mean and the micro-batches are summed: use"
            " `normalize='mean'` (`reduction='mean'` across steps).")
  return (f"{said} The loss's normalisation depends on the batch size (a constant divided by"
          " the number of rows it sees?): divide by the whole batch's size, or scale the loss.")


_ACCUMULATION_FIX = (
    "The micro-batch gradients, combined in float64 as `microbatched` combines them, are the"
    " whole batch's, but `microbatched` returned another gradient: a bug in optax_accum."
    " Please report it with this table, the versions of jax and optax_accum, and the loss."
    " (With the batch sharded under plain jit, `microbatched` runs `fn` on each device's"
    " rows: a loss normalised over the rows it sees is normalised per device too; return"
    " (sum, count) and use normalize='weighted'.)")
_ORDER_FIX = (
    "`fn` gives another gradient on the same rows in another order: the loss reads the batch"
    " axis as more than a set of examples (two views of one example at rows 2i and 2i + 1,"
    " time-major [T, B] data, sequences packed across rows), and the strided micro-batches"
    " (rows i, i + k, ...) cut through it. Make axis 0 the examples: stack views as"
    " [B, 2, ...] rather than [2B, ...], put time after the batch ([B, T, ...]); then each"
    " micro-batch holds whole examples.")
_WEIGHTED_FIX = (
    "The whole batch weighs the micro-batches unequally, and not by the denominators"
    " `fn` returns: return (sum of the per-example losses, the count they are divided"
    " by) so that the whole batch's loss is their ratio.")
_WEIGHTS_FIX = (
    "The whole batch weighs the micro-batches unequally (the weights above): the loss is"
    " normalised per micro-batch, e.g. a mean over its own real tokens. Return (sum of"
    " per-token losses, number of real tokens) and use"
    " `microbatched(jax.value_and_grad(loss, has_aux=True), k, normalize='weighted')`;"
    " across steps `accumulate(k, opt, reduction='weighted')` with"
    " `update(..., weight=count)`.")
_COUPLING_FIX = (
    "No combination of the micro-batch gradients gives the whole batch's: the loss or the"
    " model couples the examples of a batch, and each micro-batch sees only its own. A loss"
    " that compares embeddings across the batch (CLIP, SigLIP, in-batch negatives): use"
    " `cached_microbatched(embed_fn, loss_fn, k)`, the whole batch's gradient exactly."
    " BatchNorm in training mode normalises each micro-batch with its own statistics"
    " (ghost batch norm): that is what accumulation gives in every framework; keep it if"
    " training is fine, or use GroupNorm / LayerNorm where the large batch must be exact.")
