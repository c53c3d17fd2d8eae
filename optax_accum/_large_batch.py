"""Is accumulating ``k`` micro-batches of my loss the large batch? (``debug.check_large_batch``)

The check compares the gradient :func:`~optax_accum.microbatched` accumulates
with ``fn`` on the whole batch and, when they differ, explains why by solving
for the combination of the micro-batch gradients that gives the whole batch's.
It runs eagerly on the host, once: a debugging tool, not a training step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_core
from jax.flatten_util import ravel_pytree

from optax_accum import _batch, _validation, microbatching


class LeafError(NamedTuple):
  """One gradient leaf's error, a row of the report's table.

  Attributes:
    path: the leaf's path in the gradient tree, e.g. ``"['dense']['w']"``.
    shape: its shape.
    relative_error: the norm of its accumulated-minus-whole difference over
      the whole batch's gradient norm (all leaves).
  """

  path: str
  shape: tuple[int, ...]
  relative_error: float


class LargeBatchReport(NamedTuple):
  """What :func:`check_large_batch` found.

  Attributes:
    equal: whether the accumulated gradient is the whole batch's, within
      ``tolerance``.
    cause: ``"equal"``, ``"weights"`` (the whole batch weighs the micro-batches
      unequally: per-micro-batch normalisation), ``"scale"`` (equal weights,
      wrong total) or ``"coupling"`` (no combination of micro-batch gradients
      gives it: the loss or the model couples the examples of a batch).
    max_relative_error: the largest leaf's ``relative_error``.
    tolerance: the rounding the check measured (see :func:`check_large_batch`).
    weights: for ``"weights"`` and ``"scale"``, the weight per micro-batch
      that makes their combination the whole batch's gradient, normalised to
      sum 1; ``None`` otherwise.
    fix: what to write instead, naming the API.
    leaves: one :class:`LeafError` per gradient leaf.
    num_microbatches: ``k``.
  """

  equal: bool
  cause: str
  max_relative_error: float
  tolerance: float
  weights: tuple[float, ...] | None
  fix: str
  leaves: tuple[LeafError, ...]
  num_microbatches: int

  def __str__(self) -> str:
    width = max([4, *(len(leaf.path) for leaf in self.leaves)])
    rows = [f"{'leaf':<{width}}  {'shape':<14}  relative error"]
    rows += [f"{leaf.path:<{width}}  {leaf.shape!s:<14}  {leaf.relative_error:.2e}"
             for leaf in self.leaves]
    sign = "<=" if self.equal else ">"
    rows.append(f"k={self.num_microbatches}: max relative error {self.max_relative_error:.2e}"
                f" {sign} tolerance {self.tolerance:.2e}: {self.cause}")
    if self.weights is not None:
      rows.append("weights per micro-batch: " + " ".join(f"{w:.4g}" for w in self.weights))
    rows.append(self.fix)
    return "\n".join(rows)

  def raise_if_different(self) -> None:
    """Raises ``AssertionError`` with the cause and the fix unless ``equal``."""
    if not self.equal:
      raise AssertionError(
          f"Accumulating {self.num_microbatches} micro-batches is not the large batch:"
          f" cause {self.cause!r} (max relative error {self.max_relative_error:.3g},"
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
  *args)`` compares the gradient ``microbatched(fn, k, ...)`` accumulates over
  its ``k`` micro-batches (strided rows) with ``fn`` on the whole batch (for
  ``"weighted"``, the gradient over the denominator), and explains a
  difference: it calls ``fn`` on each micro-batch for its gradient
  :math:`g_i` and finds weights :math:`w` with :math:`\sum_i w_i g_i` the
  whole batch's gradient :math:`G` (least squares, float64, on the host).

  * ``"equal"``: the accumulated gradient is :math:`G` within the tolerance.
  * ``"scale"``: :math:`G` is a multiple of what ``microbatched`` combines
    (:math:`\sum_i c_i g_i` with :math:`c_i = 1/k` for ``"mean"``, 1 for
    ``"sum"``, the micro-batch's share of the denominator for
    ``"weighted"``), e.g. a summed loss averaged again.
  * ``"weights"``: :math:`G` is another combination of the :math:`g_i`, e.g.
    a loss normalised per micro-batch over its own real tokens (the weights
    are then the micro-batches' shares of the real tokens).
  * ``"coupling"``: no combination fits within the tolerance: the loss or the
    model couples the examples of a batch (a contrastive loss, BatchNorm in
    training mode). Telling it from ``"weights"`` needs more gradient entries
    than micro-batches: with fewer, a gradient that is not the whole batch's
    raises ``ValueError``.

  The tolerance is measured on the call itself, as twice the largest of
  three differences that are zero in exact arithmetic whatever the loss does,
  so that what is left is rounding: ``fn`` on the whole batch against ``fn``
  on its rows permuted (another summation order); ``microbatched`` (compiled,
  summing in float32) against the float64 combination of the ``k`` calls of
  ``fn``; and one rounding at the precision the loss computes in, the largest
  machine epsilon of the float dtypes in ``fn``'s program
  (``jax.make_jaxpr``) times
  :math:`(\lVert G\rVert + \sum_i |c_i| \lVert g_i\rVert) / \lVert G\rVert`
  (a micro-batch gradient rounds at its own, larger, norm). All of it is
  relative to :math:`\lVert G\rVert`, like the errors. A loss computing in
  bfloat16 gets a tolerance of a few percent (its final roundings do not
  change with the summation order, hence the epsilon term); one in float32
  finds a 1% defect. ``fn`` must not depend on the order of the rows beyond
  the summation order.

  Cost: ``k + 2`` calls of ``fn`` (the whole batch, the permuted whole batch,
  each micro-batch), one trace of it and one call of ``microbatched(fn, k)``,
  eagerly (``fn`` as given: pass it jitted to compile it once per shape);
  then a least-squares solve of size (gradient entries) x ``k`` on the host.
  Run it on one batch, in a test or a notebook, for every ``k`` you train
  with.

  A loss with a PRNG key (dropout) draws other masks on the whole batch and on
  each micro-batch, which no accumulation can match: a key among the
  arguments that are not batches (a typed key array, or a raw ``uint32[2]``)
  is refused; call the check with a deterministic loss. Per-example keys
  inside a batch argument are split with it and fine.

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
    ValueError: (when called) for a batch ``k`` does not divide, or a PRNG key
      among the other arguments.
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
  accumulated = microbatching.microbatched(  # checks the options
      fn, num_microbatches, batch_argnums=batch_argnums, has_aux=has_aux, normalize=normalize)
  k = int(num_microbatches)
  nums = _validation.check_argnums(batch_argnums, "batch_argnums")

  def check(*args: Any, **kwargs: Any) -> LargeBatchReport:
    b_nums = sorted(set(_validation.resolve_argnums(nums, len(args), "batch_argnums")))
    _refuse_keys(args, kwargs, b_nums)
    splits = {i: microbatching.split_microbatches(args[i], k) for i in b_nums}  # checks k

    def call(rows: dict[int, Any]) -> tuple[np.ndarray, float | None]:
      out = fn(*[rows.get(i, a) for i, a in enumerate(args)], **kwargs)
      return _mean_grad(out, has_aux, normalize)

    size = jax.tree.leaves(args[b_nums[0]])[0].shape[0]
    order = np.random.default_rng(0).permutation(size)
    big_g, _ = call({})
    perm_g, _ = call({i: jax.tree.map(lambda x: jnp.asarray(x)[order], args[i]) for i in b_nums})
    micro = [call({i: jax.tree.map(lambda x, j=j: x[j], splits[i]) for i in b_nums})
             for j in range(k)]
    gs = np.stack([g for g, _ in micro], axis=1)  # [entries, k]
    # c: how microbatched combines the micro-batch gradients.
    if normalize == "weighted":
      dens = np.array([den for _, den in micro])
      c = dens / dens.sum() if dens.sum() else np.zeros(k)
    else:
      c = np.full(k, 1.0 / k if normalize == "mean" else 1.0)
    acc = accumulated(*args, **kwargs)[1]
    return _explain(k, normalize, big_g, perm_g, gs, c, acc, _largest_eps(fn, args, kwargs))

  return check


def _refuse_keys(args: tuple[Any, ...], kwargs: dict[str, Any], b_nums: list[int]) -> None:
  """Raises if a PRNG key is among the arguments that are not batches."""
  named = [(f"argument {i}", a) for i, a in enumerate(args) if i not in b_nums]
  named += [(f"keyword `{n}`", a) for n, a in kwargs.items()]
  for where, tree in named:
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
      if not hasattr(x, "dtype"):
        continue
      typed = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
      if typed or (x.dtype == np.uint32 and np.shape(x) == (2,)):
        raise ValueError(
            f"{where}{jax.tree_util.keystr(path)} is a PRNG key"
            f" ({'a typed key' if typed else 'a raw uint32[2] key'}): a loss with a key"
            " (dropout) draws other random numbers on the whole batch and on each"
            " micro-batch, so no accumulation can match it and the check would report"
            " coupling. Check a deterministic call (dropout off, e.g."
            " `deterministic=True`), then train with `microbatched(..., rng_argnums=...)`.")


def _mean_grad(out: Any, has_aux: bool, normalize: str) -> tuple[np.ndarray, float | None]:
  """``fn``'s output to its gradient vector and ``"weighted"``'s denominator (else None).

  For ``"weighted"`` the gradient is over the denominator: the gradient of the mean.
  """
  value, den, _, grads = _batch.unpack(out, normalize, has_aux)
  den = None if den is None else float(den)
  if jnp.ndim(value) != 0:
    raise TypeError(
        f"`fn`'s value must be a scalar loss; got shape {jnp.shape(value)}. Pass"
        " `jax.value_and_grad(loss_fn)` of a scalar loss_fn (has_aux=True for (loss, aux)).")
  g = np.asarray(ravel_pytree(grads)[0], np.float64)
  if den is not None:
    g = g / den if den else np.zeros_like(g)
  return g, den


def _largest_eps(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
  """The largest machine epsilon of the float dtypes in ``fn``'s program (its coarsest rounding)."""
  dtypes = set()

  def walk(jaxpr: jax_core.Jaxpr) -> None:
    eqn_outs = [v for eqn in jaxpr.eqns for v in eqn.outvars]
    for var in (*jaxpr.invars, *jaxpr.outvars, *eqn_outs):
      dtypes.add(getattr(var.aval, "dtype", None))  # a token has none
    for sub in jax_core.subjaxprs(jaxpr):  # jit, cond branches, scan bodies
      walk(sub)

  walk(jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args).jaxpr)
  floats = [d for d in dtypes if d is not None and jnp.issubdtype(d, jnp.inexact)]
  return max((float(jnp.finfo(d).eps) for d in floats), default=float(jnp.finfo(jnp.float32).eps))


