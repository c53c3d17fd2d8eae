"""accumulate(k, optimizer) against an independent large-batch reference."""

from __future__ import annotations

import functools
import re
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum as oa
from tests._reference import (
  accumulate_run,
  assert_trees_close,
  grad_fn,
  init_params,
  large_batch_run,
  make_batches,
  make_windows,
)

K = 3
NUM_WINDOWS = 3
# SGD with momentum where the reduction is under test: Adam is invariant to
# the gradient's scale and would hide a wrong divisor.
SCALED = lambda: optax.sgd(0.1, momentum=0.9)

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "sgd_momentum_nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "lion": lambda: optax.lion(1e-3),
    "lamb": lambda: optax.lamb(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2),
    "rmsprop": lambda: optax.rmsprop(1e-2, momentum=0.5),
    "adabelief": lambda: optax.adabelief(1e-2),
    "clip_then_adam": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)),
    "scheduled_adam": lambda: optax.adam(optax.exponential_decay(1e-2, 1, 0.5)),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
}


# SGD, scale-sensitive, on whole windows: the mutants (tests/_mutants.py) it must catch.
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.catches(
    "mean_off_by_one_accumulate", "buffer_never_reset", "closing_micro_batch_dropped",
    "buffer_returned_on_mid_steps")) if name == "sgd" else name for name in sorted(OPTIMIZERS)])
def test_equals_large_batch_for_every_optimizer(name):
  params = init_params(jax.random.key(1))
  windows = make_windows(0, K, NUM_WINDOWS)
  ref = large_batch_run(OPTIMIZERS[name](), params, windows)
  got, state = accumulate_run(oa.accumulate(K, OPTIMIZERS[name]()), params, windows)
  for r, g in zip(ref, got, strict=True):
    assert_trees_close(r, g)
  assert int(state.gradient_step) == NUM_WINDOWS
  assert int(state.mini_step) == 0


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "nojit"])
def test_k1_is_the_plain_optimizer_step_for_step(jit):
  params = init_params(jax.random.key(2))
  batches = make_batches(jax.random.key(3), 5)
  tx, ref_tx = oa.accumulate(1, optax.adam(1e-2)), optax.adam(1e-2)
  state, ref_state, ref_params = tx.init(params), ref_tx.init(params), params
  update = jax.jit(tx.update) if jit else tx.update
  for batch in batches:
    updates, state = update(grad_fn(params, batch), state, params)
    ref_updates, ref_state = ref_tx.update(grad_fn(ref_params, batch), ref_state, ref_params)
    params = optax.apply_updates(params, updates)
    ref_params = optax.apply_updates(ref_params, ref_updates)
    assert bool(oa.has_updated(state))
  assert_trees_close(params, ref_params, rtol=1e-6, atol=1e-7)


def test_inner_optimizer_only_runs_on_emitting_steps():
  """Adam's step count and a schedule advance once per window, not per call."""
  calls = []

  def schedule(count):
    calls.append(count)
    return 1e-2 * 0.5 ** count

  params = init_params(jax.random.key(0))
  tx = oa.accumulate(4, optax.adam(schedule))
  state = tx.init(params)
  for batch in make_batches(jax.random.key(4), 8):
    _, state = tx.update(grad_fn(params, batch), state, params)
  adam_state = state.inner_opt_state[0]
  assert int(adam_state.count) == 2  # two windows, two Adam steps
  assert int(state.gradient_step) == 2


def test_mid_step_updates_are_zeros_of_gradient_shape_and_dtype():
  params = {"a": jnp.ones((2, 3), jnp.bfloat16), "b": jnp.ones((4,), jnp.float32)}
  tx = oa.accumulate(2, optax.sgd(0.1))
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, state = jax.jit(tx.update)(grads, state, params)
  chex.assert_trees_all_equal_shapes_and_dtypes(updates, grads)
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, grads))


