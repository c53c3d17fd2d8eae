"""Which values of a trace follow the batch's rows: the one analysis of the rows.

A function of the batch is traced twice, on more rows (``large``: the whole
batch) and on fewer (``small``: a micro-batch, or half as many), and one walk
reads the two equation beside equation (``_jaxpr.twins``), into calls,
``scan``, ``cond`` and ``while`` (``_jaxpr.inner``): a value follows the rows
where its shapes differ. Each value's :class:`Flow` says whether it is linear
in the rows and why not (``microbatched``'s ``global_stats`` must be), and
whether a param's gradient reaches it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_core

from optax_accum import _jaxpr

_ROUNDED = ("floor", "ceil", "round", "sign")  # whole numbers
_CONSTANT = ("stop_gradient", *_ROUNDED)  # no gradient flows through
_MAXIMA = {"reduce_max": "a max", "reduce_min": "a min", "argmax": "an argmax",
           "argmin": "an argmin"}
_SUMS = ("reduce_sum", "dot_general", "scatter-add", "scatter_add")  # a sum over what they reduce
# Linear in each operand that is a sum over the rows (a product or a ratio: in one of them).
_LINEAR = frozenset("""neg convert_element_type reshape broadcast_in_dim transpose squeeze
  expand_dims slice dynamic_slice concatenate stack split pad reduce_sum copy copy_p select_n
  gather sharding_constraint reshard mesh_cast stop_gradient real imag conj
  cumsum""".split())
_SHAPED = ("broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "copy", "copy_p",
           "convert_element_type")  # the same values, laid out anew
_EXACT = _LINEAR | {"add", "sub", "mul", "add_any", "max", "min", "abs", "dot_general"}  # of wholes
_WRITES = {**dict.fromkeys("scatter scatter-add scatter-sub scatter-mul scatter-min scatter-max"
                           .split(), 2), "dynamic_update_slice": 1}  # their values
_ALONG = {"sort": "dimension", "cumsum": "axis", "cumprod": "axis", "cummax": "axis",
          "cummin": "axis", "cumlogsumexp": "axis", "rev": "dimensions", "top_k": "axis",
          "concatenate": "dimension", "split": "axis"}  # along the rows, they mix them
# What keeps each row's entries its own (_ALONG: where the rows' axis is not the one named).
_ROWWISE = frozenset("""abs acos acosh add add_any and asin asinh atan atan2 atanh bessel_i0e
  bessel_i1e cbrt ceil clamp clz complex conj convert_element_type copy copy_p cos cosh digamma
  div eq eq_to erf erf_inv erfc exp exp2 expm1 floor fma fmuladd ge gt igamma igamma_grad_a
  igammac imag integer_pow is_finite le le_to lgamma log log1p log2 logistic lt lt_to max min mul
  mulhi ne neg nextafter not one_minus_square or polygamma population_count pow real ldexp
  searchsorted reduce_precision regularized_incomplete_beta rem round rsqrt select_n shift_left
  shift_right_arithmetic shift_right_logical sign sin sinh sqrt square stop_gradient sub tan tanh
  xor zeta zeros_like bitcast_convert_type optimization_barrier sharding_constraint reshard
  mesh_cast pvary pbroadcast device_put layout_constraint relayout name squeeze expand_dims
  broadcast_in_dim transpose reshape dot_general reduce_sum reduce_max reduce_min reduce_prod
  reduce_and reduce_or reduce_xor argmax argmin slice dynamic_slice pad gather iota
  """.split()) | set(_WRITES) | set(_ALONG)


class Flow(NamedTuple):
  """What :func:`walk` knows of a value."""

  rows: str  # "": of no rows (the params, a constant); "rows": follows them; "sum": a sum over them
  why: str | None  # what makes it no sum over the rows: a max over them, a ratio of sums
  grad: bool  # a float that a float param reaches through floats
  whole: bool = False  # whole numbers (of integers, bools, rounding): a cast to int is exact
  zero: bool = False  # zeros (a literal 0, `jnp.zeros`): a sum over no rows


NONE = Flow("", None, False)  # a constant's


class _Walk(NamedTuple):
  twins: Iterator[Any]  # the equations of `small`, one beside each of `large`'s (or None)
  rows: tuple[int, int]  # the batch's rows in large and in small
  in_loop: bool  # inside a loop whose trip count may follow the rows: its draws are per row
  blind: str | None  # why a value of the batch computed without a twin is no sum over the rows


def walk(large: jax_core.Jaxpr, small: jax_core.Jaxpr | None, flows: list[Flow],
         rows: tuple[int, int], *, consts: list[Flow] | None = None,
         in_loop: bool = False, blind: str | None = None) -> list[Flow]:
  """The flows of ``large``'s outputs from its inputs' (and its constants', ``consts``: else
  of no rows); ``small`` is the same program on fewer rows (``rows``: the batch's in each), or
  None: nothing follows the rows.

  A statistic must be linear in the rows: a sum over them (a ``reduce_sum``, a
  ``dot_general`` or a scatter-add over the rows: a count, a histogram) of values
  computed row by row (each row from that row alone: elementwise, or shaped so that
  each row keeps its own entries), and of such sums only what is linear in them (a
  sum of sums, a cast, a product with a constant). Anything else made of a sum (a
  ratio, a reciprocal, a ``sqrt``, a choice by it), a max, a sort or a pairing of the
  rows, a number that the rows' count scales (a mean's divisor or power) or a
  constant laid along the rows other than evenly (an ``arange``, a write to fixed
  rows) carries its ``why``. Where the two jaxprs differ in their equations (a
  Python loop over the rows) or a ``scan`` runs over the rows, ``large`` is read
  alone, and each value computed there carries ``blind``.
  """
  if small is not None and not _jaxpr.aligned(large, small):
    blind = blind or ("computed by steps that change with the number of rows (a Python loop"
                      " over them, unread: write it with array operations, `jax.vmap` per row)")
  outs = _jaxpr.interpret(_RULES, large, [NONE] * len(large.constvars) if consts is None else
                          consts, flows, _Walk(_jaxpr.twins(large, small), rows, in_loop, blind))
  if small is None:
    return outs
  return [count(v.val, w.val, rows[0] // rows[1]) or f if isinstance(v, jax_core.Literal) and (
      isinstance(w, jax_core.Literal)) else f  # (an output that is the rows' count itself)
          for f, v, w in zip(outs, large.outvars, small.outvars, strict=True)]


def count(big: Any, small: Any, ratio: int) -> Flow | None:
  """The flow of a number the rows' count scales (a literal or a constant that differs between
  the traces): a count where it is ``ratio`` times the smaller, else a function of it (a mean's
  divisor); None where the two are equal (a value traced outside, the one both traces captured)."""
  if isinstance(big, jax.core.Tracer) or isinstance(small, jax.core.Tracer):
    return None if big is small else Flow("", "a traced value that differs between the traces",
                                          False)
  if np.array_equal(big, small, equal_nan=True):
    return None
  if np.array_equal(big, ratio * np.asarray(small)):
    return Flow("sum", None, False, True)
  return Flow("", "a mean over the rows", False)


def _join(flows: Sequence[Flow]) -> Flow:
  return Flow(max((f.rows for f in flows), default=""), next((f.why for f in flows if f.why), None),
              any(f.grad for f in flows), all(f.whole for f in flows), all(f.zero for f in flows))


def _either(flows: Sequence[Flow]) -> Flow:
  """One value of several that a ``cond`` (its branches) or a ``while`` (its carry and body)
  chooses among: no sum over the rows where one of them is a sum and another a constant."""
  joined = _join(flows)
  if joined.rows == "sum" and any(not f.rows for f in flows):
    return joined._replace(why=joined.why or "a sum over the rows or a constant, as a `cond` or"
                           " a loop chooses")
  return joined


def _operands(ctx: _Walk, a: Any, b: Any, ins: list[Flow]) -> tuple[list[Flow], list[bool]]:
  """``ins``, a number the rows' count scales made a count (:func:`count`) and a value whose
  shape differs from its twin's following the rows; and which operands are such numbers."""
  counts = [count(v.val, w.val, ctx.rows[0] // ctx.rows[1]) if isinstance(
      v, jax_core.Literal) else None for v, w in zip(b.invars, a.invars, strict=True)]
  return [c if c else f._replace(rows="rows") if not isinstance(
      v, jax_core.Literal) and v.aval.shape != w.aval.shape else f  # (a batch argument's leaf)
          for f, c, v, w in zip(ins, counts, b.invars, a.invars, strict=True)], [
              c is not None for c in counts]