def _explain(k: int, normalize: str, big_g: np.ndarray, perm_g: np.ndarray, gs: np.ndarray,
             c: np.ndarray, acc: Any, eps: float) -> LargeBatchReport:
  """The report: error, measured tolerance, and the combination of micro-batches that fits.

  ``big_g``: the whole batch's gradient, ``perm_g`` on its rows permuted; ``gs``: the
  micro-batches' ``[entries, k]``; ``c``: microbatched's weights; ``acc``: its gradient tree.
  """
  leaves = jax.tree_util.tree_flatten_with_path(acc)[0]
  leaf_of = np.repeat(np.arange(len(leaves)), [np.size(x) for _, x in leaves])  # per entry
  a = np.asarray(ravel_pytree(acc)[0], np.float64)
  norm = np.linalg.norm(big_g) or np.linalg.norm(a) or 1.0

  def leaf_errors(v: np.ndarray) -> np.ndarray:  # each leaf's norm of v, over |G|
    return np.sqrt(np.bincount(leaf_of, v * v, minlength=len(leaves))) / norm

  def rel(v: np.ndarray) -> float:
    return float(leaf_errors(v).max(initial=0.0))

  measured = max(rel(big_g - perm_g), rel(a - gs @ c))
  one_rounding = eps * (np.linalg.norm(big_g) + np.abs(c) @ np.linalg.norm(gs, axis=0)) / norm
  tolerance = 2 * max(measured, float(one_rounding))
  errors = leaf_errors(a - big_g)
  max_error = float(errors.max(initial=0.0))
  table = tuple(LeafError(jax.tree_util.keystr(path), tuple(np.shape(x)), float(e))
                for (path, x), e in zip(leaves, errors, strict=True))

  def report(cause: str, weights: np.ndarray | None, fix: str) -> LargeBatchReport:
    w = None if weights is None else tuple(float(x) for x in weights)
    return LargeBatchReport(cause == "equal", cause, max_error, tolerance, w, fix, table, k)

  if max_error <= tolerance:
    return report("equal", None, "Nothing to fix: accumulating these micro-batches gives the"
                  " whole batch's gradient, up to rounding.")
  combined = gs @ c
  scale = float(combined @ big_g / (combined @ combined)) if combined @ combined else 0.0
  if rel(scale * combined - big_g) <= tolerance and c.sum():
    return report("scale", c / c.sum(), _scale_fix(k, normalize, scale))
  if gs.shape[0] <= k:  # k vectors of that few entries combine into any gradient
    raise ValueError(
        f"check_large_batch: the accumulated gradient is not the whole batch's (max relative"
        f" error {max_error:.3g} > tolerance {tolerance:.3g}), but with {gs.shape[0]} gradient"
        f" entries for num_microbatches={k} unequal weights cannot be told from coupling."
        f" Check with num_microbatches < {gs.shape[0]}, or on a model with more parameters.")
  w = np.linalg.lstsq(gs, big_g, rcond=None)[0]
  if rel(gs @ w - big_g) <= tolerance and w.sum():
    fix = _WEIGHTED_FIX if normalize == "weighted" else _WEIGHTS_FIX
    return report("weights", w / w.sum(), fix)
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