def test_bf16_gradients_of_f32_params_reach_the_optimizer_unrounded():
  """The window's mean of bf16 gradients 1 and 2^-9 is 0.5 + 2^-10: a float32 number
  that bfloat16 rounds to 0.5. The optimizer sees it in the params' float32."""
  params = {"w": jnp.zeros(3, jnp.float32)}
  tx = oa.accumulate(2, optax.sgd(1.0))
  state = tx.init(params)
  update = jax.jit(tx.update)
  for g in (1.0, 2.0**-9):
    updates, state = update({"w": jnp.full(3, g, jnp.bfloat16)}, state, params)
  assert updates["w"].dtype == jnp.float32
  np.testing.assert_array_equal(updates["w"], np.full(3, -(0.5 + 2.0**-10), np.float32))


def test_chain_form_exact_for_stateless_inexact_for_stateful():
  params = init_params(jax.random.key(5))
  windows = make_windows(6, K, NUM_WINDOWS)
  # Stateless sgd after accumulate: exactly the large batch.
  ref = large_batch_run(optax.sgd(0.1), params, windows)
  got, _ = accumulate_run(optax.chain(oa.accumulate(K, None), optax.sgd(0.1)), params, windows)
  assert_trees_close(ref[-1], got[-1])
  # Adam after accumulate in a chain steps on the zeros of every mid-step.
  state = optax.chain(oa.accumulate(K, None), optax.adam(1e-2)).init(params)
  tx = optax.chain(oa.accumulate(K, None), optax.adam(1e-2))
  p = params
  for window in windows:
    for batch in window:
      u, state = tx.update(grad_fn(p, batch), state, p)
      p = optax.apply_updates(p, u)
  assert int(state[1][0].count) == K * NUM_WINDOWS  # Adam counted micro-steps
  ref_adam = large_batch_run(optax.adam(1e-2), params, windows)[-1]
  diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree.leaves(ref_adam), jax.tree.leaves(p), strict=True))
  assert diff > 1e-4, "chain form with adam unexpectedly matched the large batch"
  # The exact form puts Adam inside.
  exact, _ = accumulate_run(oa.accumulate(K, optax.adam(1e-2)), params, windows)
  assert_trees_close(ref_adam, exact[-1])


def test_sum_reduction():
  params = init_params(jax.random.key(7))
  windows = make_windows(8, K, 2)
  # sgd on the sum equals sgd with lr * k on the mean.
  ref = large_batch_run(optax.sgd(0.1 * K), params, windows)
  got, _ = accumulate_run(oa.accumulate(K, optax.sgd(0.1), reduction="sum"), params, windows)
  assert_trees_close(ref[-1], got[-1])


@pytest.mark.catches("weighted_divides_by_count", "weights_ignored")
def test_weighted_reduction_with_uneven_weights():
  params = init_params(jax.random.key(9))
  batches = make_batches(jax.random.key(10), 4)
  weights = [10.0, 1000.0, 3.0, 250.0]
  tx = oa.accumulate(4, SCALED(), reduction="weighted")
  state = tx.init(params)
  for b, w in zip(batches, weights, strict=True):
    updates, state = jax.jit(tx.update)(grad_fn(params, b), state, params, weight=w)
  grads = [grad_fn(params, b) for b in batches]
  weighted = jax.tree.map(
      lambda *g: sum(w * np.asarray(x, np.float64) for w, x in zip(weights, g, strict=True))
      / sum(weights), *grads)
  ref_tx = SCALED()
  ref_updates, _ = ref_tx.update(
      jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), weighted), ref_tx.init(params), params)
  assert_trees_close(updates, ref_updates)
  # The mean of means would be a different update.
  mean_updates, _ = ref_tx.update(
      jax.tree.map(lambda *g: sum(g) / 4, *grads), ref_tx.init(params), params)
  assert not np.allclose(updates["dense"]["w"], mean_updates["dense"]["w"], rtol=1e-3)


