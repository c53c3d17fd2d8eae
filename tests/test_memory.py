"""Deterministic memory tests of the accumulation step (no timing).

Compiled temporaries come from ``jax.jit(f).lower(...).compile()
.memory_analysis().temp_size_in_bytes``, for a fixed XLA build a property of the
program. Conventions (see benchmarks/NOTES.md): the update level is
``f(state, g, p) -> (state, updates)`` donating the state (state first, so the
donated buffers go back to the state, not to the zero updates); the train-step
level is ``step(params, state, g) -> (params, state)`` donating both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_accum as oa
from optax_accum import debug
from tests._reference import xla_cpu_fact

N_PARAMS = 2**18  # 1 MiB of f32 params, in 8 leaves
LEAVES = 8
PARAM_BYTES = 4 * N_PARAMS
LEAF = N_PARAMS // LEAVES
# Temporaries besides parameter-sized arrays: a few scalars (counters, the
# cond's predicate). 0.05x of 1 MiB is ~52 KB: far above them, far below a leaf.
TIGHT = 0.05


def _tree(fill: float) -> dict[str, jax.Array]:
  return {f"w{i}": jnp.full((LEAF,), fill * (i + 1), jnp.float32) for i in range(LEAVES)}


PARAMS = _tree(0.01)
GRADS = _tree(0.001)


def _update_level(tx: optax.GradientTransformation, **kw: Any):
  """Compiled ``f(state, g, p) -> (state, updates)`` donating the state."""
  fn = jax.jit(lambda s, g, p: tx.update(g, s, p, **kw)[::-1], donate_argnums=(0,))
  return fn.lower(tx.init(PARAMS), GRADS, PARAMS).compile()


def _data_copies(compiled: Any) -> int:
  """Leaf-sized copies of a parameter, the buffer or the inner state (not of a
  zero broadcast): the copies a layout must avoid (``debug.copies``)."""
  return sum(not c.fill for c in debug.copies(compiled, min_bytes=4 * LEAF))


def _train_level(step: Callable, state: Any):
  """Compiled ``step(p, state, g) -> (p, state)`` donating params and state."""
  return jax.jit(step, donate_argnums=(0, 1)).lower(PARAMS, state, GRADS).compile()


def _temps(compiled) -> float:
  return compiled.memory_analysis().temp_size_in_bytes / PARAM_BYTES


CASES: dict[str, tuple[Callable[[int], optax.GradientTransformation], dict[str, Any]]] = {
    "sgd": (lambda k: oa.accumulate(k, optax.sgd(0.1)), {}),
    "adam": (lambda k: oa.accumulate(k, optax.adam(1e-3)), {}),
    "adam_skip_nonfinite": (
        lambda k: oa.accumulate(k, optax.adam(1e-3), skip_nonfinite=True), {}),
    "adam_weighted": (
        lambda k: oa.accumulate(k, optax.adam(1e-3), reduction="weighted"),
        {"weight": jnp.float32(3.0)}),
    "chain_form": (lambda k: oa.accumulate(k, None), {}),
    "adam_noise": (lambda k: oa.accumulate(k, optax.adam(1e-3), track_noise_scale=True), {}),
}


# On the protocol path (``update``, then ``apply_updates``) the emitting branch
# writes the updates into the buffer, dead once its window closed, so the
# conditional outputs nothing parameter-sized: on the GPU compiler, which the
# one layout is chosen for, the step holds no temporaries
# (``benchmarks/gpu_hlo.py``). XLA:CPU, where we only test, copies the buffer
# out of the conditional: at most the buffer once, one copy per leaf.
CPU_PROTOCOL = 1.05


@pytest.mark.parametrize("k", [4, 1], ids=["mid_program", "emit_program"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_accumulate_update_holds_at_most_the_buffer(case: str, k: int) -> None:
  make, kw = CASES[case]
  compiled = _update_level(make(k), **kw)
  assert _temps(compiled) <= CPU_PROTOCOL
  assert _data_copies(compiled) <= LEAVES


@xla_cpu_fact("bytes of memory_analysis() temporaries within CPU_PROTOCOL (on a TPU v5e the"
              " adam_noise programs held 3.2x the parameters)")
@pytest.mark.parametrize("k", [4, 1], ids=["mid_program", "emit_program"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_standard_path_holds_at_most_the_buffer(case: str, k: int) -> None:
  """``update`` + ``apply_updates`` (what Flax's TrainState does).

  ``update`` returns ``where(emitted, buffer, 0)``, which XLA fuses into
  ``apply_updates``. Returning the updates from the conditional as well cost
  1.0x params more (0.2.0).
  """
  make, kw = CASES[case]
  tx = make(k)

  def standard(p, s, g):
    updates, s = tx.update(g, s, p, **kw)
    return optax.apply_updates(p, updates), s

  compiled = _train_level(standard, tx.init(PARAMS))
  assert _temps(compiled) <= CPU_PROTOCOL
  assert _data_copies(compiled) <= LEAVES


@pytest.mark.parametrize("inner", ["sgd", "adam", "adam_skip_nonfinite"])
def test_update_and_apply_has_no_temporaries(inner: str) -> None:
  # skip_nonfinite: all(isfinite(g)) left XLA:CPU a bool array per leaf (0.25x).
  tx = oa.accumulate(4, optax.sgd(0.1) if inner == "sgd" else optax.adam(1e-3),
                     skip_nonfinite=inner.endswith("skip_nonfinite"))
  compiled = _train_level(lambda p, s, g: oa.update_and_apply(tx, g, s, p), tx.init(PARAMS))
  # 0 for both: the reduced gradient is scaled by a reciprocal, which XLA fuses
  # into the inner optimizer's fusions (a divide was materialised: 1.0x for
  # adam; see NOTES.md).
  assert _temps(compiled) <= TIGHT
  assert _data_copies(compiled) == 0


def test_update_and_apply_mid_step_leaves_params_in_place() -> None:
  tx = oa.accumulate(4, optax.adam(1e-3))
  compiled = _train_level(lambda p, s, g: oa.update_and_apply(tx, g, s, p), tx.init(PARAMS))
  # Params and state are both aliased to outputs: nothing parameter-sized is
  # allocated for the result beyond the new (non-donated) scalars.
  stats = compiled.memory_analysis()
  assert stats.alias_size_in_bytes >= 4 * PARAM_BYTES  # params, acc, mu, nu


def _inner_in_branch(compiled) -> bool:
  """Whether Adam's square roots all run inside a conditional's branch."""
  contexts = [site.context for site in debug._walk(compiled) if site.instruction.opcode == "sqrt"]
  return bool(contexts) and all(any(step[0] == "conditional" for step in c) for c in contexts)


@pytest.mark.parametrize("case", [
    pytest.param(case, marks=pytest.mark.catches("cond_as_selects")) if case == "adam" else case
    for case in sorted(CASES)])
def test_inner_optimizer_sits_in_a_conditional(case: str) -> None:
  """The design promise: the inner optimizer runs on emitting steps only."""
  make, kw = CASES[case]
  compiled = _update_level(make(4), **kw)
  assert debug.conditionals(compiled) >= 1
  if case.startswith("adam"):
    assert _inner_in_branch(compiled)


def _straight_line_param_sized_ops(compiled) -> list[str]:
  """Parameter-sized kernels that run on every call (outside any conditional)."""
  return [s.instruction.opcode for s in debug._walk(compiled)
          if s.context == () and not s.fused
          and s.instruction.opcode not in ("parameter", "get-tuple-element", "tuple", "bitcast")
          and s.instruction.type_str.startswith(f"f32[{LEAF}]")]


@xla_cpu_fact("the straight-line parameter-sized kernels: one fusion per leaf (a TPU's"
              " compiler adds copy-start/copy-done pairs)")
@pytest.mark.parametrize("make", [lambda k: oa.accumulate(k, optax.adam(1e-3)),
                                  lambda k: oa.MultiSteps(optax.adam(1e-3), k)],
                         ids=["accumulate", "MultiSteps"])
def test_update_and_apply_runs_only_the_add_on_every_step(make: Callable) -> None:
  """With ``update_and_apply`` no parameter-sized work runs outside the
  window's two conditionals: the add's (mid-steps) and the update's (emitting
  steps, which adds the micro-batch where the optimizer reads it). A mid-step
  touches neither the params nor the inner state; no copy anywhere."""
  tx = make(4)
  fast = _train_level(lambda p, s, g: oa.update_and_apply(tx, g, s, p), tx.init(PARAMS))
  assert _straight_line_param_sized_ops(fast) == []
  assert debug.conditionals(fast) == 2
  assert debug.copies(fast, min_bytes=4 * LEAF) == []


@pytest.mark.parametrize("case", sorted(CASES))
def test_emitting_branch_holds_a_barrier(case: str) -> None:
  """XLA's GPU compiler turns a conditional whose branches hold only cheap
  elementwise work into selects (its conditional simplifier), and then the
  inner optimizer runs every step. A non-elementwise op in the emitting
  branch keeps the conditional; XLA:CPU expands the barrier, so this checks
  the lowered program (benchmarks/results/gpu_hlo.md has the GPU compile)."""
  make, kw = CASES[case]
  tx = make(4)
  lowered = jax.jit(lambda s, g, p: tx.update(g, s, p, **kw)).lower(tx.init(PARAMS), GRADS, PARAMS)
  text = lowered.as_text()
  assert "stablehlo.case" in text or "stablehlo.if" in text
  assert "optimization_barrier" in text


def test_optax_multisteps_is_worse() -> None:
  """The regression the tests above would catch: optax.MultiSteps' design.

  It runs the inner optimizer on every mini-step and masks the result. On
  XLA:CPU that shows as temporaries (3x params in a train step); XLA:GPU
  fuses the masks but keeps no conditional either: Adam runs every step.
  """
  ms = optax.MultiSteps(optax.adam(1e-3), every_k_schedule=4)
  compiled = _update_level(ms)
  assert debug.conditionals(compiled) == 0
  if jax.default_backend() == "cpu":
    assert _temps(compiled) > 1.0


@pytest.mark.parametrize("noise", [False, True], ids=["plain", "noise"])
@pytest.mark.parametrize("fast", [False, True], ids=["update+apply", "update_and_apply"])
def test_the_add_is_named_for_profiles_on_every_path(fast: bool, noise: bool) -> None:
  """A profile names the window's kernels (docs/faq.md): the add's work carries
  ``optax_accum_add`` whichever conditionals the path takes."""
  tx = oa.accumulate(4, optax.adam(1e-3), track_noise_scale=noise)
  step = (lambda p, s, g: oa.update_and_apply(tx, g, s, p)) if fast else (
      lambda p, s, g: tx.update(g, s, p))
  text = jax.jit(step).lower(PARAMS, tx.init(PARAMS), GRADS).as_text(debug_info=True)
  assert "optax_accum_add" in text and "optax_accum_emit" in text