def _nested(ctx: _Walk, b: Any, ins: list[Flow]) -> list[Flow]:
  """A call, ``scan``, ``shard_map``, ``cond`` or ``while``: its jaxprs walked with their twins."""
  a, name, blind = next(ctx.twins), b.primitive.name, ctx.blind
  over_rows = a is not None and a.params.get("length") != b.params.get("length")
  if over_rows:
    a, blind = None, blind or ("computed in a loop over the rows (`scan`, `fori_loop`,"
                               " `lax.map`: unread; write it with `jax.vmap` per row)")
  if a is not None:
    ins = _operands(ctx, a, b, ins)[0]
  in_loop = ctx.in_loop or name == "while" or (name == "scan" and a is None)

  walked: list[list[Flow]] = []  # each jaxpr's outputs (a `while`'s condition's first)

  def inside(ins: list[Flow]) -> list[Flow]:
    others = iter(_jaxpr.inner(a)) if a is not None else itertools.repeat(None)
    return _jaxpr.descend(b, ins, lambda j, x: walked.append(walk(
        j, next(others), x, ctx.rows, in_loop=in_loop, blind=blind)) or walked[-1], _either)

  outs = inside(ins)
  if _jaxpr.differentiated_by_rule(b):  # (a straight-through rounding): floats are reached
    grad = any(f.grad for f in ins)
    outs = [o._replace(grad=o.grad or (grad and jnp.issubdtype(v.aval.dtype, jnp.inexact)))
            for o, v in zip(outs, b.outvars, strict=True)]
  c, n = _jaxpr.scan_carry(b) if name == "scan" else (0, 0)  # its body was walked once
  carry = ins[c:c + n]
  if any(o.rows != f.rows for o, f in zip(outs[:n], carry, strict=True)) and all(
      f.zero or o.rows == f.rows for o, f in zip(outs[:n], carry, strict=True)):
    carry = [_join([o, f]) for o, f in zip(outs[:n], carry, strict=True)]  # zeros made sums:
    outs = inside(ins[:c] + carry + ins[c + n:])  # the body again, on sums
  if any(o.rows != f.rows for o, f in zip(outs[:n], carry, strict=True)):
    outs = [o._replace(why=o.why or "a loop's carry made a sum, or a sum made a constant: the"
                       " next step gets what no step before it did") for o in outs]
  if over_rows:  # each result, one its body computed or one it passes on (a carry as `ys`)
    outs = [o._replace(why=o.why or blind) for o in outs]
  chooser = {"cond": ins[0], "while": walked[0][0]}.get(name, NONE)  # (a `while`: how long)
  if chooser.rows or chooser.why:  # chosen by the batch
    outs = [o._replace(why=o.why or chooser.why or f"a choice (`{name}`) by the batch's values")
            for o in outs]
  return outs