def test_weighted_zero_weight_micro_batch_and_zero_weight_window():
  params = {"w": jnp.ones(3)}
  tx = oa.accumulate(2, optax.adam(0.1), reduction="weighted")
  state = tx.init(params)
  update = jax.jit(tx.update)
  # An all-padding micro-batch: weight 0 and a NaN gradient (0/0 mean loss).
  _, state = update({"w": jnp.full(3, jnp.nan)}, state, params, weight=0.0)
  u, state = update({"w": jnp.full(3, 2.0)}, state, params, weight=5.0)
  ref_u, _ = optax.adam(0.1).update({"w": jnp.full(3, 2.0)}, optax.adam(0.1).init(params))
  chex.assert_trees_all_close(u, ref_u)
  # A window with total weight 0 is not a step: zero updates, Adam untouched,
  # gradient_step unchanged, has_updated False; the window is discarded.
  inner_before = state.inner_opt_state
  _, state = update({"w": jnp.full(3, jnp.nan)}, state, params, weight=0.0)
  u, state = update({"w": jnp.ones(3)}, state, params, weight=0.0)
  assert not bool(oa.has_updated(state))
  chex.assert_trees_all_equal(u, {"w": jnp.zeros(3)})
  chex.assert_trees_all_equal(state.inner_opt_state, inner_before)
  assert int(state.gradient_step) == 1 and int(state.mini_step) == 0
  assert float(state.acc_weight) == 0.0


@pytest.mark.catches("reset_by_multiplying")
def test_nan_never_poisons_a_later_window():
  params = {"w": jnp.ones(3)}
  tx = oa.accumulate(2, optax.sgd(1.0))
  state = tx.init(params)
  update = jax.jit(tx.update)
  _, state = update({"w": jnp.array([1.0, jnp.nan, 1.0])}, state, params)
  u, state = update({"w": jnp.ones(3)}, state, params)
  assert bool(jnp.isnan(u["w"][1]))  # the bad window is reported as it is
  _, state = update({"w": jnp.full(3, 2.0)}, state, params)
  u, state = update({"w": jnp.full(3, 4.0)}, state, params)
  chex.assert_trees_all_close(u, {"w": jnp.full(3, -3.0)})  # clean again


def test_optax_multisteps_is_poisoned_where_ours_is_not():
  """The anchor's bug, reproduced side by side, so the contrast stays true."""
  params = {"w": jnp.ones(3)}
  grads = [{"w": jnp.full(3, jnp.nan)}, {"w": jnp.ones(3)},
           {"w": jnp.full(3, 2.0)}, {"w": jnp.full(3, 4.0)}]
  theirs = optax.MultiSteps(optax.sgd(1.0), 2)
  ours = oa.MultiSteps(optax.sgd(1.0), 2)
  s_theirs, s_ours = theirs.init(params), ours.init(params)
  for g in grads:
    u_theirs, s_theirs = theirs.update(g, s_theirs, params)
    u_ours, s_ours = ours.update(g, s_ours, params)
  chex.assert_trees_all_close(u_ours, {"w": jnp.full(3, -3.0)})
  if not bool(jnp.isnan(u_theirs["w"]).any()):
    pytest.skip("optax.MultiSteps no longer propagates NaN across windows")


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_skip_nonfinite_drops_the_micro_batch(bad):
  params = init_params(jax.random.key(11))
  batches = make_batches(jax.random.key(12), 3)
  tx = oa.accumulate(3, SCALED(), skip_nonfinite=True)
  state = tx.init(params)
  update = jax.jit(tx.update)
  poisoned = jax.tree.map(lambda x: x.at[..., 0].set(bad), grad_fn(params, batches[0]))
  sequence = [grad_fn(params, batches[0]), poisoned, grad_fn(params, batches[1]),
              poisoned, grad_fn(params, batches[2])]
  for i, g in enumerate(sequence):
    updates, state = update(g, state, params)
    assert bool(oa.has_updated(state)) == (i == len(sequence) - 1)
  assert int(state.num_skipped) == 2
  ref = large_batch_run(SCALED(), params, [batches])[0]
  assert_trees_close(optax.apply_updates(params, updates), ref)


def test_skip_nonfinite_weight():
  params = {"w": jnp.ones(2)}
  tx = oa.accumulate(1, optax.sgd(1.0), reduction="weighted", skip_nonfinite=True)
  state = tx.init(params)
  u, state = tx.update({"w": jnp.ones(2)}, state, params, weight=jnp.nan)
  assert int(state.num_skipped) == 1 and not bool(oa.has_updated(state))
  chex.assert_trees_all_equal(u, {"w": jnp.zeros(2)})


