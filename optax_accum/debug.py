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
* :func:`step_kernels`: how many kernels an ``accumulate`` mid-step and an
  emitting step launch (what a dispatch-bound small model pays per call).
* :func:`step_bytes`: how many bytes they read and write (what a
  bandwidth-bound large model pays per call, on the backend it was compiled
  for).

All of them share one parser: the module is split into computations, and the
computations reachable from the entry are walked through ``conditional``
branches, ``while`` bodies and conditions, and calls.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from optax_accum import _window

__all__ = ["Collective", "Copy", "conditionals", "copies", "hlo_collectives", "opcodes",
           "step_bytes", "step_kernels"]

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
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")
_COMMENT = re.compile(r"/\*.*?\*/")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# The named scopes of optax_accum's conditional's branches (read once: a program
# traced under other names is not ours).
_STEP_SCOPES = (f"/{_window.SCOPES['mid']}/", f"/{_window.SCOPES['emit']}/")
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


def _type_bytes(type_str: str, main_memory_only: bool = False) -> int:
  """Bytes of the arrays of an HLO type.

  ``main_memory_only``: only the arrays in device main memory. A layout's
  ``S(n)``, n > 0, puts an array in another memory space (a TPU's on-chip
  VMEM or SMEM), whose reads and writes do not touch main memory.
  """
  total = 0
  for dtype, dims, layout in _ARRAY_TYPE.findall(type_str):
    space = _MEMORY_SPACE.search(layout)
    if dtype in _DTYPE_BYTES and not (main_memory_only and space and space.group(1) != "0"):
      total += math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dtype]
  return total


def _closing(text: str, start: int) -> int:
  """Index of the parenthesis closing the one at ``text[start]`` (or -1)."""
  depth = 0
  for i in range(start, len(text)):
    depth += text[i] == "("
    depth -= text[i] == ")"
    if depth == 0:
      return i
  return -1


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

  The step is ``()`` for a plain call or a fusion; ``to_apply`` bodies
  (reductions, sorts) are scalar helpers and are not followed.
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
    elif kind == "calls":
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
  step: str | None  # in a branch of optax_accum's conditional: "mid" or "emit"


def _walk(compiled: Any) -> Iterator[_Site]:
  """Every instruction reachable from the entry, once per path, in program order.

  ``compiled``: a compiled step or its text. optax_accum's conditional is the
  outermost one with a branch under one of its named scopes; as for any
  ``lax.cond``, its branch 1 (the true branch) is the emitting step.
  """
  entry, bodies = _parse_module(compiled if isinstance(compiled, str) else compiled.as_text())

  def ours(branch: str) -> bool:  # does a branch run under optax_accum's mid or emit scope?
    names = (f"/{n}/" for i in bodies.get(branch, []) for n in _OP_NAME.findall(i.attributes))
    return any(scope in name for name in names for scope in _STEP_SCOPES)

  def visit(name: str, context: Context, fused: bool, step: str | None) -> Iterator[_Site]:
    instructions = bodies.get(name, [])
    defs = {i.name: i for i in instructions}
    for instruction in instructions:
      callees = list(_callees(instruction))
      is_fusion = instruction.opcode == "fusion"
      body = bodies.get(callees[0][0], []) if is_fusion and callees else []
      yield _Site(name, context, fused, instruction, defs, body, step)
      split = step is None and instruction.opcode == "conditional" and len(callees) == 2 and any(
          ours(c) for c, _ in callees)
      for callee, where in callees:
        yield from visit(callee, (*context, *where), fused or is_fusion,
                         ("mid", "emit")[where[0][1]] if split else step)

  yield from visit(entry, (), False, None)


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


_LAUNCHING = ("fusion", "copy", "custom-call", *_COLLECTIVES)


def _per_step(compiled: Any, weight: Callable[[_Site], int]) -> dict[str, int]:
  """Sums ``weight(site)`` over the sites a mid-step and an emitting step run.

  A site in a branch of optax_accum's conditional runs on that branch's step;
  any other (outside every conditional, or in one not ours), on both.
  """
  total = {"mid": 0, "emit": 0}
  for site in _walk(compiled):
    amount = weight(site)
    for step in total:
      total[step] += amount if site.step in (None, step) else 0
  return total


def step_kernels(compiled: Any) -> dict[str, int]:
  """Kernels a mid-step and an emitting step of ``accumulate`` launch.

  Counts the launching instructions (fusions, copies, custom calls,
  collectives) outside fusions on each path: those in a branch of
  optax_accum's conditional (the one whose branches carry the named scopes
  ``optax_accum_mid`` and ``optax_accum_emit``) run on the step that branch
  serves; all others (outside every conditional, or in a conditional of
  unknown role) count on both. On a GPU each launch is host time, which
  dominates the step of a small model; on a TPU the step is one program and
  the count is its number of fusions.

  Args:
    compiled: ``jax.jit(f).lower(...).compile()`` (or its ``as_text()``).

  Returns:
    ``{"mid": n, "emit": n}``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_accum as oa
    >>> from optax_accum.debug import step_kernels
    >>> tx = oa.accumulate(4, optax.adam(1e-3))
    >>> params = {"w": jnp.ones((256, 256))}
    >>> step = jax.jit(lambda p, s, g: oa.update_and_apply(tx, g, s, p))
    >>> k = step_kernels(step.lower(params, tx.init(params), params).compile())
    >>> k["mid"] < k["emit"]  # a mid-step adds into the buffer; an emit runs Adam
    True
  """
  return _per_step(compiled,
                   lambda site: int(not site.fused and site.instruction.opcode in _LAUNCHING))