def _op(ctx: _Walk, b: Any, ins: list[Flow]) -> list[Flow]:
  """Any other equation (``b``; ``a`` its twin on small)."""
  a, name = next(ctx.twins), _jaxpr.kind(b)
  joined = _join(ins)
  grad = joined.grad and name not in _CONSTANT
  grads = [grad and jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in b.outvars]
  wholes = [not jnp.issubdtype(v.aval.dtype, jnp.inexact) or name in _ROUNDED or (
      name in _EXACT and joined.whole) for v in b.outvars]
  zero = name in _SHAPED and joined.zero
  if a is None:
    why = joined.why or ctx.blind  # (a constant too: it may follow the rows' count)
    return [joined._replace(why=why, grad=g, whole=w, zero=zero)
            for g, w in zip(grads, wholes, strict=True)]
  ins, counts = _operands(ctx, a, b, ins)
  follows = [v.aval.shape != w.aval.shape for v, w in zip(b.outvars, a.outvars, strict=True)]
  rows, why = _not_a_sum(name, a, b, ins, counts, any(follows), ctx.rows)
  why = next((f.why for f in ins if f.why), None) or why
  return [Flow("rows" if f else rows, why, g, w, zero)
          for f, g, w in zip(follows, grads, wholes, strict=True)]


def grown_axis(small: Sequence[int], large: Sequence[int]) -> int | None:
  """The axis on which shape ``large`` differs from its twin ``small``: the rows' (one, or none;
  none where their ranks differ, which the walk refuses)."""
  if len(small) != len(large):
    return None
  return next((i for i, (m, n) in enumerate(zip(small, large, strict=True)) if m != n), None)