def test_k_schedule_changes_window_length_without_recompiling():
  traces = []
  tx = oa.accumulate(lambda step: jnp.where(step < 2, 1, 3), optax.sgd(0.1))

  @jax.jit
  def step(g, s, p):
    traces.append(1)
    return tx.update(g, s, p)

  params = {"a": jnp.zeros([])}
  state = tx.init(params)
  emitted = []
  for _ in range(2 + 3 * 3):
    _, state = step({"a": jnp.ones([])}, state, params)
    emitted.append(bool(oa.has_updated(state)))
  assert emitted == [True, True] + [False, False, True] * 3
  assert len(traces) == 1


def test_k_schedule_below_one():
  with pytest.raises(ValueError, match="schedule returned 0"):
    oa.accumulate(lambda step: 0, optax.sgd(0.1))
  # Under jit a schedule that dips below 1 later is clamped to 1.
  tx = oa.accumulate(lambda step: jnp.where(step >= 1, 0, 2), optax.sgd(1.0))
  params = {"a": jnp.zeros([])}
  state = tx.init(params)
  update = jax.jit(tx.update)
  flags = []
  for _ in range(4):
    _, state = update({"a": jnp.ones([])}, state, params)
    flags.append(bool(oa.has_updated(state)))
  assert flags == [False, True, True, True]
  # Outside jit the concrete value is checked.
  state = tx.init(params)
  for _ in range(2):
    _, state = tx.update({"a": jnp.ones([])}, state, params)
  with pytest.raises(ValueError, match="returned 0 at gradient_step 1"):
    tx.update({"a": jnp.ones([])}, state, params)


@pytest.mark.catches("mean_divides_by_k")
def test_emit_now_flushes_a_partial_window():
  params = init_params(jax.random.key(13))
  batches = make_batches(jax.random.key(14), 2)
  tx = oa.accumulate(4, SCALED())
  state = tx.init(params)
  update = jax.jit(tx.update)
  u, state = update(grad_fn(params, batches[0]), state, params, emit_now=False)
  u, state = update(grad_fn(params, batches[1]), state, params, emit_now=True)
  assert bool(oa.has_updated(state)) and int(state.mini_step) == 0
  ref = large_batch_run(SCALED(), params, [batches])[0]
  assert_trees_close(optax.apply_updates(params, u), ref)


def test_donation_and_update_and_apply():
  params = init_params(jax.random.key(15))
  windows = make_windows(16, K, 2)
  ref = large_batch_run(optax.adam(1e-2), params, windows)[-1]
  tx = oa.accumulate(K, optax.adam(1e-2))

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(p, s, batch):
    return oa.update_and_apply(tx, grad_fn(p, batch), s, p)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step_protocol(p, s, batch):
    updates, s = tx.update(grad_fn(p, batch), s, p)
    return optax.apply_updates(p, updates), s

  for step_fn in (train_step, train_step_protocol):
    p = jax.tree.map(jnp.copy, params)
    s = tx.init(p)
    for window in windows:
      for batch in window:
        old_leaf = jax.tree.leaves(s.acc_grads)[0]
        p, s = step_fn(p, s, batch)
        assert old_leaf.is_deleted()  # the buffer was donated, not copied
    assert_trees_close(ref, p)


def test_update_and_apply_is_update_then_apply_for_any_other_transform():
  params = init_params(jax.random.key(21))
  grads = grad_fn(params, make_batches(jax.random.key(22), 1)[0])
  for tx in (optax.adam(1e-2), optax.chain(optax.clip(0.1), optax.sgd(0.5))):
    state = tx.init(params)
    got, got_state = jax.jit(lambda g, s, p, tx=tx: oa.update_and_apply(tx, g, s, p))(
        grads, state, params)
    updates, ref_state = tx.update(grads, state, params)
    chex.assert_trees_all_close(got, optax.apply_updates(params, updates))
    chex.assert_trees_all_close(got_state, ref_state)
  plain = optax.GradientTransformation(optax.identity().init, optax.identity().update)
  with pytest.raises(TypeError, match="takes no keyword"):
    oa.update_and_apply(plain, grads, plain.init(params), params, weight=2.0)
  with pytest.raises(TypeError, match="needs an optax transform"):
    oa.update_and_apply(object(), grads, (), params)


