"""Statistics of the whole batch that a loss needs: summed over every micro-batch and device.

A loss may need a statistic of the whole batch rather than of the rows it is
given: the share of the tokens each expert of a mixture-of-experts layer
receives (its load-balancing loss), the number of real tokens that divides a
token-weighted loss. Such a statistic is a sum over the rows, so the whole
batch's is the sum of the micro-batches' (and the devices'). In one step,
``microbatched(fn, k, global_stats=stats_fn)`` computes it in a pass of its
own before the gradient pass (:func:`summable` checks ``stats_fn`` and pools a
statistic kept per row); across steps, ``accumulate(k, opt, global_stats=like)``
carries the open window's running sum and the last window's total
(:class:`GlobalStats`, :func:`init`, :func:`advance`).

A statistic is computed in the forward and returned, never kept in a mutable
counter: ``jax.checkpoint`` recomputes a forward, and a recomputation returns
the same values; it has nothing to advance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal

from optax_accum import _arrays, _batch


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


def check_summable(tree: Any, where: str) -> None:
  """Raises unless every leaf of ``tree`` is an array (or shape) of numbers: what a sum adds."""
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.number):
      what = f"an array of {dtype}" if dtype is not None else f"a {type(x).__name__}"
      raise TypeError(
          f"{where} at {jax.tree_util.keystr(path) or 'its root'} is {what}, which cannot be"
          " summed over micro-batches and devices: return arrays of numbers (counts as ints).")


def check_fn(stats_fn: Any) -> Callable[..., Any] | None:
  """``microbatched``'s ``global_stats``: None or a function, else raises."""
  if stats_fn is not None and not callable(stats_fn):
    raise TypeError(f"`global_stats` must be None or a function `stats_fn(params, *args)`"
                    f" returning a micro-batch's statistics; got {stats_fn!r}.")
  return stats_fn


def summable(stats_fn: Callable[..., Any], args: Sequence[Any], positions: tuple[int, ...],
             rows: int) -> Callable[..., Any]:
  """``microbatched``'s ``stats_fn``, checked on a micro-batch of ``rows`` rows.

  Raises for a leaf that is not an array of numbers, or that changes with the
  params. A leaf whose shape follows the rows (it is traced on ``rows`` and on
  ``2 * rows``) is a statistic per row: the function returned pools it, summed
  over the axis that holds the rows.
  """
  def checked(*a: Any) -> Any:
    out = stats_fn(*a)
    check_summable(out, "The statistics `global_stats` returns")
    return out

  small, large = (_batch.at_rows(checked, args, positions, r) for r in (rows, 2 * rows))
  found, treedef = jax.tree_util.tree_flatten_with_path(small)
  where = [jax.tree_util.keystr(p) or "its root" for p, _ in found]
  axes = [_rows_axis(a, b, rows, w) for (_, a), b, w in
          zip(found, jax.tree.leaves(large), where, strict=True)]
  _check_no_gradient(checked, args, positions, rows, where)
  if all(axis is None for axis in axes):
    return stats_fn

  def pooled(*a: Any) -> Any:
    leaves = treedef.flatten_up_to(stats_fn(*a))
    return treedef.unflatten([x if axis is None else jnp.sum(x, axis)
                              for x, axis in zip(leaves, axes, strict=True)])
  return pooled


def _rows_axis(a: Any, b: Any, rows: int, where: str) -> int | None:
  """The axis of a statistic that holds the rows (``a`` on ``rows``, ``b`` on twice as many)."""
  if a.shape == b.shape:
    return None
  grown = [i for i, (m, n) in enumerate(zip(a.shape, b.shape, strict=False)) if m != n]
  if len(a.shape) == len(b.shape) and len(grown) == 1 and (
      a.shape[grown[0]], b.shape[grown[0]]) == (rows, 2 * rows):
    return grown[0]
  raise ValueError(
      f"`global_stats`'s statistic at {where} has shape {a.shape} on {rows} rows and {b.shape}"
      f" on {2 * rows}: no one axis holds the rows, to pool it over. Sum it over the rows.")


