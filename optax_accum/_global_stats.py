"""Statistics of the whole batch that a loss needs: summed over every micro-batch and device.

A loss may need a statistic of the whole batch rather than of the rows it is
given: the share of the tokens each expert of a mixture-of-experts layer
receives (its load-balancing loss), the number of real tokens that divides a
token-weighted loss. Such a statistic is a sum over the rows, so the whole
batch's is the sum of the micro-batches' (and the devices'). In one step,
``microbatched(fn, k, global_stats=stats_fn)`` computes it in a pass of its
own before the gradient pass: :func:`summable` checks ``stats_fn`` (traced
once per row count it compares) and pools a statistic kept per row, and
``microbatching`` sums it, evaluating that trace. Across
steps, ``accumulate(k, opt, global_stats=like)`` carries the open window's
running sum and the last window's total (:class:`GlobalStats`, :func:`init`,
:func:`advance`, told by the window when it closes).

A statistic is computed in the forward and returned, never kept in a mutable
counter: ``jax.checkpoint`` recomputes a forward, and a recomputation returns
the same values; it has nothing to advance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jax_core

from optax_accum import _arrays, _batch, _row_trail


class GlobalStats(NamedTuple):
  """The statistics of ``accumulate(k, opt, global_stats=like)``: ``AccumulateState.global_stats``.

  Attributes:
    running: the sum over the open window's micro-batches so far (this
      device's, under ``shard_map``/``pmap``): the causal buffer. It restarts
      at zero when the window closes.
    last: the last closed window's total over every micro-batch and device:
      the lagged statistics (zeros until the first window closes).
  """

  running: Any
  last: Any


def check_summable(tree: Any, where: str) -> Any:
  """``tree``, if every leaf is an array (or shape) of numbers (what a sum adds), else raises."""
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.number):
      what = f"an array of {dtype}" if dtype is not None else f"a {type(x).__name__}"
      raise TypeError(
          f"{where} at {jax.tree_util.keystr(path) or 'its root'} is {what}, which cannot be"
          " summed over micro-batches and devices: return arrays of numbers (counts as ints).")
  return tree


def summable(stats_fn: Callable[..., Any], args: Sequence[Any], avals: Sequence[Any],
             positions: tuple[int, ...], rows: int, whole: int,
             ) -> tuple[Callable[..., Any], Callable[[Sequence[Any]], Any]]:
  """``microbatched``'s ``stats_fn``, checked on a micro-batch of ``rows`` rows beside the whole
  batch of ``whole`` (the two sizes whose Python logic, ``x[:8]``, must agree; at least twice).

  ``avals``: the types of the array leaves of ``args`` on a micro-batch of
  ``rows`` rows (``_batch.shapes_at``'s, or a micro-batch's in the loop's own
  context); those at ``positions`` get the whole batch's rows for the second
  jaxpr. The two jaxprs (read together by ``_row_trail.walk``) give the shapes
  and the checks. Raises for a leaf that is not an array of numbers; that is not
  linear in the rows (a max or a mean over them, a ratio of sums: its sum over
  the micro-batches is not the whole batch's); or that has a gradient: a
  float that a float param reaches through floats (a counted choice, an
  integer, or ``stop_gradient``, do not).

  Returns ``stats_fn`` on any rows, and ``on``: the statistics of the
  micro-batch whose array leaves are given, the first jaxpr evaluated
  (``stats_fn`` is not traced again). In both a statistic kept per row (a
  leaf whose shape follows the rows) is pooled, summed over the axis that
  holds the rows.
  """
  def checked(*a: Any) -> Any:
    return check_summable(stats_fn(*a), "The statistics `global_stats` returns")

  leaves, times = _arrays.ArrayLeaves.of(tuple(args)), max(whole // rows, 2)
  grown = jax.eval_shape(lambda xs: [jnp.tile(x, (times,) + (1,) * (x.ndim - 1)) if (
      p[0].idx in positions) else x for x, p in zip(xs, leaves.paths, strict=True)], avals)
  (small, shapes), (large, large_shapes) = (jax.make_jaxpr(
      lambda *v: checked(*leaves.rebuild(v)), return_shape=True)(*a) for a in (avals, grown))
  if jax.tree.structure(shapes) != jax.tree.structure(large_shapes):
    raise ValueError(
        f"`global_stats` returns {jax.tree.structure(shapes)} on a micro-batch but"
        f" {jax.tree.structure(large_shapes)} on the whole batch: return one structure.")
  flows = _row_trail.walk(large.jaxpr, small.jaxpr, [_row_trail.Flow(
      "", None, p[0].idx == _batch.PARAMS and jnp.issubdtype(x.dtype, jnp.inexact),
      not jnp.issubdtype(x.dtype, jnp.inexact))
      for p, x in zip(leaves.paths, leaves.arrays, strict=True)], (times * rows, rows), consts=[
          _row_trail.count(c, d, times) or _row_trail.NONE
          for c, d in zip(large.consts, small.consts, strict=True)])
  found, treedef = jax.tree_util.tree_flatten_with_path(shapes)
  axes = []
  for (path, a), b, flow in zip(found, jax.tree.leaves(large_shapes), flows, strict=True):
    where = jax.tree_util.keystr(path) or "its root"
    axis = _row_trail.grown_axis(a.shape, b.shape)
    why = flow.why or ("of a rank that changes with the rows' count" if len(a.shape) != len(
        b.shape) else None if flow.rows or axis is not None else "of no rows (a constant, or"
                       " the params'), which each micro-batch would add again")
    if why:
      raise ValueError(
          f"`global_stats` is not a sum over rows: its statistic at {where} is {why}."
          " Return sums and counts, divide in the loss.")
    if flow.grad:
      raise ValueError(
          f"`global_stats`'s statistic at {where} has a gradient, which the gradient pass (the"
          " statistics are constants) would drop. Compute a differentiable term (the router"
          " probabilities) in the loss from its rows, counts in the statistics; or wrap it in"
          " `jax.lax.stop_gradient` to take it as a constant on purpose.")
    axes.append(axis)

  def pool(out: Any) -> Any:
    return treedef.unflatten([x if axis is None else jnp.sum(x, axis)
                              for x, axis in zip(treedef.flatten_up_to(out), axes, strict=True)])
  run = jax_core.jaxpr_as_fun(small)
  return lambda *a: pool(stats_fn(*a)), lambda arrays: pool(treedef.unflatten(run(*arrays)))


# ------------------------------------------------------- across steps: accumulate
def check_like(like: Any) -> Any:
  """``accumulate``'s ``global_stats``: None, or the statistics' shapes, summed in what dtypes."""
  if like is None:
    return None
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), _arrays.sum_dtype(
      jnp.result_type(x))), check_summable(like, "`global_stats`"))


def init(like: Any) -> GlobalStats | tuple[()]:
  """Zero statistics shaped like ``like`` (``()`` without them)."""
  if like is None:
    return ()
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), like)
  return GlobalStats(zeros, zeros)


def advance(state: Any, stats: Any, like: Any, accept: Any, closes: Any, axis_name: Any) -> Any:
  """The statistics after one micro-step of ``accumulate``.

  ``stats`` (this micro-batch's, if it counts: ``accept``) is added to the
  running sum; when the window closes (``closes``: the window's decision,
  ``_window.StepOut.closes``), the sum over ``axis_name`` (manual axes: one
  ``psum``, in the closing branch) becomes ``last`` and the running sum restarts.
  """
  if stats is None and accept is False:  # a flush carries no micro-batch
    stats = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), like)
  if like is None or jax.tree.map(jnp.shape, stats) != jax.tree.map(lambda s: s.shape, like):
    if like is None and stats is None:
      return state
    raise ValueError(
        f"`update(..., stats=...)` got shapes {jax.tree.map(jnp.shape, stats)}, but"
        f" `accumulate(..., global_stats=...)` declared {like and jax.tree.map(jnp.shape, like)}.")
  stats = check_summable(stats, "`stats`")
  for (path, s), r in zip(jax.tree_util.tree_flatten_with_path(stats)[0], jax.tree.leaves(like),
                          strict=True):
    if _arrays.promote_types(jnp.result_type(s), r.dtype) != r.dtype:
      raise TypeError(
          f"`update(..., stats=...)` at {jax.tree_util.keystr(path) or 'its root'} is"
          f" {jnp.result_type(s)}, but `accumulate(..., global_stats=...)` sums it in {r.dtype},"
          " which would lose part of it (a float added to an int truncates). Declare that leaf"
          f" {jnp.result_type(s)}: `jax.ShapeDtypeStruct({r.shape}, jnp.{jnp.result_type(s)})`.")
  running = jax.tree.map(lambda r, s: r + jnp.where(accept, s, 0).astype(r.dtype),
                         state.running, stats)
  total = (lambda r: r) if axis_name is None else (lambda r: lax.psum(r, axis_name))
  last = lax.cond(closes, total, lambda r: state.last, running)
  return GlobalStats(jax.tree.map(lambda r: jnp.where(closes, jnp.zeros([], r.dtype), r),
                                  running), last)