def test_lax_scan_over_many_windows():
  params = init_params(jax.random.key(17))
  windows = make_windows(18, K, 4)
  ref = large_batch_run(optax.adamw(1e-2), params, windows)[-1]
  tx = oa.accumulate(K, optax.adamw(1e-2))
  xs = jnp.stack([b[0] for w in windows for b in w])
  ys = jnp.stack([b[1] for w in windows for b in w])

  def body(carry, batch):
    p, s = carry
    u, s = tx.update(grad_fn(p, batch), s, p)
    return (optax.apply_updates(p, u), s), None

  (p, s), _ = jax.lax.scan(body, (params, tx.init(params)), (xs, ys))
  assert_trees_close(ref, p)
  assert int(s.gradient_step) == 4


def test_extra_args_reach_the_inner_optimizer():
  params = {"w": jnp.ones(2)}
  inner = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(factor=0.5, patience=0))
  tx = oa.accumulate(2, inner)
  state = tx.init(params)
  losses = [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
  for loss in losses:
    _, state = tx.update({"w": jnp.ones(2)}, state, params, value=jnp.asarray(loss))
  plateau = state.inner_opt_state[1]
  assert int(plateau.count) == 3 or float(plateau.scale) < 1.0  # it saw `value`
  assert float(plateau.scale) < 1.0


def test_has_updated_finds_the_state_inside_a_chain():
  tx = optax.chain(optax.clip(1.0), oa.accumulate(2, None))
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  _, state = tx.update({"w": jnp.ones(2)}, state, params)
  assert not bool(oa.has_updated(state))
  _, state = tx.update({"w": jnp.ones(2)}, state, params)
  assert bool(oa.has_updated(state))
  with pytest.raises(TypeError, match="has_updated"):
    oa.has_updated(optax.adam(1e-3).init(params))


# --- bad input ---------------------------------------------------------------

@pytest.mark.parametrize("k, exc", [
    (0, ValueError), (-2, ValueError), (2.5, TypeError), (True, TypeError),
    ("4", TypeError), (None, TypeError),
])
def test_bad_k(k, exc):
  with pytest.raises(exc, match="`k`"):
    oa.accumulate(k, optax.sgd(0.1))


def test_bad_options():
  with pytest.raises(ValueError, match=r"`reduction`.*'mean'"):
    oa.accumulate(2, None, reduction="avg")
  with pytest.raises(TypeError, match="accumulator_dtype"):
    oa.accumulate(2, None, accumulator_dtype=jnp.int32)
  with pytest.raises(TypeError, match="skip_nonfinite"):
    oa.accumulate(2, None, skip_nonfinite="yes")


def test_weight_misuse():
  params = {"w": jnp.zeros(2)}
  weighted = oa.accumulate(2, None, reduction="weighted")
  with pytest.raises(ValueError, match="needs a per-micro-batch weight"):
    weighted.update({"w": jnp.ones(2)}, weighted.init(params))
  with pytest.raises(ValueError, match="must be a scalar"):
    weighted.update({"w": jnp.ones(2)}, weighted.init(params), weight=jnp.ones(2))
  mean = oa.accumulate(2, None)
  with pytest.raises(ValueError, match="reduction='weighted'"):
    mean.update({"w": jnp.ones(2)}, mean.init(params), weight=3.0)


def test_tree_mismatch_names_the_first_differing_path():
  tx = oa.accumulate(2, optax.sgd(0.1))
  state = tx.init({"a": jnp.zeros(2), "b": {"c": jnp.zeros(3)}})
  with pytest.raises(ValueError,
                     match=r"\['b'\]\['d'\] in the gradients, \['b'\]\['c'\] in the state"):
    tx.update({"a": jnp.zeros(2), "b": {"d": jnp.zeros(3)}}, state)
  with pytest.raises(ValueError, match=r"\['b'\]\['c'\] has shape \(4,\)"):
    tx.update({"a": jnp.zeros(2), "b": {"c": jnp.zeros(4)}}, state)
  with pytest.raises(ValueError, match=r"\['z'\] in the gradients, nothing in the state"):
    tx.update({"a": jnp.zeros(2), "b": {"c": jnp.zeros(3)}, "z": jnp.zeros(1)}, state)
  with pytest.raises(TypeError, match="AccumulateState"):
    tx.update({"a": jnp.zeros(2)}, optax.EmptyState())


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (tests/conftest.py)")
@pytest.mark.catches("scalars_averaged_across_devices")
def test_axis_name_window_is_the_mean_over_every_device():
  """Under pmap each device adds its own micro-batches; the window's mean
  divides by all of them (the devices' counts summed): the large batch."""
  n = 2
  params = init_params(jax.random.key(21))
  windows = make_windows(22, K * n, 2)  # K micro-batches per device and window
  tx = oa.accumulate(K, SCALED(), axis_name="d")
  p = jax.tree.map(lambda x: jnp.stack([x] * n), params)
  state = jax.pmap(tx.init)(p)

  @functools.partial(jax.pmap, axis_name="d")
  def step(p, s, batch):
    updates, s = tx.update(grad_fn(p, batch), s, p)
    return optax.apply_updates(p, updates), s

  for window in windows:
    for i in range(K):
      p, state = step(p, state, jax.tree.map(lambda *xs: jnp.stack(xs), *window[i::K]))
  assert_trees_close(jax.tree.map(lambda x: x[0], p),
                     large_batch_run(SCALED(), params, windows)[-1])


def test_shard_map_rejects_gradients_already_reduced_over_the_axis():
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
  tx = oa.accumulate(1, optax.sgd(1.0), axis_name="d")

  def step(p, s, x):
    g = jax.grad(lambda q: jnp.mean(x @ q))(p)  # w.r.t. replicated p: already summed
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("d")),
                            out_specs=(P(), P())))
  with pytest.raises(ValueError, match=r"already reduced over 'd'.*pcast"):
    f(jnp.zeros(3), tx.init(jnp.zeros(3)), jnp.ones((8, 3)))


