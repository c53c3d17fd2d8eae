"""No silently wrong answer: dtypes, weights, keywords, drop-in MultiSteps.

Each test here reproduces an input that gave a wrong number without a word
in 0.1.0 and checks the fix against an independent reference (numpy in
float64/complex128, or optax itself). SGD is the inner optimizer wherever a
wrong divisor could hide: Adam is invariant to the gradient's scale.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_accum as oa


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


def _run(tx, grads_seq, params, **kw_seq):
  """Feeds a sequence of gradients (kwargs per step as lists); returns all updates."""
  state = tx.init(params)
  out = []
  update = jax.jit(tx.update)
  for i, g in enumerate(grads_seq):
    kw = {k: v[i] for k, v in kw_seq.items()}
    u, state = update(g, state, params, **kw)
    out.append(u)
  return out, state


# --- 1, 2: the buffer is never narrower than the gradients ------------------------------------


def test_complex_gradients_keep_their_imaginary_part():
  params = {"z": jnp.zeros(3, jnp.complex64)}
  grads = [{"z": jnp.array([1 + 2j, 3 - 1j, -2j], jnp.complex64)},
           {"z": jnp.array([3 + 0j, 1 + 1j, 4 + 4j], jnp.complex64)}]
  tx = oa.accumulate(2, optax.sgd(1.0))
  state = tx.init(params)
  assert state.acc_grads["z"].dtype == jnp.complex64
  update = jax.jit(tx.update)  # jit or not, the same program
  for g in grads:
    u, state = update(g, state, params)
  expected = -np.mean([np.asarray(g["z"], np.complex128) for g in grads], axis=0)
  np.testing.assert_allclose(np.asarray(u["z"]), expected, rtol=1e-6)
  assert np.abs(np.imag(np.asarray(u["z"]))).max() >= 1.0  # a real buffer gives 0


def test_real_accumulator_for_complex_gradients_is_an_error():
  params = {"z": jnp.zeros(2, jnp.complex64)}
  with pytest.raises(TypeError, match="imaginary part"):
    oa.accumulate(2, optax.sgd(1.0), accumulator_dtype=jnp.float32).init(params)
  tx = oa.accumulate(2, optax.sgd(1.0))
  state = tx.init({"z": jnp.zeros(2, jnp.float32)})  # real params, complex gradients
  with pytest.raises(TypeError, match="imaginary part"):
    tx.update({"z": jnp.ones(2, jnp.complex64)}, state)


def test_float64_keeps_a_signal_float32_would_lose(x64):
  params = {"w": jnp.zeros(2, jnp.float64)}
  big, tiny = 1.0, 1e-12
  grads = [{"w": jnp.array([big, big], jnp.float64)},
           {"w": jnp.array([tiny - big, -big], jnp.float64)}]
  for tx in (oa.accumulate(2, optax.sgd(1.0)), oa.MultiSteps(optax.sgd(1.0), 2)):
    state = tx.init(params)
    assert state.acc_grads["w"].dtype == jnp.float64
    for g in grads:
      u, state = tx.update(g, state, params)
    expected = -(np.asarray(grads[0]["w"]) + np.asarray(grads[1]["w"])) / 2  # ~ -tiny / 2
    # Within a few float64 ulps of the inputs (1.0); float32 would give 0.
    np.testing.assert_allclose(np.asarray(u["w"]), expected, rtol=0, atol=1e-15)
    assert float(u["w"][0]) < -4e-13
  # The explicit float32 buffer (asked for) loses it, as documented.
  tx = oa.accumulate(2, optax.sgd(1.0), accumulator_dtype=jnp.float32)
  state = tx.init(params)
  for g in grads:
    u, state = tx.update(g, state, params)
  assert float(u["w"][0]) == 0.0


def test_gradient_wider_than_the_buffer_is_an_error(x64):
  tx = oa.accumulate(2, optax.sgd(1.0))
  state = tx.init({"w": jnp.zeros(2, jnp.float32)})
  with pytest.raises(TypeError, match="wider than the float32 accumulator"):
    tx.update({"w": jnp.ones(2, jnp.float64)}, state)


DTYPES = {
    "bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32, "f64": jnp.float64,
    "c64": jnp.complex64,
}
TOL = {"bf16": 1e-2, "f16": 2e-3, "f32": 2e-6, "f64": 1e-12, "c64": 2e-6}


@functools.cache
def _jitted_update(k, reduction, skip):
  """One transform and its jitted update per setting, shared by the examples (they
  recompile only for a new dtype)."""
  tx = oa.accumulate(k, None, reduction=reduction, skip_nonfinite=skip)
  return tx, jax.jit(tx.update)


@settings(max_examples=25, deadline=None)
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    reduction=st.sampled_from(["mean", "sum", "weighted"]),
    k=st.integers(1, 4),
    weights=st.lists(st.sampled_from([0.0, 1.0, 3.0, 17.0, float("nan"), -2.0]),
                     min_size=4, max_size=4),
    skip=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_emitted_gradient_against_a_wide_reference(dtype, reduction, k, weights, skip, seed):
  """The chain form emits the reduced gradient itself: compare it with numpy.

  Weights are traced (inside jit), so a negative one acts like NaN: skipped
  with ``skip_nonfinite``, else a NaN update that is still a step.
  """
  with jax.enable_x64(dtype == "f64"):
    rng = np.random.default_rng(seed)
    raw = rng.normal(size=(k, 5)) + (1j * rng.normal(size=(k, 5)) if dtype == "c64" else 0)
    grads = [{"g": jnp.asarray(r, DTYPES[dtype])} for r in raw]
    params = {"g": jnp.zeros(5, DTYPES[dtype])}
    tx, update = _jitted_update(k, reduction, skip)
    state = tx.init(params)
    kept = []
    for i, g in enumerate(grads):
      kw, w_eff = {}, 1.0
      if reduction == "weighted":
        kw["weight"] = jnp.float32(weights[i])
        w_eff = weights[i] if weights[i] >= 0 else float("nan")
      if not (skip and not np.isfinite(w_eff)):
        kept.append((w_eff, np.asarray(g["g"]).astype(np.complex128)))
      u, state = update(g, state, params, **kw)
    if len(kept) < k:  # skipped micro-batches do not count: the window is still open
      assert not bool(oa.has_updated(state)) and int(state.mini_step) == len(kept)
      assert int(state.num_skipped) == k - len(kept)
      return
    ws = np.asarray([w for w, _ in kept])
    gs = [g for _, g in kept]
    if reduction == "weighted" and np.isnan(ws).any():
      assert bool(oa.has_updated(state)) and np.isnan(np.asarray(u["g"])).all()
      return
    if reduction == "weighted" and ws.sum() == 0:
      assert not bool(oa.has_updated(state)) and int(state.gradient_step) == 0
      chex.assert_trees_all_equal(u, jax.tree.map(jnp.zeros_like, u))
      return
    if reduction == "mean":
      ref = np.mean(gs, axis=0)
    elif reduction == "sum":
      ref = np.sum(gs, axis=0)
    else:
      ref = np.sum([w * g for w, g in kept if w != 0], axis=0) / ws.sum()
    assert bool(oa.has_updated(state))
    assert u["g"].dtype == DTYPES[dtype]
    got = np.asarray(u["g"]).astype(np.complex128)
    assert np.abs(got - ref).max() <= TOL[dtype] * max(np.abs(ref).max(), 1.0), (got, ref)


# --- 3: weights -------------------------------------------------------------------------------


def test_nan_weight_reaches_the_update_or_is_skipped():
  params = {"w": jnp.zeros(2)}
  grads = [{"w": jnp.ones(2)}, {"w": jnp.full(2, 3.0)}]
  # Without skipping: a NaN weight is a NaN update, and it is a step.
  updates, state = _run(oa.accumulate(2, optax.sgd(1.0), reduction="weighted"),
                        grads, params, weight=[jnp.float32(jnp.nan), jnp.float32(1.0)])
  assert np.isnan(np.asarray(updates[-1]["w"])).all()
  assert int(state.gradient_step) == 1
  # With skipping: dropped, counted, the window waits for one more.
  tx = oa.accumulate(2, optax.sgd(1.0), reduction="weighted", skip_nonfinite=True)
  updates, state = _run(tx, [*grads, {"w": jnp.full(2, 5.0)}], params,
                        weight=[jnp.float32(jnp.nan), 1.0, 3.0])
  assert int(state.num_skipped) == 1 and int(state.gradient_step) == 1
  chex.assert_trees_all_close(updates[-1], {"w": jnp.full(2, -(3.0 + 15.0) / 4.0)})


def test_negative_weight():
  params = {"w": jnp.zeros(2)}
  tx = oa.accumulate(2, optax.sgd(1.0), reduction="weighted")
  with pytest.raises(ValueError, match="`weight` must be >= 0"):
    tx.update({"w": jnp.ones(2)}, tx.init(params), params, weight=-1.0)
  # Traced, it cannot be checked: it acts like a non-finite weight.
  updates, state = _run(tx, [{"w": jnp.ones(2)}] * 2, params,
                        weight=[jnp.float32(-1.0), jnp.float32(2.0)])
  assert np.isnan(np.asarray(updates[-1]["w"])).all()
  tx = oa.accumulate(2, optax.sgd(1.0), reduction="weighted", skip_nonfinite=True)
  updates, state = _run(tx, [{"w": jnp.ones(2)}] * 2, params,
                        weight=[jnp.float32(-1.0), jnp.float32(2.0)])
  assert int(state.num_skipped) == 1 and int(state.mini_step) == 1


@pytest.mark.parametrize("axis", [
    pytest.param(False, marks=pytest.mark.catches("zero_weight_made_positive")),
    pytest.param(True, marks=pytest.mark.skipif(jax.device_count() < 2, reason="pmap on 2"))],
    ids=["one_device", "pmap"])
def test_zero_weight_window_is_not_a_step(axis):
  params = {"w": jnp.ones(2)}
  tx = oa.accumulate(2, optax.sgd(0.5, momentum=0.9), reduction="weighted",
                     axis_name="d" if axis else None)
  init, update = tx.init, tx.update
  n = 2 if axis else 1
  if axis:
    init = jax.pmap(init, axis_name="d")
    update = jax.pmap(update, axis_name="d")
    params = jax.tree.map(lambda x: jnp.stack([x] * n), params)
  state = init(params)
  rep = lambda v: jnp.full((n,), v, jnp.float32) if axis else jnp.float32(v)
  g = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), params)
  for _ in range(2):  # padding only: weight 0 and NaN gradients
    u, state = update(g, state, params, weight=rep(0.0))
  assert not np.asarray(oa.has_updated(state)).any()
  assert (np.asarray(state.gradient_step) == 0).all() and (np.asarray(state.mini_step) == 0).all()
  chex.assert_trees_all_equal(u, jax.tree.map(jnp.zeros_like, params))
  chex.assert_trees_all_equal(state.inner_opt_state, init(params).inner_opt_state)
  # The next window is a normal step: momentum starts from zero.
  ones = jax.tree.map(jnp.ones_like, params)
  for _ in range(2):
    u, state = update(ones, state, params, weight=rep(1.0))
  assert np.asarray(oa.has_updated(state)).all() and (np.asarray(state.gradient_step) == 1).all()
  np.testing.assert_allclose(np.asarray(u["w"]), -0.5)


# --- 4: misspelled keywords -------------------------------------------------------------------


@pytest.mark.parametrize("typo", ["emitnow", "wieght", "emit_nwo", "Weight"])
def test_misspelling_of_our_keywords_is_an_error(typo):
  params = {"w": jnp.zeros(2)}
  tx = oa.accumulate(2, optax.adam(0.1))  # a chain: it would forward the keyword
  with pytest.raises(TypeError, match=f"`{typo}=`.*did you mean"):
    tx.update({"w": jnp.ones(2)}, tx.init(params), params, **{typo: True})


@pytest.mark.parametrize("kind", ["accumulate", "MultiSteps"])
def test_any_unknown_keyword_is_an_error_when_the_inner_optimizer_takes_none(kind):
  params = {"w": jnp.zeros(2)}
  inner = optax.scale_by_adam()  # a plain GradientTransformation: no extra args
  tx = oa.accumulate(2, inner) if kind == "accumulate" else oa.MultiSteps(inner, 2)
  with pytest.raises(TypeError, match="valeu"):
    tx.update({"w": jnp.ones(2)}, tx.init(params), params, valeu=1.0)


def test_extra_args_still_reach_optimizers_that_take_them():
  params = {"w": jnp.ones(2)}
  plateau = optax.contrib.reduce_on_plateau(factor=0.5, patience=0)
  inner = optax.chain(optax.sgd(1.0), plateau)
  for tx in (oa.accumulate(1, inner), oa.MultiSteps(inner, 1)):
    state = tx.init(params)
    for loss in (1.0, 2.0, 3.0):
      _, state = tx.update({"w": jnp.ones(2)}, state, params, value=jnp.asarray(loss))
    assert float(state.inner_opt_state[1].scale) < 1.0


# --- 7 and rough edges: consistent dtypes, early errors ---------------------------------------


def test_flush_and_update_emit_the_same_dtypes():
  params = {"a": jnp.zeros(3, jnp.float32), "b": jnp.zeros(2, jnp.bfloat16)}
  grads = {"a": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(2, jnp.bfloat16)}
  tx = oa.accumulate(2, optax.sgd(1.0))
  state = tx.init(params)
  _, state = tx.update(grads, state, params)
  flushed, _ = oa.flush(tx, state, params)
  _, state2 = tx.update(grads, tx.init(params), params)
  updated, _ = tx.update(grads, state2, params)
  chex.assert_trees_all_equal_dtypes(flushed, updated)
  # The wider of the gradient's and the param's dtype: no precision thrown away.
  assert flushed["a"].dtype == jnp.float32 and flushed["b"].dtype == jnp.bfloat16


def test_k_beyond_int32_fails_at_construction():
  with pytest.raises(ValueError, match="int32"):
    oa.accumulate(2**31, optax.sgd(0.1))
  with pytest.raises(ValueError, match="int32"):
    oa.MultiSteps(optax.sgd(0.1), 2**40)


def test_rough_edges_name_the_argument():
  with pytest.raises(TypeError, match=r"optax.adam itself.*adam\(1e-3\)|adam itself"):
    oa.accumulate(4, optax.adam)
  with pytest.raises(TypeError, match="`opt`"):
    oa.MultiSteps(optax.sgd, 2)
  params = {"w": jnp.zeros(2)}
  tx = oa.accumulate(2, optax.sgd(0.1))
  with pytest.raises(ValueError, match="`emit_now` must be a scalar"):
    tx.update({"w": jnp.ones(2)}, tx.init(params), params, emit_now=jnp.array([True, False]))
  tx = oa.accumulate(2, optax.sgd(0.1), skip_nonfinite=np.bool_(True))
  _, state = tx.update({"w": jnp.full(2, jnp.nan)}, tx.init(params), params)
  assert int(state.num_skipped) == 1
  with pytest.raises(TypeError, match="skip_nonfinite"):
    oa.accumulate(2, None, skip_nonfinite=1)


def test_public_update_functions_have_docstrings():
  ms = oa.MultiSteps(optax.sgd(0.1), 2)
  tx = oa.accumulate(2, optax.sgd(0.1))
  for fn in (tx.update, tx.init, ms.update, ms.init, ms.has_updated, ms.gradient_transformation,
             oa.accumulate,
             oa.flush, oa.update_and_apply, oa.noise_scale):
    assert fn.__doc__ and len(fn.__doc__.split()) > 5, fn
  assert len(oa.__doc__.splitlines()) > 10


# --- a true drop-in MultiSteps ----------------------------------------------------------------


def test_multisteps_state_is_optax_own_type():
  state = oa.MultiSteps(optax.adam(1e-3), 2).init({"w": jnp.zeros(2)})
  assert type(state) is optax.MultiStepsState
  # What t5x's partitioner does: dispatch on the state's type.
  handlers = {optax.MultiStepsState: lambda s: "multi_steps"}
  assert handlers[type(state)](state) == "multi_steps"


@pytest.mark.parametrize("use_grad_mean", [True, False])
@pytest.mark.parametrize("direction", ["ours_to_optax", "optax_to_ours"])
def test_checkpoint_moves_mid_window_both_ways(use_grad_mean, direction):
  """Restore mid-window in the other implementation: same trajectory as staying."""
  key = jax.random.key(0)
  params = {"w": jax.random.normal(key, (4,)), "b": jnp.zeros(2)}
  grads = [jax.tree.map(lambda p, i=i: jax.random.normal(jax.random.fold_in(key, i), p.shape)
                        + 0.5, params) for i in range(9)]
  inner = optax.sgd(0.3, momentum=0.9)
  ours = oa.MultiSteps(inner, 3, use_grad_mean=use_grad_mean)
  theirs = optax.MultiSteps(inner, 3, use_grad_mean=use_grad_mean)
  first, second = (ours, theirs) if direction == "ours_to_optax" else (theirs, ours)
  steps = {id(tx): jax.jit(tx.update) for tx in (ours, theirs)}  # one compile each

  def train(tx, state, p, gs):
    for g in gs:
      u, state = steps[id(tx)](g, state, p)
      p = optax.apply_updates(p, u)
    return p, state

  # 5 mini-steps (mid-window: mini_step == 2), checkpoint, 4 more in the other one.
  p_mid, s_mid = train(first, first.init(params), params, grads[:5])
  assert int(s_mid.mini_step) == 2
  restored = jax.tree.map(np.asarray, s_mid)  # what a checkpointer writes and reads
  restored = jax.tree.unflatten(jax.tree.structure(second.init(params)),
                                jax.tree.leaves(restored))
  p_end, _ = train(second, restored, p_mid, grads[5:])
  p_ref, _ = train(theirs, theirs.init(params), params, grads)
  chex.assert_trees_all_close(p_end, p_ref, rtol=1e-6, atol=1e-6)
  # And the buffer means the same: optax's running mean (or sum).
  _, s_theirs = train(theirs, theirs.init(params), params, grads[:5])
  _, s_ours = train(ours, ours.init(params), params, grads[:5])
  chex.assert_trees_all_close(s_ours.acc_grads, s_theirs.acc_grads, rtol=1e-6)


def test_boundary_checkpoint_into_optax_mean_mode():
  """At a window boundary optax (use_grad_mean=True) ignores the buffer, as we do."""
  params = {"w": jnp.zeros(3)}
  grads = [{"w": jnp.full(3, float(i + 1))} for i in range(4)]
  ours, theirs = oa.MultiSteps(optax.sgd(1.0), 2), optax.MultiSteps(optax.sgd(1.0), 2)
  s = ours.init(params)
  for g in grads[:2]:
    _, s = ours.update(g, s, params)
  assert int(s.mini_step) == 0
  u = None
  for g in grads[2:]:
    u, s = theirs.update(g, s, params)
  chex.assert_trees_all_close(u, {"w": jnp.full(3, -3.5)})


@pytest.mark.skipif(jax.device_count() < 2, reason="pmap over 2 devices")
@pytest.mark.parametrize("k", [2, 3])
def test_multisteps_inside_pmap_and_nested_scan(k):
  """As clients use it: under pmap and inside nested lax.scan."""
  params = {"w": jnp.arange(3.0)}
  ms = oa.MultiSteps(optax.sgd(0.1, momentum=0.5), k)
  grads = jnp.arange(2 * 4 * k * 3, dtype=jnp.float32).reshape(2, 4, k, 3) / 10

  def outer(carry, gs_outer):
    def inner(c, g):
      p, s = c
      u, s = ms.update({"w": g}, s, p)
      return (optax.apply_updates(p, u), s), None
    carry, _ = jax.lax.scan(inner, carry, gs_outer)
    return carry, None

  run = jax.pmap(lambda g: jax.lax.scan(outer, (params, ms.init(params)), g)[0])
  p, s = run(jnp.stack([grads[0], grads[1]]))
  ref_tx = optax.sgd(0.1, momentum=0.5)
  for dev in range(2):
    q, rs = params, ref_tx.init(params)
    for win in grads[dev].reshape(-1, k, 3):
      u, rs = ref_tx.update({"w": win.mean(axis=0)}, rs, q)
      q = optax.apply_updates(q, u)
    np.testing.assert_allclose(np.asarray(p["w"][dev]), np.asarray(q["w"]), rtol=1e-5)
  assert (np.asarray(s.gradient_step) == 4).all()


# --- review (issue 74): fp8 params, flush, global_stats dtypes, params=None, unbound axis -------


def test_fp8_params_accumulate_in_float32():
  """fp8 params (JAX promotes 8-bit floats to nothing implicitly) accumulate in float32, as bf16
  ones do: ``accumulate`` and ``microbatched`` give the float32 sum of the fp8 gradients."""
  params = {"w": jnp.linspace(-1, 1, 8).astype(jnp.float8_e4m3fn),
            "b": jnp.full(4, 0.5, jnp.float8_e5m2)}
  # Small integers: each float32 gradient is exact (no rounding a TPU's fusion could reorder),
  # its fp8 cast rounds, and fp8 sums of the casts round again.
  x = jax.random.randint(jax.random.key(74), (16, 8), -2, 3).astype(jnp.float32)

  def loss(p, x):
    h = x @ p["w"].astype(jnp.float32)
    return jnp.mean((h[:, None] * p["b"].astype(jnp.float32) - 1.0) ** 2)

  grads = [jax.grad(loss)(params, x[i::4]) for i in range(4)]  # fp8, like the params
  f32_sum = lambda gs: jax.tree.map(lambda *g: np.sum([np.float32(v) for v in g], 0), *gs)
  tx = oa.accumulate(4, optax.sgd(1.0), track_noise_scale=True)  # (its squared norms too)
  state, update = tx.init(params), jax.jit(tx.update)
  for g in grads[:3]:
    _, state = update(g, state, params)
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, state.acc_grads), f32_sum(grads[:3]))
  updates, state = update(grads[3], state, params)
  mean = jax.tree.map(lambda s, p: jnp.asarray(s / 4).astype(p.dtype), f32_sum(grads), params)
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.negative, mean))
  assert int(state.noise_stats.num_windows) == 1 and np.isfinite(state.noise_stats.signal)
  _, mb_grads = jax.jit(oa.microbatched(jax.value_and_grad(loss), 4))(params, x)
  # XLA may keep a value wider than its type inside a program (excess precision: the TPU v5e
  # compiler keeps each micro-batch's fp8 gradient in float32 in the loop), then the mean rounds
  # once: the float32 mean of the exact float32 gradients, cast to fp8.
  wide = [jax.grad(loss)(jax.tree.map(lambda p: p.astype(jnp.float32), params), x[i::4])
          for i in range(4)]
  once = jax.tree.map(lambda s, p: jnp.asarray(s / 4).astype(p.dtype), f32_sum(wide), params)
  assert any(all(np.array_equal(np.float32(a), np.float32(b)) for a, b in zip(
      jax.tree.leaves(mb_grads), jax.tree.leaves(ref), strict=True)) for ref in (mean, once)), (
      mb_grads, mean, once)
  # float32 gradients of fp8 params: float32 updates (the wider dtype), as for bf16 params.
  tx = oa.accumulate(1, optax.sgd(1.0))
  wide = jax.tree.map(lambda g: g.astype(jnp.float32), grads[0])
  updates, _ = tx.update(wide, tx.init(params), params)
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.negative, wide))


def test_flush_refuses_a_transform_without_our_window():
  """``flush`` on ``optax.adam`` took a step on zero gradients, on ``optax.MultiSteps`` it
  added a zero micro-batch (the window's mean halved), in a chain too (its state is of our
  MultiSteps' type): refused. Ours still flush, in a chain."""
  params = {"w": jnp.full(2, 0.9)}
  theirs = optax.MultiSteps(optax.sgd(1.0), 4)
  for tx in (optax.adam(0.1), theirs, theirs.gradient_transformation(),
             optax.chain(optax.identity(), theirs.gradient_transformation())):
    state = tx.update({"w": jnp.ones(2)}, tx.init(params), params)[1]
    with pytest.raises(TypeError, match=r"`flush`.*`optax_accum.accumulate\(k, opt\)`.*`"
                       r"optax_accum.MultiSteps\(opt, k\)` for `optax.MultiSteps"):
      oa.flush(tx, state, params)
  ours = optax.chain(optax.identity(), oa.MultiSteps(optax.sgd(1.0), 4).gradient_transformation())
  _, state = ours.update({"w": jnp.array([2.0, 4.0])}, ours.init(params), params)
  updates, state = oa.flush(ours, state, params)  # the one micro-batch waiting, alone
  chex.assert_trees_all_equal(updates, {"w": -jnp.array([2.0, 4.0])})
  assert int(state[1].mini_step) == 0 and int(state[1].gradient_step) == 1


def test_global_stats_of_a_dtype_its_sum_would_truncate_are_an_error():
  """A float statistic into an integer ``like`` was truncated (0.9 on 3 micro-batches: 0)."""
  params, grads = {"w": jnp.zeros(2)}, {"w": jnp.zeros(2)}
  like = {"n": jnp.zeros(2, jnp.int32), "p": jnp.zeros((), jnp.int32)}
  tx = oa.accumulate(3, optax.sgd(0.1), global_stats=like)
  with pytest.raises(TypeError, match=r"stats=\.\.\.\)` at \['p'\] is float32, but `accumulate\(.*"
                                      r"int32.*`jax.ShapeDtypeStruct\(\(\), jnp.float32\)`"):
    tx.update(grads, tx.init(params), params, stats={"n": jnp.ones(2, jnp.int32),
                                                     "p": jnp.float32(0.9)})
  # Declared float32: the sum is numpy's; counts (int8 here) still go into a float statistic.
  tx = oa.accumulate(3, optax.sgd(0.1), global_stats=jax.tree.map(
      lambda x: x.astype(jnp.float32), like))
  state, update = tx.init(params), jax.jit(tx.update)
  for _ in range(3):
    _, state = update(grads, state, params, stats={"n": jnp.ones(2, jnp.int8),
                                                   "p": jnp.float32(0.9)})
  assert state.global_stats.last["p"] == sum([np.float32(0.9)] * 3, np.float32(0))
  assert not state.global_stats.running["p"]
  np.testing.assert_array_equal(state.global_stats.last["n"], [3.0, 3.0])


def test_update_and_apply_without_params_is_an_error():
  """``update_and_apply(tx, g, s, None)`` returned None as the new params."""
  tx = oa.accumulate(1, optax.sgd(0.1))
  state = tx.init({"w": jnp.zeros(2)})
  with pytest.raises(TypeError, match=r"`update_and_apply\(tx, grads, state, params\)` got"
                                      r" `params=None`.*Pass the current params"):
    oa.update_and_apply(tx, {"w": jnp.ones(2)}, state, None)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_accumulate_with_an_axis_bound_nowhere_names_set_mesh(jit):
  """Outside any mesh, shard_map or pmap, ``axis_name`` gave JAX's unbound-axis error."""
  params = {"w": jnp.zeros(2)}
  tx = oa.accumulate(2, optax.sgd(0.1), axis_name="data")
  update = jax.jit(tx.update) if jit else tx.update
  with pytest.raises(ValueError, match=r"`axis_name='data'` is bound nowhere.*`accumulate\(\.\.\.,"
                                       r" axis_name=\.\.\.\)`'s update under `with jax\.set_mesh"):
    update({"w": jnp.ones(2)}, tx.init(params), params)


def test_an_aux_fn_without_has_aux_is_an_error():
  """An ``fn`` built with ``has_aux=True`` given without it: its aux (per-example predictions, a
  count) was averaged across micro-batches as if it were the loss (review 74, 5)."""
  def loss(w, x):
    pred = x @ w
    return jnp.mean(pred ** 2), {"pred": pred, "rows": x.shape[0]}

  fn = jax.value_and_grad(loss, has_aux=True)
  w, x = jnp.ones(3), jnp.arange(24.0).reshape(8, 3)
  with pytest.raises(TypeError, match=r"`fn`'s value .*not one loss.*has_aux=True"):
    oa.microbatched(fn, 2)(w, x)
  (value, aux), grads = oa.microbatched(fn, 2, has_aux=True, aux_rules={"pred": "concat",
                                                                          "rows": "sum"})(w, x)
  (whole, _), whole_grads = fn(w, x)  # the large batch: the reference
  np.testing.assert_allclose(value, whole, rtol=1e-6)
  np.testing.assert_allclose(grads, whole_grads, rtol=1e-6)
  assert aux["rows"] == 8 and aux["pred"].shape == (8,)


def test_a_gradient_with_respect_to_the_batch_is_an_error():
  """``argnums=(0, 1)``: the batch's gradient, summed over micro-batches, added other examples'
  rows together; it names the fix (review 74, 4)."""
  def loss(w, x):
    return jnp.mean((x @ w) ** 2)

  fn = jax.value_and_grad(loss, argnums=(0, 1))
  w, x = jnp.ones(3), jnp.arange(24.0).reshape(8, 3)
  for run in (oa.microbatched(fn, 2), jax.jit(oa.microbatched(fn, 2))):
    with pytest.raises(TypeError, match=r"gradient with respect to batch argument 1.*argnums=0"):
      run(w, x)
  # Params that are a tuple, one of them shaped like a micro-batch: the large batch's gradient.
  pair = lambda p, x: loss(p[0][0], x) + jnp.sum(p[1] ** 2)
  params = (jnp.ones((4, 3)), jnp.ones(3))  # p[0] is shaped like a micro-batch of x
  _, grads = oa.microbatched(jax.value_and_grad(pair), 2)(params, x)
  chex.assert_trees_all_close(grads, jax.grad(pair)(params, x), rtol=1e-6)


def test_an_nnx_module_is_refused_naming_the_split_that_works():
  """``nnx.value_and_grad(loss)`` with the module passed (review 74, 7): Flax's "different trace
  level" before; now the package's error, whose recipe gives the whole batch's gradient."""
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  x = jnp.arange(24.0).reshape(8, 3)
  loss = lambda model, x: jnp.mean(model(x) ** 2)
  with pytest.raises(TypeError, match=r"NNX module.*nnx\.split\(model, nnx\.Param"):
    oa.microbatched(nnx.value_and_grad(loss), 2)(model, x)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  fn = jax.value_and_grad(lambda params, x: loss(nnx.merge(graphdef, params, rest), x))
  value, grads = oa.microbatched(fn, 2)(params, x)
  whole_value, whole_grads = nnx.value_and_grad(loss)(model, x)
  np.testing.assert_allclose(value, whole_value, rtol=1e-6)
  chex.assert_trees_all_close(jax.tree.leaves(grads), jax.tree.leaves(whole_grads), rtol=1e-6)
  from optax_accum.flax import Optimizer  # (flax: the test extra)
  optimizer, kernel = Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), np.array(model.kernel.value)
  optimizer.update(model, grads)
  np.testing.assert_allclose(model.kernel.value, kernel - 0.1 * np.asarray(grads["kernel"].value),
                             rtol=1e-6)


