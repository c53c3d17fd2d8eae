"""The one jaxpr interpreter: a table of rules keyed by primitive, one descent into inner jaxprs.

Two walks read a jaxpr equation by equation: ``_row_trail`` follows the
batch's rows (whether each value is linear in the rows, whether a gradient
reaches it: for ``global_stats``), and ``offload`` inlines the calls of the
update it streams, labels each value with the leaves it is computed from
(beside the update traced on a block of rows: :func:`twins`) and binds, per
piece, the part its outputs need (:func:`pruned`). Each is a :class:`Rules`, a
rule per primitive and one for the rest, which :func:`interpret` runs. What JAX
keeps inside an equation is read here alone: which primitives are calls
(``CALL``, by every name JAX gives them), where an equation keeps its jaxprs
(closed before JAX 0.11, open from it, their constants made operands:
:func:`closed`) and which operands feed each (:func:`descend`). A rename in
a new JAX is one fix, here.

Example: which inputs each output is computed from, through a call and a
``cond`` (whose index chooses a value, it is not computed from it):

  >>> import jax, jax.numpy as jnp
  >>> from optax_accum import _jaxpr
  >>> def computed_from(ctx, eqn, ins):
  ...   return _jaxpr.descend(eqn, ins, walk, lambda values: set().union(*values))
  >>> rules = _jaxpr.Rules({}, computed_from, lambda literal: set())
  >>> def walk(jaxpr, ins):
  ...   return _jaxpr.interpret(rules, jaxpr, [set()] * len(jaxpr.constvars), ins)
  >>> def f(x, y, z):
  ...   return jax.jit(jnp.sin)(x) * z, jax.lax.cond(z > 0, lambda: y, lambda: -y)
  >>> [sorted(s) for s in walk(jax.make_jaxpr(f)(1.0, 2.0, 3.0).jaxpr, [{"x"}, {"y"}, {"z"}])]
  [['x', 'z'], ['y']]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from jax.extend import core as jax_core

Rule = Callable[[Any, Any, list[Any]], list[Any]]  # (ctx, eqn, its operands') -> its results'
CALL = "call"  # the kind of every call: operands and results one to one with its jaxpr's
# The calls (jit, jax.checkpoint, custom_jvp/vjp/vmap functions), by the names JAX >= 0.10.2 uses.
_CALLS = "jit remat2 call closed_call custom_jvp_call custom_vjp_call custom_vmap_call".split()


class Rules(NamedTuple):
  """A walk of a jaxpr: what an equation's results are, and what a literal is.

  Attributes:
    table: a rule per kind of equation (:func:`kind`: ``CALL`` for every call,
      else the primitive's name): ``rule(ctx, eqn, ins)`` returns the values of
      ``eqn``'s results from ``ins``, its operands'.
    default: the rule of every kind the table does not name.
    literal: a literal's value (``literal(v)``, ``v`` a ``jax_core.Literal``).
  """

  table: Mapping[str, Rule]
  default: Rule
  literal: Callable[[Any], Any]


def kind(eqn: Any) -> str:
  """``CALL`` for a call (jit, checkpoint, custom rules, whatever JAX names it), else the name
  (of what a ``call_hi_primitive`` calls from JAX 0.12: ``searchsorted``, ``ldexp``)."""
  if eqn.primitive.name == "call_hi_primitive":
    return type(eqn.params["_prim"]).__name__.lower()
  return CALL if eqn.primitive.name in _CALLS else eqn.primitive.name


def differentiated_by_rule(eqn: Any) -> bool:
  """Whether ``eqn`` calls a function with its own derivative rule (``custom_jvp``/``vjp``)."""
  return eqn.primitive.name in ("custom_jvp_call", "custom_vjp_call")


def interpret(rules: Rules, jaxpr: Any, consts: Sequence, args: Sequence, ctx: Any = None) -> list:
  """The values of ``jaxpr``'s outputs, from its constants' and inputs', rule by rule.

  Each equation's rule is looked up by its :func:`kind` and given ``ctx``
  (whatever the walk carries along), the equation and its operands' values.
  """
  env = dict(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))

  def read(v: Any) -> Any:
    return rules.literal(v) if isinstance(v, jax_core.Literal) else env[v]

  for eqn in jaxpr.eqns:
    rule = rules.table.get(kind(eqn), rules.default)
    env.update(zip(eqn.outvars, rule(ctx, eqn, [read(v) for v in eqn.invars]), strict=True))
  return [read(v) for v in jaxpr.outvars]


def closed(jaxpr: Any) -> jax_core.ClosedJaxpr:
  """An inner jaxpr as a ``ClosedJaxpr``: JAX keeps them closed before 0.11, open from it."""
  return jaxpr if isinstance(jaxpr, jax_core.ClosedJaxpr) else jax_core.ClosedJaxpr(jaxpr, ())


def callee(eqn: Any) -> jax_core.ClosedJaxpr:
  """The jaxpr a call, ``scan`` (its body) or ``shard_map`` (per device) runs on its operands."""
  p = eqn.params  # `call_jaxpr`: custom rules, `call`, `closed_call`; else `jaxpr`
  return closed(p["call_jaxpr"] if "call_jaxpr" in p else p["jaxpr"])


def descend(eqn: Any, ins: list, walk: Callable[..., list], join: Callable[..., Any]) -> list:
  """The values of ``eqn``'s results from its operands', through its jaxprs.

  For a walk of what values depend on: ``walk(jaxpr, ins)`` gives an (open)
  jaxpr's outputs from its inputs' values, ``join`` one value from several
  that reach one result. A call, a ``scan`` (its body once: what the carry
  brings round is not followed) and a ``shard_map`` pass their operands to
  their jaxpr and its outputs back, one to one. A ``cond``'s branches get the
  operands after the index, and each result joins theirs (the index feeds
  none: a walk that needs it adds it). A ``while``'s condition is walked on its
  constants and the carry, for what the walk records; its body on its own
  constants and the carry, and each result joins the body's with the carry's.
  Any other equation's results each join all its operands; its jaxprs (a
  reduction's scalar computation) are walked on that too.
  """
  p, k, jaxprs = eqn.params, kind(eqn), inner(eqn)
  if k in (CALL, "scan", "shard_map"):
    return walk(jaxprs[0], ins)
  if k == "cond":
    outs = [walk(j, ins[1:]) for j in jaxprs]
    return [join(o) for o in zip(*outs, strict=True)]
  if k == "while":
    c, b = p["cond_nconsts"], p["body_nconsts"]
    consts, carry = ins[c:][:b], ins[c:][b:]
    walk(jaxprs[0], ins[:c] + carry)
    outs = walk(jaxprs[1], consts + carry)
    return [join(o) for o in zip(outs, carry, strict=True)]
  every = join(ins)
  for j in jaxprs:
    walk(j, [every] * len(j.invars))
  return [every] * len(eqn.outvars)


def scan_carry(eqn: Any) -> tuple[int, int]:
  """How many of a ``scan``'s operands are constants, and how many then its carry (which its
  first results are): ``num_consts``, ``num_carry`` before JAX 0.12, ``ft_in``'s groups from it."""
  p = eqn.params
  if "num_carry" in p:
    return p["num_consts"], p["num_carry"]
  consts, carry, _ = p["ft_in"].unpack()
  return len(consts), len(carry)