def test_has_updated_on_a_flax_nnx_optimizer_state():
  nnx = pytest.importorskip("flax.nnx")

  class Model(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones(2))

  model = Model()
  opt = nnx.Optimizer(model, oa.accumulate(2, optax.sgd(0.1)), wrt=nnx.Param)
  grads = nnx.grad(lambda m: jnp.sum(m.w[...] ** 2))(model)
  flags = []
  for _ in range(4):
    opt.update(model, grads)
    flags.append(bool(oa.has_updated(opt.opt_state)))
  assert flags == [False, True, False, True]


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "nojit"])
@pytest.mark.catches("mean_divides_by_k")
def test_flush_closes_a_partial_window_without_a_new_micro_batch(jit):
  params = init_params(jax.random.key(19))
  batches = make_batches(jax.random.key(20), 3)
  tx = oa.accumulate(5, SCALED())
  update = jax.jit(tx.update) if jit else tx.update
  flush = jax.jit(functools.partial(oa.flush, tx)) if jit else functools.partial(oa.flush, tx)
  state = tx.init(params)
  for b in batches:
    _, state = update(grad_fn(params, b), state, params)
  updates, state = flush(state, params)
  assert bool(oa.has_updated(state)) and int(state.mini_step) == 0
  ref = large_batch_run(SCALED(), params, [batches])[0]
  assert_trees_close(optax.apply_updates(params, updates), ref)
  # An empty window: nothing to flush, nothing changes.
  before = state
  updates, state = flush(state, params)
  assert not bool(oa.has_updated(state))
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))
  chex.assert_trees_all_equal(state.inner_opt_state, before.inner_opt_state)
  assert int(state.gradient_step) == int(before.gradient_step) == 1