def _axis(v: Any, w: Any) -> int | None:
  """:func:`grown_axis` of an equation's variable ``v`` and its twin ``w``."""
  return grown_axis(w.aval.shape, v.aval.shape)


def _by_count(a: Any, b: Any) -> str | None:
  """What of ``b`` differs from its twin ``a`` other than its shapes along the rows: its rank, a
  parameter (``integer_pow``'s ``y``, a slice's start on another axis), if anything."""
  pairs = list(zip((*b.invars, *b.outvars), (*a.invars, *a.outvars), strict=True))
  if any(len(v.aval.shape) != len(w.aval.shape) for v, w in pairs):
    return "rank (a `squeeze` of one row?)"
  axes = {i for v, w in pairs for i, (m, n) in enumerate(zip(
      v.aval.shape, w.aval.shape, strict=True)) if m != n}  # (where shapes differ: the walk's)
  for key, v in b.params.items():
    u = a.params[key]
    if not (isinstance(v, (jax_core.Jaxpr, jax_core.ClosedJaxpr)) or str(v) == str(u) or (
        isinstance(v, tuple) and isinstance(u, tuple) and len(u) == len(v)
        and {i for i, (m, n) in enumerate(zip(v, u, strict=True)) if m != n} <= axes)):
      return f"`{key}`"
  return None


def _rows_kept(name: str, a: Any, b: Any) -> str | None:
  """Why ``b`` (``a`` its twin), whose results follow the rows, does not keep each row's
  entries its own, if it does not."""
  if name not in _ROWWISE:
    return f"`{name}` of the rows, which is read as no step row by row"
  out, p = _axis(b.outvars[0], a.outvars[0]), b.params
  if out in np.atleast_1d(p.get(_ALONG.get(name, ""), ())).tolist():
    return f"a `{name}` across the rows"
  x = b.invars[0] if b.invars else None  # the operand it reads (or writes into)
  axis = _axis(x, a.invars[0]) if x is not None else None
  if axis is None:
    return None
  if name == "searchsorted":  # (into a sorted operand that holds the rows)
    return "a `searchsorted` across the rows"
  dims = p.get("dimension_numbers")
  chosen = getattr(dims, "start_index_map", getattr(dims, "scatter_dims_to_operand_dims", ()))
  if axis in chosen and axis not in dims.operand_batching_dims:
    return f"rows chosen by an index (`{name}`: `x[i]`, `.at[i]`; `take_along_axis` keeps them)"
  if name in ("slice", "dynamic_slice", "pad") or name in _WRITES:  # all the rows, in place
    i = _WRITES.get(name)
    v, w = (b.invars[i], a.invars[i]) if i else (b.outvars[0], a.outvars[0])  # (what it writes)
    written = _axis(v, w)
    if written is None or v.aval.shape[written] != x.aval.shape[axis] or (
        name == "pad" and any(p["padding_config"][axis])):
      return f"rows cut or shifted (`{name}`)"
  if name == "gather" and axis not in dims.operand_batching_dims and (
      p["slice_sizes"][axis] != x.aval.shape[axis]):
    return "rows cut (`gather`)"
  if name == "reshape" and np.prod(x.aval.shape[:axis]) != np.prod(b.outvars[0].aval.shape[:out]):
    return f"rows mixed by a `reshape` ({x.aval.shape} -> {b.outvars[0].aval.shape})"
  return None