def _check_no_gradient(stats_fn: Callable[..., Any], args: Sequence[Any],
                       positions: tuple[int, ...], rows: int, where: list[str]) -> None:
  """Raises for a statistic with a gradient: its first-order change with the params.

  Read from the jaxpr of ``stats_fn``'s JVP: an output that the tangents of
  the params reach (a counted choice, an integer, or ``stop_gradient``, do not).
  """
  floats = [x for x in jax.tree.leaves(args[_batch.PARAMS]) if isinstance(
      x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.inexact)]
  if not floats:
    return

  def tangents(*a: Any) -> Any:
    *a, t = a
    leaves, treedef = jax.tree.flatten(a[_batch.PARAMS])
    at = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and jnp.issubdtype(
        x.dtype, jnp.inexact)]

    def of_floats(*values: Any) -> Any:
      new = dict(zip(at, values, strict=True))
      return stats_fn(treedef.unflatten([new.get(i, x) for i, x in enumerate(leaves)]), *a[1:])
    return jax.jvp(of_floats, tuple(leaves[i] for i in at), tuple(t))[1]

  jaxpr = _batch.at_rows(tangents, (*args, floats), positions, rows, jaxpr=True).jaxpr
  reached = set(jaxpr.invars[len(jaxpr.invars) - len(floats):])
  for eqn in jaxpr.eqns:
    if any(not isinstance(v, Literal) and v in reached for v in eqn.invars):
      reached.update(eqn.outvars)
  for w, v in zip(where, jaxpr.outvars, strict=True):
    if not isinstance(v, Literal) and v in reached:
      raise ValueError(
          f"`global_stats`'s statistic at {w} has a gradient, which the gradient pass (the"
          " statistics are constants) would drop. Compute a differentiable term (the mean router"
          " probability) in the loss from its rows, counts in the statistics; or wrap it in"
          " `jax.lax.stop_gradient` to take it as a constant on purpose.")


# ------------------------------------------------------- across steps: accumulate
def check_like(like: Any) -> Any:
  """``accumulate``'s ``global_stats``: None, or the statistics' shapes, summed in what dtypes."""
  if like is None:
    return None
  check_summable(like, "`global_stats`")
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), _arrays.accumulator_dtype(
      jnp.result_type(x))), like)


def init(like: Any) -> GlobalStats | tuple[()]:
  """Zero statistics shaped like ``like`` (``()`` without them)."""
  if like is None:
    return ()
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), like)
  return GlobalStats(zeros, zeros)


def advance(state: Any, stats: Any, like: Any, accept: Any, mini_steps: tuple[Any, Any],
            axis_name: Any) -> Any:
  """The statistics after one micro-step of ``accumulate``.

  ``stats`` (this micro-batch's, if it counts: ``accept``) is added to the
  running sum; when the window closed (``mini_steps``: its ``mini_step``
  before and after), the sum over ``axis_name`` (manual axes: one ``psum``,
  in the closing branch) becomes ``last`` and the running sum restarts.
  """
  if stats is None and accept is False:  # a flush carries no micro-batch
    stats = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), like)
  if like is None or jax.tree.map(jnp.shape, stats) != jax.tree.map(lambda s: s.shape, like):
    if like is None and stats is None:
      return state
    raise ValueError(
        f"`update(..., stats=...)` got shapes {jax.tree.map(jnp.shape, stats)}, but"
        f" `accumulate(..., global_stats=...)` declared {like and jax.tree.map(jnp.shape, like)}.")
  check_summable(stats, "`stats`")
  before, after = mini_steps
  closed = jnp.logical_and(after == 0, jnp.logical_or(before > 0, accept))
  running = jax.tree.map(lambda r, s: r + jnp.where(accept, s, 0).astype(r.dtype),
                         state.running, stats)
  total = (lambda r: r) if axis_name is None else (lambda r: lax.psum(r, axis_name))
  last = lax.cond(closed, total, lambda r: state.last, running)
  return GlobalStats(jax.tree.map(lambda r: jnp.where(closed, jnp.zeros([], r.dtype), r),
                                  running), last)