def test_a_per_example_aux_under_mean_or_sum_is_an_error():
  """The default aux_rules='mean' on an aux leaf of the micro-batch's examples averaged row i of
  each micro-batch together (review 74, 5); 'concat' gives them in the batch's order, and a
  leaf merely as long as a micro-batch (not doubling with it) is still averaged."""
  def loss(w, x):
    pred = x @ w
    return jnp.mean(pred ** 2), {"pred": pred, "features": jnp.mean(x, 0)[:2] * 0 + w[:2]}

  fn = jax.value_and_grad(loss, has_aux=True)
  w, x = jnp.arange(1.0, 4.0), jnp.arange(12.0).reshape(4, 3)  # micro-batches of 2 rows
  for rules in ("mean", "sum", {"pred": "mean", "features": "mean"}):
    with pytest.raises(ValueError, match=r"aux\['pred'\] holds the micro-batch's examples.*concat"):
      oa.microbatched(fn, 2, has_aux=True, aux_rules=rules)(w, x)
  (_, aux), _ = oa.microbatched(fn, 2, has_aux=True, aux_rules={"pred": "concat",
                                                               "features": "mean"})(w, x)
  np.testing.assert_allclose(aux["pred"], x @ w)  # every example's, in order
  np.testing.assert_allclose(aux["features"], w[:2])  # 2 entries, like a micro-batch: averaged


def test_a_k_schedule_that_fails_at_step_zero_fails_where_accumulate_is_built():
  """(It warned and went on: the step that traced it failed later, farther from the cause.)"""
  with pytest.raises(TypeError):
    oa.accumulate(lambda step: step + "4", optax.sgd(0.1))
  tx = oa.accumulate(lambda step: jnp.where(step < 2, 2, 4), optax.sgd(0.1))  # an array schedule
  assert tx.init({"w": jnp.zeros(2)}).mini_step == 0
