"""Tools to check what a compiled step does.

Each function reads the optimized HLO of a compiled step
(``jax.jit(f).lower(...).compile()``, or its ``as_text()``) and answers one
question about it:

* :func:`hlo_collectives`: which collectives run, how many bytes each, and
  under which ``lax.cond`` branch or ``while`` loop (is the gradient
  all-reduce once per window, or on every micro-step?).
* :func:`conditionals`: how many ``conditional`` instructions are left (does
  the inner optimizer really only run on emitting steps, or did the compiler
  turn the ``lax.cond`` into selects that compute both branches?).
* :func:`copies`: the ``copy`` instructions of at least a given size, and
  where they run (does a step copy a parameter-sized buffer it could update
  in place?).
* :func:`opcodes`: how many instructions of each opcode it holds (a
  ``select`` count near the parameter leaves' is a conditional turned into
  selects).

All of them share one parser: the module is split into computations, and the
computations reachable from the entry are walked through ``conditional``
branches, ``while`` bodies and conditions, and calls.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any, NamedTuple

__all__ = [
    "Collective",
    "Copy",
    "conditionals",
    "copies",
    "hlo_collectives",
    "opcodes",
]

Context = tuple[tuple[str, Any], ...]

_DTYPE_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
_COLLECTIVES = (
    "all-reduce", "all-reduce-start", "reduce-scatter", "all-gather", "all-gather-start",
    "all-to-all", "collective-permute", "collective-permute-start",
)
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
# dtype, dims and (optional) layout of each array in an HLO type.
_ARRAY_TYPE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\](\{[^}]*\})?")
_COMMENT = re.compile(r"/\*.*?\*/")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_CALLEES = re.compile(
    r"\b(branch_computations|true_computation|false_computation|body|condition|to_apply|calls)"
    r"=(\{[^}]*\}|%?[\w.\-]+)")


class Collective(NamedTuple):
  """One collective instruction of a compiled HLO module.

  Attributes:
    op: the HLO opcode, e.g. ``"all-reduce"``.
    bytes: bytes of its result (for an all-reduce, the bytes reduced).
    computation: the HLO computation that holds it.
    context: how it is reached from the entry computation: a tuple of
      ``("conditional", branch_index)`` (for a ``lax.cond``, branch 1 is the
      true branch) and ``("while", "body")`` steps, outermost first. ``()``
      means the entry's straight-line path: it runs on every call.
  """

  op: str
  bytes: int
  computation: str
  context: Context


class Copy(NamedTuple):
  """One ``copy`` instruction of a compiled HLO module (outside fusions).

  Attributes:
    bytes: bytes of the copied array.
    shape: its shape.
    computation: the HLO computation that holds it.
    context: how it is reached from the entry computation, as in
      :class:`Collective`; ``()``: on every call.
    source: the opcode that produced the copied value, e.g.
      ``"get-tuple-element"`` (a computation's argument), ``"parameter"``,
      ``"fusion"``, ``"broadcast"``.
    fill: whether the copied value is a broadcast or is built from constants
      only (a zero fill): the copy then writes that fill into its own buffer.
      Otherwise it copies data (a parameter, a buffer, optimizer state).
  """

  bytes: int
  shape: tuple[int, ...]
  computation: str
  context: Context
  source: str
  fill: bool


class _Instruction(NamedTuple):
  """One parsed HLO instruction line."""

  name: str
  type_str: str
  opcode: str
  operands: tuple[str, ...]
  attributes: str  # what follows the operands: callees, metadata


def _type_bytes(type_str: str) -> int:
  """Bytes of the arrays of an HLO type."""
  return sum(math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dtype]
             for dtype, dims, _ in _ARRAY_TYPE.findall(type_str) if dtype in _DTYPE_BYTES)


def _closing(text: str, start: int) -> int:
  """Index of the parenthesis closing the one at ``text[start]`` (or -1)."""
  depths = itertools.accumulate((c == "(") - (c == ")") for c in text[start:])
  return next((start + i for i, depth in enumerate(depths) if depth == 0), -1)


def _parse_instruction(line: str) -> _Instruction | None:
  """``name = type opcode(operands), attributes`` -> an :class:`_Instruction`."""
  lhs, _, rhs = line.partition("=")
  rhs = _COMMENT.sub("", rhs).strip()
  type_end = _closing(rhs, 0) + 1 if rhs.startswith("(") else rhs.find(" ")  # "(tuple)" or a word
  match = _OPCODE.match(rhs, max(type_end, 0))
  if not lhs.strip() or type_end <= 0 or not match:
    return None
  start = match.end()
  end = _closing(rhs, start - 1)
  operands = tuple(o.split()[-1].lstrip("%") for o in rhs[start:end].split(",") if o.strip())
  return _Instruction(lhs.split()[-1].lstrip("%"), rhs[:type_end], match.group(1), operands,
                      rhs[end + 1 :])


def _parse_module(text: str) -> tuple[str, dict[str, list[_Instruction]]]:
  """``(entry_name, {computation: instructions})`` of an HLO module's text."""
  bodies: dict[str, list[_Instruction]] = {}
  entry = None
  current = None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = header.group(2)
      bodies[current] = []
      entry = current if header.group(1) else entry
    elif current is not None and line.startswith("}"):
      current = None
    elif current is not None:
      instruction = _parse_instruction(line)
      if instruction is not None:
        bodies[current].append(instruction)
  if entry is None:
    raise ValueError(
        "No ENTRY computation found; pass a compiled step"
        " (`jax.jit(f).lower(...).compile()`) or its `.as_text()`.")
  return entry, bodies


def _callees(instruction: _Instruction) -> Iterator[tuple[str, tuple[tuple[str, Any], ...]]]:
  """``(computation, context step)`` of each computation an instruction runs.

  The step is ``()`` for a call or a fusion. A ``call`` runs its ``to_apply``
  computation; elsewhere ``to_apply`` names a scalar helper (a reduction's
  add, a sort's comparison), which is not followed.
  """
  for kind, callee in _CALLEES.findall(instruction.attributes):
    names = [c.strip().lstrip("%") for c in callee.strip("{}").split(",") if c.strip()]
    if kind == "branch_computations":
      for i, c in enumerate(names):
        yield c, (("conditional", i),)
    elif kind in ("true_computation", "false_computation"):
      yield names[0], (("conditional", int(kind == "true_computation")),)
    elif kind in ("body", "condition"):
      yield names[0], (("while", kind),)
    elif kind == "calls" or (kind == "to_apply" and instruction.opcode == "call"):
      for c in names:
        yield c, ()


class _Site(NamedTuple):
  """An instruction reached from the entry, with where it was reached."""

  computation: str
  context: Context
  fused: bool  # inside a fusion: no buffer of its own
  instruction: _Instruction
  defs: dict[str, _Instruction]  # the names defined in ``computation``
  body: list[_Instruction]  # for a fusion: its fused computation's instructions


def _walk(compiled: Any) -> Iterator[_Site]:
  """Every instruction reachable from the entry, once per path, in program order.

  ``compiled``: a compiled step or its text.
  """
  entry, bodies = _parse_module(compiled if isinstance(compiled, str) else compiled.as_text())

  def visit(name: str, context: Context, fused: bool) -> Iterator[_Site]:
    instructions = bodies.get(name, [])
    defs = {i.name: i for i in instructions}
    for instruction in instructions:
      callees = list(_callees(instruction))
      is_fusion = instruction.opcode == "fusion"
      body = bodies.get(callees[0][0], []) if is_fusion and callees else []
      yield _Site(name, context, fused, instruction, defs, body)
      for callee, where in callees:
        yield from visit(callee, (*context, *where), fused or is_fusion)

  yield from visit(entry, (), False)


def hlo_collectives(compiled: Any) -> list[Collective]:
  """Lists the collectives of a compiled step and where they run.

  Use it to check what a step communicates: with ``accumulate(k, opt,
  axis_name=...)`` the gradient all-reduce must sit in the ``lax.cond``'s
  emitting branch (``context == (("conditional", 1),)``), so it runs once per
  window; a per-micro-step all-reduce shows ``context == ()``.

  Args:
    compiled: ``jax.jit(f).lower(...).compile()`` (or its ``as_text()``).

  Returns:
    One :class:`Collective` per collective instruction reachable from the
    entry computation (one per reachable path).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from functools import partial
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> from optax_accum.debug import hlo_collectives
    >>> mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    >>> @jax.jit
    ... @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    ... def f(flag, x):
    ...   return jax.lax.cond(flag, lambda v: jax.lax.psum(v, "data"),
    ...                       lambda v: jax.lax.pmax(v, "data"), x.sum())
    >>> [(c.op, c.bytes, c.context) for c in hlo_collectives(
    ...     f.lower(True, jnp.ones(8)).compile())]  # doctest: +NORMALIZE_WHITESPACE
    [('all-reduce', 4, (('conditional', 0),)), ('all-reduce', 4, (('conditional', 1),))]
  """
  return [
      Collective(s.instruction.opcode, _type_bytes(s.instruction.type_str), s.computation,
                 s.context)
      for s in _walk(compiled)
      if s.instruction.opcode in _COLLECTIVES
  ]


def conditionals(compiled: Any) -> int:
  """How many ``conditional`` instructions a compiled step holds.

  A ``lax.cond`` is a ``conditional`` in HLO, which runs only the branch its
  predicate selects. The compiler may instead turn a cond with cheap branches
  into selects that compute both (XLA's GPU compiler does), or fold a cond
  whose predicate is known at compile time. With ``accumulate`` the inner
  optimizer only skips its work on mid-window steps while its ``conditional``
  survives; this counts them.

  Args:
    compiled: ``jax.jit(f).lower(...).compile()`` (or its ``as_text()``).

  Returns:
    The number of distinct ``conditional`` instructions reachable from the
    entry computation.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax_accum.debug import conditionals
    >>> f = jax.jit(lambda p, x: jax.lax.cond(p, jnp.sin, jnp.cos, x))
    >>> conditionals(f.lower(True, jnp.ones(4)).compile())  # XLA:CPU keeps it
    1
    >>> g = jax.jit(lambda x: jax.lax.cond(True, jnp.sin, jnp.cos, x))
    >>> conditionals(g.lower(jnp.ones(4)).compile())  # constant predicate: folded
    0
  """
  return len({(s.computation, s.instruction.name) for s in _walk(compiled)
              if s.instruction.opcode == "conditional"})


def opcodes(compiled: Any) -> dict[str, int]:
  """How many instructions of each opcode a compiled step holds.

  Fusion bodies and conditional branches included, each once per path that
  reaches it from the entry. A ``select`` count near the parameter leaves'
  is the sign of a conditional the compiler turned into selects.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax_accum.debug import opcodes
    >>> f = jax.jit(lambda p, x: jnp.where(p, jnp.sin(x), x))
    >>> opcodes(f.lower(True, jnp.ones(4)).compile())["select"]
    1
  """
  return dict(Counter(site.instruction.opcode for site in _walk(compiled)))


def copies(compiled: Any, min_bytes: int = 0) -> list[Copy]:
  """The ``copy`` instructions of a compiled step, of at least ``min_bytes``.

  A copy of a parameter-sized array in a step that could update its buffers
  in place is a cost to look for: pass the size of the smallest parameter
  leaf as ``min_bytes``. A fusion that only wraps a copy (XLA:CPU wraps
  single instructions so) counts as a copy; copies inside larger fusions
  (no buffer of their own) are not listed. :attr:`Copy.fill` separates
  copies of data from the writes of a zero fill into distinct buffers.

  Args:
    compiled: ``jax.jit(f).lower(...).compile()`` (or its ``as_text()``).
    min_bytes: the smallest copy to list, in bytes.

  Returns:
    One :class:`Copy` per ``copy`` instruction reachable from the entry
    computation (one per reachable path), in program order.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax_accum.debug import copies
    >>> f = jax.jit(lambda x: (x, x.T))  # a copy of x, and a transposing copy
    >>> [(c.bytes, c.shape, c.context, c.fill)
    ...  for c in copies(f.lower(jnp.ones((64, 32))).compile(), min_bytes=1024)]
    [(8192, (64, 32), (), False), (8192, (32, 64), (), False)]
  """
  if min_bytes < 0:
    raise ValueError(f"`min_bytes` must be >= 0; got {min_bytes}.")
  found = []
  for site in _walk(compiled):
    i = site.instruction
    size = _type_bytes(i.type_str)
    wrapped = [b.opcode for b in site.body if b.opcode not in ("parameter", "bitcast")]
    if site.fused or (i.opcode != "copy" and wrapped != ["copy"]) or size < min_bytes:
      continue
    source = site.defs.get(i.operands[0]) if i.operands else None
    array = _ARRAY_TYPE.search(i.type_str)
    shape = tuple(int(d) for d in array.group(2).split(",") if d) if array else ()
    found.append(Copy(size, shape, site.computation, site.context,
                      source.opcode if source else "?", _is_fill(source, site.defs)))
  return found


def _is_fill(source: _Instruction | None, defs: dict[str, _Instruction]) -> bool:
  """Whether ``source`` is a broadcast, a constant, or a fusion of constants."""
  if source is None:
    return False
  if source.opcode in ("broadcast", "constant"):
    return True
  return source.opcode == "fusion" and all(
      o in defs and defs[o].opcode == "constant" for o in source.operands)