def inner(eqn: Any) -> list:
  """``eqn``'s (open) jaxprs, in the order :func:`descend` walks them."""
  p, k = eqn.params, kind(eqn)
  if k in (CALL, "scan", "shard_map"):
    return [callee(eqn).jaxpr]
  if k == "cond":
    return [closed(b).jaxpr for b in p["branches"]]
  if k == "while":
    return [closed(p["cond_jaxpr"]).jaxpr, closed(p["body_jaxpr"]).jaxpr]
  return list(jax_core.jaxprs_in_params(p))


def aligned(jaxpr: Any, other: Any) -> bool:
  """Whether ``other`` holds ``jaxpr``'s equations in their order (its program on other shapes):
  the same primitives, with as many operands, results and jaxprs."""
  eqn = lambda e: (e.primitive, len(e.invars), len(e.outvars), len(inner(e)))
  return other is not None and list(map(eqn, jaxpr.eqns)) == list(map(eqn, other.eqns))


def twins(jaxpr: Any, other: Any) -> Iterator:
  """The equations of ``other`` (the program of ``jaxpr`` traced on other shapes), one for each
  of ``jaxpr``'s in turn; None for each where the two hold other equations (or ``other`` is
  None)."""
  return iter(other.eqns if aligned(jaxpr, other) else [None] * len(jaxpr.eqns))


def pruned(jaxpr: Any, outs: Sequence, given: Any = ()) -> Any:
  """``jaxpr`` cut down to computing ``outs`` (its outputs, in order): the equations they
  need, back from them, not past a variable of ``given`` (a value known already). Its inputs:
  those of ``jaxpr``'s inputs, then of ``given``, that ``outs`` read; its constants
  ``jaxpr``'s. Dead code elimination, for a walk that binds only what ``outs`` need."""
  found = {v for v in outs if not isinstance(v, jax_core.Literal)}
  missing, eqns = {v for v in found if v not in given}, []  # (what an equation must compute)
  for eqn in reversed(jaxpr.eqns):
    if not missing.isdisjoint(eqn.outvars):
      eqns.append(eqn)
      ins = [v for v in eqn.invars if not isinstance(v, jax_core.Literal)]
      found.update(ins)
      missing.update(v for v in ins if v not in given)
  invars = [v for v in dict.fromkeys([*jaxpr.invars, *given]) if v in found]
  return jaxpr.replace(invars=invars, outvars=list(outs), eqns=eqns[::-1])