@pytest.mark.catches("weighted_divides_by_count")
def test_flush_weighted_window_and_bad_transform():
  params = {"w": jnp.zeros(2)}
  tx = oa.accumulate(4, optax.sgd(1.0), reduction="weighted")
  state = tx.init(params)
  _, state = tx.update({"w": jnp.full(2, 1.0)}, state, params, weight=1.0)
  _, state = tx.update({"w": jnp.full(2, 4.0)}, state, params, weight=3.0)
  updates, state = oa.flush(tx, state, params)
  chex.assert_trees_all_close(updates, {"w": jnp.full(2, -(1.0 + 12.0) / 4.0)})
  # Through a chain: clip sees the placeholder zeros, the window is flushed.
  chained = optax.chain(optax.clip(10.0), oa.accumulate(4, optax.sgd(1.0), reduction="weighted"))
  state = chained.init(params)
  _, state = chained.update({"w": jnp.full(2, 1.0)}, state, params, weight=1.0)
  _, state = chained.update({"w": jnp.full(2, 4.0)}, state, params, weight=3.0)
  updates, state = oa.flush(chained, state, params)
  chex.assert_trees_all_close(updates, {"w": jnp.full(2, -(1.0 + 12.0) / 4.0)})
  assert bool(oa.has_updated(state))
  with pytest.raises(TypeError, match="`flush` needs an optax transform"):
    oa.flush(object(), state, params)


def test_accumulate_without_an_optimizer_warns_and_names_the_exact_form():
  """``optax.chain(accumulate(k), adam)`` is the line a reader writes from the package's
  description: it keeps working (exact for a stateless transform after it), and warns
  with the cause and the exact form for a stateful one; never an error."""
  with pytest.warns(UserWarning) as caught:
    tx = optax.chain(oa.accumulate(K), optax.sgd(0.5))
  message = str(caught[0].message)
  assert re.search(r"optax\.chain\(accumulate\(k\), optax\.adam\(lr\)\).*moments decay"
                   r".*`accumulate\(k, optax\.adam\(lr\)\)`.*`accumulate\(k, None\)`", message)
  assert "next release" not in message and "error" not in message
  params = {"w": jnp.zeros(3)}
  state = tx.init(params)
  for i in range(K):  # the chain form with plain SGD: one step on the mean gradient
    updates, state = tx.update({"w": jnp.full(3, float(i))}, state, params)
    params = optax.apply_updates(params, updates)
  np.testing.assert_allclose(params["w"], -0.5 * np.mean(np.arange(K)), rtol=1e-6)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    oa.accumulate(K, None)  # the chain form, asked for explicitly
    oa.accumulate(K, optax.adam(1e-2))


@pytest.mark.parametrize("name, where", [
    ("per_device_state", "optax_accum.sharding"), ("all_finite", "optax_accum.precision"),
    ("AdaptiveK", "optax_accum.gradient_noise"),
    ("split_microbatches", "optax_accum.microbatching"),
    ("skip_not_finite", "optax"), ("MultiStepsState", "optax"),
])
def test_names_moved_from_the_top_level_warn_and_still_work(name, where):
  """0.2.0's top-level names keep one release of deprecation aliases, outside ``__all__``."""
  import importlib
  assert name not in oa.__all__
  with pytest.warns(DeprecationWarning, match=rf"`optax_accum.{name}`.*`{where}.{name}`"):
    alias = getattr(oa, name)
  assert alias is getattr(importlib.import_module(where), name)
  with pytest.raises(AttributeError):
    oa.no_such_name  # noqa: B018


def test_apply_and_flush_are_documented_update_keywords():
  """``update_and_apply`` and ``flush`` are ``update(..., apply=True)`` and
  ``update(..., flush=True)``: visible keywords, the same through a chain."""
  params = {"w": jnp.zeros(2)}
  for tx in (oa.accumulate(2, optax.sgd(1.0)),
             optax.chain(optax.identity(), oa.accumulate(2, optax.sgd(1.0))),
             oa.MultiSteps(optax.sgd(1.0), 2).gradient_transformation()):
    state = tx.init(params)
    out, state = tx.update({"w": jnp.ones(2)}, state, params, apply=True)
    assert isinstance(out, oa.accumulation.Applied)
    np.testing.assert_array_equal(out.params["w"], params["w"])  # a mid-step: untouched
    updates, state = tx.update({"w": jnp.zeros(2)}, state, params, flush=True)
    np.testing.assert_allclose(updates["w"], -1.0)  # the one waiting micro-batch, alone
    assert int(oa.has_updated(state))
  with pytest.raises(TypeError, match="`apply` must be a bool"):
    oa.accumulate(2, optax.sgd(1.0)).update({"w": jnp.ones(2)},
                                            oa.accumulate(2, optax.sgd(1.0)).init(params),
                                            params, apply="yes")
