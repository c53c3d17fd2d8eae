"""optax_accum.debug: the HLO reader, checked on programs whose answer is known.

Two kinds of reference: small jitted programs where the placement of each
collective, conditional and copy follows from the program itself (a psum
written in one branch of a cond must be reported in that branch, and nowhere
else), and a hand-written HLO module that pins the parser's mechanics (tuple
types, index comments, nested calls) independently of the XLA version.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import optax_accum as oa
from optax_accum import _window
from optax_accum.debug import (
  Collective,
  Copy,
  conditionals,
  copies,
  hlo_collectives,
  step_bytes,
  step_kernels,
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


def _uaa_program(leaves: int = 8) -> Any:
  tx = oa.accumulate(4, optax.adam(1e-3))
  params = {f"w{i}": jnp.full((4096,), 0.1 * i) for i in range(leaves)}
  step = jax.jit(lambda p, s, g: oa.update_and_apply(tx, g, s, p), donate_argnums=(0, 1))
  return step.lower(params, tx.init(params), params).compile()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's fusion decisions")
def test_step_kernels_puts_the_inner_optimizer_on_the_emitting_step() -> None:
  """XLA:CPU runs Adam as three loops per leaf and the buffer add as one. With
  ``update_and_apply`` the add runs before the window's one conditional: a
  mid-step launches it (one kernel per leaf) and no Adam loop; the emitting
  step launches the add and Adam's loops. Counting branch 1 as the emit (the
  rule for one conditional) puts the inner optimizer there."""
  program = _uaa_program(8)
  assert conditionals(program) == 1
  k = step_kernels(program)
  assert 8 <= k["mid"] < 8 + 8, k
  assert k["emit"] >= 3 * 8 + 8, k


def test_step_kernels_without_our_scopes_counts_both_steps(
    monkeypatch: pytest.MonkeyPatch) -> None:
  """Branches it cannot place (not optax_accum's) count on both steps."""
  monkeypatch.setattr(_window, "SCOPES", {k: f"other_{k}" for k in _window.SCOPES})
  k = step_kernels(_uaa_program(8))
  assert k["mid"] == k["emit"], k
  plain_cond = jax.jit(lambda p, x: lax.cond(p, jnp.sin, jnp.cos, x))
  k = step_kernels(plain_cond.lower(True, jnp.ones(4)).compile())
  assert k["mid"] == k["emit"] >= 2, k  # sin and cos both counted


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


def test_parser_rejects_text_without_an_entry() -> None:
  with pytest.raises(ValueError, match="ENTRY"):
    hlo_collectives("HloModule m\n")
  with pytest.raises(ValueError, match="ENTRY"):
    conditionals("not HLO at all")


# --- the old import path --------------------------------------------------------------------


def test_sharding_alias_warns_and_is_the_same_function() -> None:
  import optax_accum.sharding as sharding

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    alias = sharding.hlo_collectives
    collective = sharding.Collective
  assert alias is hlo_collectives and collective is Collective
  assert [w.category for w in caught] == [DeprecationWarning, DeprecationWarning]
  assert "optax_accum.debug" in str(caught[0].message)
  with pytest.raises(AttributeError):
    sharding.no_such_name  # noqa: B018


@cpu_only
@pytest.mark.parametrize("fn", [hlo_collectives, conditionals, copies])
def test_accepts_compiled_or_text(fn: Callable[[Any], Any]) -> None:
  f = jax.jit(lambda p, x: lax.cond(p, jnp.sin, jnp.cos, x))
  compiled = f.lower(True, X).compile()
  assert fn(compiled) == fn(compiled.as_text())


# ------------------------------------------------------------------ step_bytes
# Hand-written: a fusion reading a 64 KiB parameter only through a slice, an
# in-place dynamic-update-slice fusion, an async copy, a conditional of
# unknown role (both of its branches count on both steps), and a TPU-style
# prefetch into another memory space read by a fusion.
BYTES_HLO = """\
HloModule bytes

%sliced (param_0: f32[16384]) -> f32[1024] {
  %param_0 = f32[16384]{0} parameter(0)
  ROOT %s = f32[1024]{0} slice(%param_0), slice={[0:1024]}
}

%dus (param_0.1: f32[16384], param_1.1: f32[1024], param_2.1: s32[]) -> f32[16384] {
  %param_0.1 = f32[16384]{0} parameter(0)
  %param_1.1 = f32[1024]{0} parameter(1)
  %param_2.1 = s32[] parameter(2)
  ROOT %d = f32[16384]{0} dynamic-update-slice(%param_0.1, %param_1.1, %param_2.1)
}

%double (param_0.2: f32[16384]) -> f32[16384] {
  %param_0.2 = f32[16384]{0} parameter(0)
  ROOT %m = f32[16384]{0} add(%param_0.2, %param_0.2)
}

%yes (a: f32[16384]) -> f32[16384] {
  %a = f32[16384]{0} parameter(0)
  ROOT %f = f32[16384]{0} fusion(%a), kind=kLoop, calls=%double
}

%no (b: f32[16384]) -> f32[16384] {
  ROOT %b = f32[16384]{0} parameter(0)
}

ENTRY %main (x: f32[16384], i: s32[], p: pred[]) -> \\
(f32[1024], f32[16384], f32[16384], f32[16384]) {
  %x = f32[16384]{0} parameter(0)
  %i = s32[] parameter(1)
  %p = pred[] parameter(2)
  %head = f32[1024]{0} fusion(%x), kind=kLoop, calls=%sliced
  %upd = f32[16384]{0} fusion(%x, %head, %i), kind=kLoop, calls=%dus
  %cs = (f32[16384]{0}, f32[16384]{0}, u32[]) copy-start(%upd)
  %cd = f32[16384]{0} copy-done(%cs)
  %c = f32[16384]{0} conditional(%p, %cd, %cd), true_computation=%yes, false_computation=%no
  %vs = (f32[16384]{0:S(1)}, f32[16384]{0}, u32[]{:S(2)}) copy-start(%x)
  %vd = f32[16384]{0:S(1)} copy-done(%vs)
  %v = f32[16384]{0} fusion(%vd), kind=kLoop, calls=%double
  ROOT %t = (f32[1024]{0}, f32[16384]{0}, f32[16384]{0}, f32[16384]{0}) tuple(%head, %cd, %c, %v)
}
""".replace("\\\n", "")


def test_step_bytes_on_hand_written_hlo() -> None:
  kib = 1024 * 4  # f32[1024]
  want = (
      2 * kib  # the slice: reads 1024 of 16384 elements, writes 1024
      + 2 * kib + 4  # the in-place update: reads and writes the update; reads the index
      + 2 * 16 * kib  # the async copy: 64 KiB each way, counted at its copy-done
      + 2 * 16 * kib  # the true branch's fusion (a conditional of unknown role)
      + 16 * kib  # the prefetch into on-chip memory (S(1)): one read of main memory
      + 16 * kib  # the fusion reading the prefetched copy: only its result is written
  )
  assert step_bytes(BYTES_HLO) == {"mid": want, "emit": want}


@cpu_only
@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_step_bytes_counts_each_steps_passes(inner: str) -> None:
  """Parameter-sized passes per step, from the design (XLA:CPU's fusion).

  ``update_and_apply`` mid-step: read g and the buffer, write the buffer
  (3P); its emitting step does the plain step's work plus at least one read
  of the buffer; the protocol's mid-step adds ``apply_updates`` (read params
  and the masked updates, write params: 3P) and XLA:CPU's copy of the buffer
  out of the conditional (2P): 8P; ``optax.MultiSteps`` runs the
  optimizer on every step, so its mid-step costs at least the plain step.
  """
  opt = {"sgd": optax.sgd(0.1), "adam": optax.adam(1e-3)}[inner]
  params = {f"w{i}": jnp.full((8192,), 0.1 * i) for i in range(4)}
  pbytes = 4 * 8192 * 4
  tx = oa.accumulate(4, opt)
  ms = optax.MultiSteps(opt, 4).gradient_transformation()

  def passes(step: Callable[..., Any], state: Any) -> dict[str, float]:
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile()
    return {k: v / pbytes for k, v in step_bytes(compiled).items()}

  def protocol(t: Any) -> Callable[..., Any]:
    def step(p: Any, s: Any, g: Any) -> Any:
      u, s = t.update(g, s, p)
      return optax.apply_updates(p, u), s
    return step

  plain = passes(protocol(opt), opt.init(params))
  uaa = passes(lambda p, s, g: oa.update_and_apply(tx, g, s, p), tx.init(params))
  std = passes(protocol(tx), tx.init(params))
  optax_ms = passes(protocol(ms), ms.init(params))
  assert plain["mid"] == plain["emit"] >= (3 if inner == "sgd" else 7)
  assert uaa["mid"] == pytest.approx(3, abs=0.01)
  assert std["mid"] == pytest.approx(8, abs=0.01)
  assert uaa["emit"] >= plain["emit"] + 1 - 0.01
  assert std["emit"] > uaa["emit"]  # the updates go through memory to apply_updates
  assert optax_ms["mid"] >= plain["mid"]
