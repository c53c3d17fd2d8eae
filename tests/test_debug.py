"""optax_accum.debug: the HLO reader, checked on programs whose answer is known.

Two kinds of reference: small jitted programs where the placement of each
collective, conditional and copy follows from the program itself (a psum
written in one branch of a cond must be reported in that branch, and nowhere
else), and a hand-written HLO module that pins the parser's mechanics (tuple
types, index comments, nested calls) independently of the XLA version.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from optax_accum.debug import (
  Collective,
  Copy,
  conditionals,
  copies,
  hlo_collectives,
  opcodes,
)

N_DEV = 8
needs_devices = pytest.mark.skipif(
    jax.device_count() < N_DEV,
    reason="needs 8 devices: run through pytest so tests/conftest.py sets XLA_FLAGS",
)


# What XLA keeps is a choice of each backend's compiler: XLA:GPU may turn a cond
# with cheap branches into selects, or place copies differently. The programs
# below pin XLA:CPU's choices; the hand-written HLO tests run everywhere.
cpu_only = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="pins XLA:CPU's conditionals and copies")


def _mesh() -> Mesh:
  return Mesh(np.array(jax.devices()[:N_DEV]), ("d",))


def _shard_mapped(fn: Callable[..., jax.Array], in_specs: tuple[P, ...]) -> Any:
  """``fn`` under jit and shard_map on 8 devices, its output split over ``"d"``."""
  return jax.jit(jax.shard_map(fn, mesh=_mesh(), in_specs=in_specs, out_specs=P("d")))


X = jnp.arange(64, dtype=jnp.float32)
LOCAL_BYTES = 4 * 64 // N_DEV  # an all-reduce of one device's f32[8] block


# --- collectives ----------------------------------------------------------------------------


@needs_devices
@pytest.mark.parametrize("branch", [0, 1])
def test_collective_in_one_cond_branch(branch: int) -> None:
  """The psum is written in exactly one branch; it must be reported there only."""
  with_psum = lambda v: v + lax.psum(v, "d")
  without = lambda v: v * 2.0
  branches = (with_psum, without) if branch == 0 else (without, with_psum)
  # lax.cond(p, true_fn, false_fn): the false branch is HLO branch 0.
  f = _shard_mapped(lambda p, x: lax.cond(p, branches[1], branches[0], x), (P(), P("d")))
  found = hlo_collectives(f.lower(True, X).compile())
  assert [(c.op, c.bytes, c.context) for c in found] == [
      ("all-reduce", LOCAL_BYTES, (("conditional", branch),))]
  assert isinstance(found[0], Collective) and found[0].computation


@needs_devices
def test_collective_on_every_call_has_empty_context() -> None:
  f = _shard_mapped(lambda x: x + lax.psum(x, "d"), (P("d"),))
  found = hlo_collectives(f.lower(X).compile())
  assert [(c.op, c.bytes, c.context) for c in found] == [("all-reduce", LOCAL_BYTES, ())]


@needs_devices
def test_collective_in_a_while_body_and_a_switch_inside_it() -> None:
  f = _shard_mapped(
      lambda n, x: lax.fori_loop(0, n, lambda _, v: v + lax.psum(v, "d"), x), (P(), P("d")))
  found = hlo_collectives(f.lower(3, X).compile())
  assert [c.context for c in found] == [(("while", "body"),)]

  def body(i: jax.Array, v: jax.Array) -> jax.Array:
    return lax.switch(i, [lambda u: u * 2.0, lambda u: u + 1.0,
                          lambda u: u + lax.psum(u, "d")], v)

  g = _shard_mapped(lambda n, i, x: lax.fori_loop(0, n, lambda _, v: body(i, v), x),
                    (P(), P(), P("d")))
  compiled = g.lower(3, 1, X).compile()
  found = hlo_collectives(compiled)
  assert [c.context for c in found] == [(("while", "body"), ("conditional", 2))]
  assert conditionals(compiled) == 1


def test_no_collectives_on_one_device() -> None:
  assert hlo_collectives(jax.jit(jnp.sin).lower(X).compile()) == []


# --- conditionals ---------------------------------------------------------------------------


@cpu_only
def test_conditional_kept_with_a_runtime_predicate() -> None:
  f = jax.jit(lambda p, x: lax.cond(p, jnp.sin, jnp.cos, x))
  assert conditionals(f.lower(True, X).compile()) == 1
  # Two independent conds: two conditionals.
  g = jax.jit(lambda p, q, x: lax.cond(q, jnp.exp, jnp.tanh, lax.cond(p, jnp.sin, jnp.cos, x)))
  assert conditionals(g.lower(True, False, X).compile()) == 2


def test_constant_predicate_leaves_no_conditional() -> None:
  f = jax.jit(lambda x: lax.cond(True, jnp.sin, jnp.cos, x))
  compiled = f.lower(X).compile()
  assert conditionals(compiled) == 0
  np.testing.assert_allclose(np.asarray(f(X)), np.sin(np.asarray(X)), rtol=1e-6)


@cpu_only
def test_nested_conditional_is_counted() -> None:
  def outer(p: jax.Array, q: jax.Array, x: jax.Array) -> jax.Array:
    return lax.cond(p, lambda v: lax.cond(q, jnp.sin, jnp.cos, v), jnp.tanh, x)

  assert conditionals(jax.jit(outer).lower(True, True, X).compile()) == 2


# --- copies ---------------------------------------------------------------------------------


@cpu_only
def test_copies_in_cond_branches_are_data_copies() -> None:
  """Swapping two operands in one branch needs both copied (each branch's outputs)."""
  n = 4096
  f = jax.jit(lambda p, a, b: lax.cond(p, lambda a, b: (a, b), lambda a, b: (b, a), a, b))
  compiled = f.lower(True, jnp.ones(n), jnp.ones(n)).compile()
  found = copies(compiled, min_bytes=4 * n)
  assert found, "expected the branches to copy their operands into the outputs"
  for c in found:
    assert isinstance(c, Copy)
    assert (c.bytes, c.shape, c.fill) == (4 * n, (n,), False)
    assert c.context in ((("conditional", 0),), (("conditional", 1),))
  assert copies(compiled, min_bytes=4 * n + 1) == []


@cpu_only
def test_copy_of_a_zero_fill_is_a_fill() -> None:
  """XLA CSEs the two zero arrays into one broadcast and copies it into the second output."""
  n = 4096
  found = copies(jax.jit(lambda: (jnp.zeros(n), jnp.zeros(n))).lower().compile(), 1024)
  assert [(c.bytes, c.context, c.fill) for c in found] == [(4 * n, (), True)]


@cpu_only
def test_copy_of_an_argument_is_data() -> None:
  n = 4096
  found = copies(jax.jit(lambda x: (x, x + 1.0)).lower(jnp.ones(n)).compile(), 1024)
  assert [(c.bytes, c.shape, c.context, c.fill) for c in found] == [(4 * n, (n,), (), False)]


def test_copies_rejects_negative_min_bytes() -> None:
  with pytest.raises(ValueError, match="min_bytes"):
    copies(jax.jit(jnp.sin).lower(X).compile(), min_bytes=-1)


# --- the parser on hand-written HLO ---------------------------------------------------------

HLO = """\
HloModule m, entry_computation_layout={(pred[], bf16[16,8]{1,0})->bf16[16,8]{1,0}}

FileNames
1 "x.py"

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused (p: bf16[16,8]) -> bf16[16,8] {
  %p = bf16[16,8]{1,0} parameter(0)
  %neg = bf16[16,8]{1,0} negate(%p)
  ROOT %c.in.fusion = bf16[16,8]{0,1} copy(%neg)
}

%wrapped_copy_computation (q: bf16[16,8]) -> bf16[16,8] {
  %q = bf16[16,8]{1,0} parameter(0)
  ROOT %c.wrapped = bf16[16,8]{0,1} copy(%q)
}

%cond (t: (s32[], bf16[16,8])) -> pred[] {
  %t = (s32[], bf16[16,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (t.1: (s32[], bf16[16,8])) -> (s32[], bf16[16,8]) {
  %t.1 = (s32[], bf16[16,8]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%t.1), index=0
  %v = bf16[16,8]{1,0} get-tuple-element(%t.1), index=1
  %ar = bf16[16,8]{1,0} all-reduce(%v), replica_groups={}, to_apply=%add
  ROOT %r = (s32[], bf16[16,8]{1,0}) tuple(%i.1, /*index=1*/%ar)
}

%true_branch (x: bf16[16,8]) -> bf16[16,8] {
  %x = bf16[16,8]{1,0} parameter(0)
  %z = bf16[] constant(0)
  %zeros = bf16[16,8]{1,0} broadcast(%z), dimensions={}
  %zc = bf16[16,8]{1,0} copy(%zeros)
  %ag = (bf16[16,8]{1,0}, bf16[128,8]{1,0}) all-gather-start(%x), dimensions={0}
  ROOT %y = bf16[16,8]{1,0} add(%x, %zc)
}

%false_branch (x.2: bf16[16,8]) -> bf16[16,8] {
  %x.2 = bf16[16,8]{1,0} parameter(0)
  %i0 = s32[] constant(0)
  %init = (s32[], bf16[16,8]{1,0}) tuple(%i0, %x.2)
  %w = (s32[], bf16[16,8]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = bf16[16,8]{1,0} get-tuple-element(%w), index=1
}

ENTRY %main (p.0: pred[], arg: bf16[16,8]) -> bf16[16,8] {
  %p.0 = pred[] parameter(0)
  %arg = bf16[16,8]{1,0} parameter(1)
  %f = bf16[16,8]{0,1} fusion(%arg), kind=kLoop, calls=%fused
  %wc = bf16[16,8]{0,1} fusion(%f), kind=kLoop, calls=%wrapped_copy_computation
  %cp = bf16[16,8]{1,0} copy(%arg), metadata={op_name="jit(f)/while/body=x"}
  %cnd = bf16[16,8]{1,0} conditional(%p.0, %cp, %wc), true_computation=%true_branch, \
false_computation=%false_branch
  ROOT %sum = bf16[16,8]{1,0} all-reduce(%cnd), replica_groups={}, to_apply=%add
}
""".replace("\\\n", "")

BYTES = 16 * 8 * 2  # bf16[16,8]


def test_parser_collectives_on_hand_written_hlo() -> None:
  assert hlo_collectives(HLO) == [
      Collective("all-gather-start", BYTES + 8 * BYTES, "true_branch", (("conditional", 1),)),
      Collective("all-reduce", BYTES, "body", (("conditional", 0), ("while", "body"))),
      Collective("all-reduce", BYTES, "main", ()),
  ]


def test_parser_conditionals_and_copies_on_hand_written_hlo() -> None:
  assert conditionals(HLO) == 1
  got = copies(HLO)
  assert got == [
      # The fusion wrapping one copy is a copy; the copy inside %fused is not.
      Copy(BYTES, (16, 8), "main", (), "fusion", False),
      Copy(BYTES, (16, 8), "main", (), "parameter", False),
      Copy(BYTES, (16, 8), "true_branch", (("conditional", 1),), "broadcast", True),
  ]
  assert copies(HLO, min_bytes=BYTES + 1) == []
  assert math.prod(got[0].shape) * 2 == got[0].bytes


SHARED = """\
HloModule shared

%neg (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%a)
}

%same (b: f32[4]) -> f32[4] {
  ROOT %b = f32[4]{0} parameter(0)
}

%add (a.1: f32[], b.1: f32[]) -> f32[] {
  %a.1 = f32[] parameter(0)
  %b.1 = f32[] parameter(1)
  ROOT %s = f32[] add(%a.1, %b.1)
}

%sub (p: pred[], x: f32[4]) -> f32[4] {
  %p = pred[] parameter(0)
  %x = f32[4]{0} parameter(1)
  %r = f32[4]{0} all-reduce(%x), replica_groups={}, to_apply=%add
  ROOT %c = f32[4]{0} conditional(%p, %r, %r), true_computation=%neg, \
false_computation=%same
}

ENTRY %main (q: pred[], y: f32[4]) -> f32[4] {
  %q = pred[] parameter(0)
  %y = f32[4]{0} parameter(1)
  %first = f32[4]{0} call(%q, %y), to_apply=%sub
  ROOT %second = f32[4]{0} call(%q, %first), to_apply=%sub
}
""".replace("\\\n", "")


def test_a_computation_called_twice_is_walked_on_each_path() -> None:
  """A ``call`` runs its computation: ``conditionals`` counts the instruction once,
  ``opcodes`` and ``hlo_collectives`` every path that runs it; the all-reduce's
  ``to_apply`` reducer is not code the step runs."""
  assert conditionals(SHARED) == 1
  counts = opcodes(SHARED)
  assert counts["conditional"] == 2 and counts["call"] == 2 and counts["all-reduce"] == 2
  assert "add" not in counts
  assert hlo_collectives(SHARED) == [Collective("all-reduce", 16, "sub", ())] * 2


def test_opcodes_count_every_path_and_see_a_cond_turned_into_selects() -> None:
  counts = opcodes(HLO)
  # Copies: one in main, one in the true branch, and one inside each of two fusions.
  assert counts["conditional"] == 1 and counts["copy"] == 4 and counts["while"] == 1
  kept = jax.jit(lambda p, x: lax.cond(p, jnp.sin, jnp.cos, x)).lower(True, X).compile()
  selects = jax.jit(lambda p, x: jnp.where(p, jnp.sin(x), jnp.cos(x))).lower(True, X).compile()
  assert opcodes(kept).get("select", 0) == 0 and opcodes(selects)["select"] >= 1


def test_parser_rejects_text_without_an_entry() -> None:
  with pytest.raises(ValueError, match="ENTRY"):
    hlo_collectives("HloModule m\n")
  with pytest.raises(ValueError, match="ENTRY"):
    conditionals("not HLO at all")


@cpu_only
@pytest.mark.parametrize("fn", [hlo_collectives, conditionals, copies])
def test_accepts_compiled_or_text(fn: Callable[[Any], Any]) -> None:
  f = jax.jit(lambda p, x: lax.cond(p, jnp.sin, jnp.cos, x))
  compiled = f.lower(True, X).compile()
  assert fn(compiled) == fn(compiled.as_text())
