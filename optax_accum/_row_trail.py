"""Where each value of a loss's trace comes from (``debug.check_large_batch``).

One walk of the trace on the whole batch, equation by equation beside the trace on a
micro-batch: each value carries the inputs it comes from (a batch argument, another
argument, a captured constant) and whether it is a statistic of the batch (a value of
the batch whose shape does not follow its rows). It refuses random numbers drawn per
row from a key no batch argument feeds, and records the selections by the batch's
values and the roundings on a statistic of the batch that the verdict's fix names.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.extend import core as jax_core
from jax.extend import source_info_util

from optax_accum import _float64, _jaxpr

_RANDOM = ("random_bits", "threefry2x32", "rng_bit_generator", "rng_uniform")
_BATCH, _CAPTURED = "a batch argument", "captured"
_STAT = "a statistic of the batch"  # of the batch, and its shape does not follow the rows
_SELECT = {"top_k": "axis", "sort": "dimension", "argmax": "axes", "argmin": "axes",
           "reduce_max": "axes", "reduce_min": "axes"}  # pick among the rows on these axes


class Trail:
  """What a walk of one trace found, beside the trace of a micro-batch (``other``).

  The two traces hold the same equations in the same order (checked: ``aligned``), and
  a value's shape tells whether it follows the rows: a value of the batch whose shape
  does not is a statistic of the batch (labelled ``_STAT``). Compared with ``other``, it
  raises at random numbers drawn per row (their shape differs from the micro-batch's, or
  a loop over the rows or a ``while`` draws them) from a key no batch argument feeds, and
  records each selection among the rows or by a statistic of the batch (``cond``,
  ``select_n``, ``_SELECT``) and each rounding (``round``, a cast to an 8-bit float: fp8)
  of a value that a statistic of the batch scales. Without ``other`` (the
  micro-batch itself, ``microbatched``) it only records the shapes.
  """

  def __init__(self, other: Trail | None = None) -> None:
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
    # A cast to fp8 rounds; one to an integer or a bool (a count, a guard) is exact there.
    narrow = name == "convert_element_type" and np.dtype(p["new_dtype"]).itemsize == 1 and (
        jax.numpy.issubdtype(p["new_dtype"], jax.numpy.floating))
    if name == "reduce_precision" and _float64.narrow(p):
      narrow, p = True, {"new_dtype": f"e{p['exponent_bits']}m{p['mantissa_bits']} (fp8)"}
    if _STAT in first and (name == "round" or narrow):  # summed: the value is a statistic
      summed = theirs is not None and theirs[1][0] == mine[1][0]  # (a weight's gradient)
      self.roundings.append((summed, f"`{name}` to {p.get('new_dtype', 'integers')} at {where}"))
    return theirs


def source(path: Any, b_nums: tuple[int, ...]) -> str:
  """The label of an input leaf: a batch argument, or where a user finds it."""
  where, *rest = path
  at = jax.tree_util.keystr(tuple(rest[1:]))
  if where.idx == 0:  # positional
    i = rest[0].idx
    return _BATCH if i in b_nums else f"argument {i}{at}"
  return f"keyword `{rest[0].key}`{at}"


def walk(jaxpr: jax_core.Jaxpr, labels: list[frozenset], trail: Trail) -> list[frozenset]:
  """Propagates the input labels through ``jaxpr``; returns its outputs' labels.

  Each variable carries the inputs it comes from (a batch argument, another argument, a
  captured constant; none for a constant made inside), and ``_STAT`` for a statistic of
  the batch; ``trail`` records what the check needs of each equation.
  """
  return _jaxpr.interpret(_LABELS, jaxpr, [frozenset({_CAPTURED})] * len(jaxpr.constvars),
                          labels, trail)


def _labels(trail: Trail, eqn: Any, ins: list[frozenset]) -> list[frozenset]:
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
  outs = _jaxpr.descend(eqn, ins, lambda j, a: walk(j, a, trail),
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