# Instructions outside fusions that move no data themselves (control flow
# runs its bodies, which are walked; an async op's data is counted at its
# ``-done``).
_NO_DATA = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "conditional", "while",
    "call", "after-all", "opt-barrier", "partition-id", "replica-id", "add-dependency",
    "domain", "async-update",
})
_SLICING = ("slice", "dynamic-slice", "gather")


def _operand_bytes(name: str, defs: dict[str, _Instruction]) -> int:
  source = defs.get(name)
  return 0 if source is None else _type_bytes(source.type_str, main_memory_only=True)


def _fusion_bytes(site: _Site) -> int:
  """Bytes a fusion reads and writes, each operand and result counted once.

  An operand the fused body only slices counts as its slices; the buffer an
  in-place ``dynamic-update-slice`` root updates counts as the update only.
  """
  body = site.body
  params = {int(i.operands[0]): i.name for i in body if i.opcode == "parameter"}
  users: dict[str, list[_Instruction]] = {}
  for i in body:
    for o in i.operands:
      users.setdefault(o, []).append(i)
  root = body[-1] if body else None
  in_place = root is not None and root.opcode == "dynamic-update-slice"
  total = 0
  for index, name in enumerate(site.instruction.operands):
    uses = users.get(params.get(index, ""), [])
    whole = _operand_bytes(name, site.defs)
    if whole and uses and all(
        u.opcode in _SLICING and u.operands[0] == params[index] for u in uses):
      total += sum(_type_bytes(u.type_str) for u in uses)
    elif in_place and uses == [root] and root.operands[0] == params.get(index):
      continue  # updated in place: only the update is written
    else:
      total += whole
  if in_place:
    return total + _operand_bytes(root.operands[1], {i.name: i for i in body})
  return total + _type_bytes(site.instruction.type_str, main_memory_only=True)


def _site_bytes(site: _Site) -> int:
  i = site.instruction
  if site.fused or i.opcode in _NO_DATA or i.opcode.endswith("-start"):
    return 0
  if i.opcode == "fusion":
    return _fusion_bytes(site)
  if i.opcode.endswith("-done"):  # the data of the async op: its result, from its source
    start = site.defs.get(i.operands[0]) if i.operands else None
    source = site.defs.get(start.operands[0]) if start and start.operands else None
    moved = _type_bytes(i.type_str)
    from_main = source is not None and _type_bytes(source.type_str, main_memory_only=True) > 0
    return (moved if from_main else 0) + _type_bytes(i.type_str, main_memory_only=True)
  if i.opcode == "dynamic-update-slice":  # in place: read and write the update
    return 2 * _operand_bytes(i.operands[1], site.defs)
  read = sum(_operand_bytes(o, site.defs) for o in i.operands)
  return read + _type_bytes(i.type_str, main_memory_only=True)


def step_bytes(compiled: Any) -> dict[str, int]:
  """Bytes a mid-step and an emitting step of ``accumulate`` read and write.

  Sums, over the instructions each step runs (placed as in
  :func:`step_kernels`), the bytes of every operand and result of each
  kernel outside fusions that live in device main memory (DRAM, HBM): what
  the step moves when nothing stays in a cache between kernels. Each kernel
  counts each operand once in full, except an operand its fused body only
  slices (counted as the slices) and the buffer an in-place
  ``dynamic-update-slice`` updates (counted as the update). An asynchronous
  copy counts once, at its ``-done``, from its source to its result; arrays
  in another memory space (a TPU's VMEM: layout ``S(1)``) are not main
  memory, so a prefetch into VMEM counts as one read. A ``while`` body
  counts once. Compare a step with the plain optimizer step
  compiled for the same backend: this is the backend's own pass count (on
  XLA:CPU Adam is three loops per leaf, 10 parameter-sized passes; where it
  is one fused kernel, 7).

  Args:
    compiled: ``jax.jit(f).lower(...).compile()`` (or its ``as_text()``).

  Returns:
    ``{"mid": bytes, "emit": bytes}``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_accum as oa
    >>> from optax_accum.debug import step_bytes
    >>> tx = oa.accumulate(4, optax.sgd(0.1))
    >>> params = {"w": jnp.ones((256, 256))}  # 256 KiB
    >>> step = jax.jit(lambda p, s, g: oa.update_and_apply(tx, g, s, p),
    ...                donate_argnums=(0, 1))
    >>> moved = step_bytes(step.lower(params, tx.init(params), params).compile())
    >>> round(moved["mid"] / 2**18)  # read g and the buffer, write the buffer
    3
  """
  return _per_step(compiled, _site_bytes)


def _is_fill(source: _Instruction | None, defs: dict[str, _Instruction]) -> bool:
  """Whether ``source`` is a broadcast, a constant, or a fusion of constants."""
  if source is None:
    return False
  if source.opcode in ("broadcast", "constant"):
    return True
  return source.opcode == "fusion" and all(
      o in defs and defs[o].opcode == "constant" for o in source.operands)