def _not_a_sum(name: str, a: Any, b: Any, ins: list[Flow], counts: list[bool],
               follows: bool, rows: tuple[int, int]) -> tuple[str, str | None]:
  """What ``b`` makes of the rows (``a`` its twin): its results' ``rows`` where they do not
  follow them, and why they are no sum over the rows, if they are not."""
  batch = {f.rows for f in ins} - {""}
  # Values of no row laid along the rows: evenly (a broadcast, an iota along another axis), else
  # by position among them; so is a write of them into rows.
  by_position = name in _WRITES and ins[_WRITES[name]].rows != "rows" if batch else not (
      name == "broadcast_in_dim" or (name == "iota" and b.params["dimension"] != _axis(
          b.outvars[0], a.outvars[0])))
  if follows and by_position:
    return "", f"a position among the rows (`{name}` by their count: `arange`, `.at[i].set`)"
  if by_count := _by_count(a, b):  # (Python logic on the rows' count: `x ** (3 if n > 8 else 2)`)
    return "", f"a function of the rows' count (`{name}`'s {by_count})"
  if not batch and not follows:  # a constant
    return "", None
  if any(counts) and name in ("div", "mul"):
    return "", "a mean over the rows"  # divided by the rows' count
  if follows:
    why = _rows_kept(name, a, b)
    if why:
      return "", why
    for v, w in zip(b.outvars, a.outvars, strict=True):  # each row's entries its own: t per row
      grown = [(m, n) for m, n in zip(v.aval.shape, w.aval.shape, strict=True) if m != n]
      if grown and (len(grown) > 1 or grown[0][0] % rows[0] or grown[0][0] * rows[1] != (
          grown[0][1] * rows[0])):
        return "", f"rows paired, shifted or cut (`{name}`: {w.aval.shape} -> {v.aval.shape})"
    return "", "a sum over the rows spread over them again" if "sum" in batch else None
  if batch == {"rows"}:  # values of the rows, reduced over them
    dims = b.params.get("dimension_numbers")
    if name.startswith("scatter") and _axis(b.invars[2], a.invars[2]) in dims.update_window_dims:
      return "", f"rows written in place of others (`{name}`: `.at[:n].add`), not summed"
    if name.startswith("scatter") and not ins[0].zero:  # (each micro-batch adds its base again)
      return "", f"rows added into a base that is not zeros (`{name}`: `ones(E).at[i].add`)"
    if name in _SUMS:
      return "sum", None
    return "", f"{_MAXIMA[name]} over the rows" if name in _MAXIMA else f"`{name}` over the rows"
  if batch != {"sum"}:
    return "", "a value of a row combined with a sum over the rows"
  summed = [bool(f.rows) or f.zero for f in ins]  # a sum, or zero
  if name in ("add", "sub", "add_any"):
    return ("sum", None) if all(summed) else ("", "a sum plus a constant (each micro-batch's)")
  if name in ("mul", "dot_general"):
    return ("sum", None) if sum(summed) == 1 else ("", "a product of sums over the rows")
  if name == "div" and summed == [True, False]:
    return ("sum", None) if jnp.issubdtype(b.outvars[0].aval.dtype, jnp.inexact) else (
        "", "a sum divided as integers (`//`): each micro-batch's quotient truncates")
  if name == "div":
    return "", "a ratio of sums over the rows" if all(summed) else "a reciprocal of a sum over them"
  if name == "convert_element_type" and b.params["new_dtype"] == np.bool_:
    return "", "a sum cast to bool (whether it is nonzero)"
  if fp8 := _quantiser(b):  # (each micro-batch's sum rounds on the format's coarse grid)
    return "", f"a sum rounded to {fp8}"
  if name == "convert_element_type" and not (
      ins[0].whole or jnp.issubdtype(b.params["new_dtype"], jnp.inexact)):
    return "", ("a float sum cut to an integer (`astype`), which may drop a fraction per"
                " micro-batch: sum integers (`m.astype(jnp.int32).sum()`), or keep floats")
  held = {"select_n": range(1, len(ins)), "dynamic_update_slice": (0, 1)}.get(name, range(
      len(ins)) if name in ("concatenate", "stack", "pad") else (0,))  # (not an index, a choice)
  if name in _LINEAR and all(summed[i] for i in held) and not any(
      f.rows for i, f in enumerate(ins) if i not in held):
    return "sum", None
  return "", f"`{name}` of a sum over the rows (beside a constant)" if name in (
      "select_n", "concatenate", "stack", "pad") else f"`{name}` of a sum over the rows"


_RULES = _jaxpr.Rules(dict.fromkeys((_jaxpr.CALL, "scan", "shard_map", "cond", "while"), _nested),
                      _op, lambda v: NONE._replace(whole=bool(np.all(np.round(v.val) == v.val)),
                                                   zero=not np.any(v.val)))


def _quantiser(eqn: Any) -> str | None:
  """The float format of 8 bits or fewer (fp8, fp4) that ``eqn`` casts to, else None (a
  ``reduce_precision`` is no cast: it is refused as not linear)."""
  p = eqn.params
  if eqn.primitive.name == "convert_element_type" and jnp.issubdtype(
      p["new_dtype"], jnp.floating) and np.dtype(p["new_dtype"]).itemsize == 1:
    return str(np.dtype(p["new_dtype"]))
  return None
