"""Tests of the mixed-precision policy and dynamic loss scaling, alone and
composed with `microbatched` and `accumulate`. References are full-batch
float32 `jax.value_and_grad` calls or hand-computed values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optax_accum.accumulation import accumulate
from optax_accum.microbatching import microbatched
from optax_accum.precision import (
    DynamicLossScale,
    Policy,
    all_finite,
    cast_floating,
    dynamic_loss_scale,
    mixed_precision,
    scaled_value_and_grad,
)

BF16 = Policy.from_string("params=float32,compute=bfloat16,output=float32")
F16 = Policy.from_string("p=f32,c=f16,o=f32")


def mlp_loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"])
  return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


@pytest.fixture(scope="module")
def params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w1": jax.random.normal(k1, (4, 8)) * 0.5, "w2": jax.random.normal(k2, (8,)) * 0.5}


@pytest.fixture(scope="module")
def batch():
  k1, k2 = jax.random.split(jax.random.key(1))
  return {"x": jax.random.normal(k1, (16, 4)), "y": jax.random.normal(k2, (16,))}


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


# -------------------------------------------------------------------- Policy
@pytest.mark.parametrize("spec, expected", [
    ("params=float32,compute=bfloat16,output=float32",
     (jnp.float32, jnp.bfloat16, jnp.float32)),
    ("p=f32,c=f16,o=f16", (jnp.float32, jnp.float16, jnp.float16)),
    ("compute=bf16", (jnp.float32, jnp.bfloat16, jnp.float32)),
    ("bf16", (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16)),
    (" params = half , compute = full ", (jnp.float16, jnp.float32, jnp.float32)),
])
def test_policy_from_string(spec, expected):
  p = Policy.from_string(spec)
  assert (p.param_dtype, p.compute_dtype, p.output_dtype) == tuple(map(jnp.dtype, expected))


@pytest.mark.parametrize("spec, exc, pattern", [
    ("params=f32,compute=int8", TypeError, "`compute` must be a floating dtype"),
    ("weights=f32", ValueError, "Cannot parse 'weights=f32'"),
    ("", ValueError, "`spec` must be a string"),
    ("nonsense", TypeError, "`spec` must be a floating dtype"),
])
def test_policy_bad_specs(spec, exc, pattern):
  with pytest.raises(exc, match=pattern):
    Policy.from_string(spec)


def test_policy_rejects_integer_dtype():
  with pytest.raises(TypeError, match="`compute_dtype` must be a floating dtype"):
    Policy(compute_dtype=jnp.int32)


def test_casts_touch_only_floating_leaves():
  tree = {"x": jnp.ones(2), "ids": jnp.arange(2), "mask": jnp.ones(2, bool),
          "key": jax.random.key(0)}
  out = cast_floating(tree, jnp.bfloat16)
  assert out["x"].dtype == jnp.bfloat16
  assert out["ids"].dtype == jnp.int32 and out["mask"].dtype == jnp.bool_
  assert jax.dtypes.issubdtype(out["key"].dtype, jax.dtypes.prng_key)
  assert BF16.cast_to_param(out)["x"].dtype == jnp.float32


# ------------------------------------------------------------- mixed precision
def test_mixed_precision_computes_in_bf16_returns_f32(params, batch):
  seen = {}
  def loss(p, b):
    seen["w1"], seen["x"], seen["ids"] = p["w1"].dtype, b["x"].dtype, b["ids"].dtype
    return mlp_loss(p, b)
  b = {**batch, "ids": jnp.arange(16)}
  # The file's one un-jitted call: jit traces the same program (the other tests jit).
  value, grads = jax.value_and_grad(mixed_precision(loss, BF16))(params, b)
  assert seen == {"w1": jnp.bfloat16, "x": jnp.bfloat16, "ids": jnp.int32}
  assert value.dtype == jnp.float32
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
  ref_value, ref_grads = jax.value_and_grad(mlp_loss)(params, batch)
  assert rel_err(value, ref_value) < 2e-2
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
    assert rel_err(g, r) < 5e-2
  # And the precision really was lower: bf16 is not bit-equal to f32.
  assert float(value) != float(ref_value)


def test_mixed_precision_cast_inputs_false_and_aux(params, batch):
  def loss(p, b):
    return mlp_loss(p, b), {"x_dtype_is_f32": jnp.asarray(b["x"].dtype == jnp.float32),
                            "m": jnp.mean(b["x"])}
  f = mixed_precision(loss, BF16, cast_inputs=False)
  value, aux = f(params, batch)
  assert bool(aux["x_dtype_is_f32"]) and aux["m"].dtype == jnp.float32
  assert value.dtype == jnp.float32


def test_mixed_precision_bad_policy():
  with pytest.raises(TypeError, match="`policy` must have `cast_to_compute`"):
    mixed_precision(mlp_loss, "bf16")


def test_policy_composes_with_microbatched(params, batch):
  fn = jax.value_and_grad(mixed_precision(mlp_loss, BF16))
  loss, grads = jax.jit(microbatched(fn, 4))(params, batch)
  assert loss.dtype == jnp.float32
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
  # Against the full-batch float32 reference (bf16 compute: ~1e-2 relative).
  ref_loss, ref_grads = jax.value_and_grad(mlp_loss)(params, batch)
  assert rel_err(loss, ref_loss) < 2e-2
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
    assert rel_err(g, r) < 5e-2


def test_bf16_params_microbatched_returns_bf16_grads(params, batch):
  p16 = Policy.from_string("bf16").cast_to_param(params)
  fn = jax.value_and_grad(mixed_precision(mlp_loss, Policy.from_string("bf16")))
  loss, grads = microbatched(fn, 4)(p16, batch)
  assert loss.dtype == jnp.bfloat16
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
  _, ref_grads = jax.value_and_grad(mlp_loss)(params, batch)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
    assert rel_err(g, r) < 6e-2


def test_policy_composes_with_accumulate(params, batch):
  # k micro-steps of accumulate(k, sgd) with bf16-compute gradients equal one
  # sgd step on the full-batch float32 gradient (up to bf16 rounding), and
  # exactly one sgd step on the mean of those same micro-batch gradients.
  k, lr = 4, 0.1
  grad_fn = jax.jit(jax.grad(mixed_precision(mlp_loss, BF16)))
  tx = accumulate(k, optax.sgd(lr))
  state = tx.init(params)
  p = params
  micro = [jax.tree.map(lambda x, i=i: x[i::k], batch) for i in range(k)]
  grads = [grad_fn(params, mb) for mb in micro]
  for g in grads:
    updates, state = jax.jit(tx.update)(g, state, p)
    p = optax.apply_updates(p, updates)
  mean_g = jax.tree.map(lambda *gs: sum(gs) / k, *grads)
  for a, g0, m in zip(jax.tree.leaves(p), jax.tree.leaves(params), jax.tree.leaves(mean_g),
                      strict=True):
    np.testing.assert_allclose(a, g0 - lr * m, rtol=1e-6, atol=1e-7)
  ref = jax.grad(mlp_loss)(params, batch)
  for a, g0, r in zip(jax.tree.leaves(p), jax.tree.leaves(params), jax.tree.leaves(ref),
                      strict=True):
    assert rel_err((g0 - a) / lr, r) < 5e-2


# ------------------------------------------------------------- loss scaling
def test_adjust_shrinks_grows_and_clamps():
  scaler = dynamic_loss_scale(2.0**4, growth_interval=3, min_scale=2.0, max_scale=2.0**5)
  adjust = jax.jit(scaler.adjust)
  s = scaler.init()
  assert isinstance(s, DynamicLossScale) and float(s.loss_scale) == 16.0
  s = adjust(s, jnp.array(True))
  s = adjust(s, jnp.array(True))
  assert float(s.loss_scale) == 16.0 and int(s.good_steps) == 2
  s = adjust(s, jnp.array(False))  # overflow: halve, restart the run
  assert (float(s.loss_scale), int(s.good_steps), int(s.num_overflows)) == (8.0, 0, 1)
  for _ in range(3):
    s = adjust(s, jnp.array(True))
  assert (float(s.loss_scale), int(s.good_steps)) == (16.0, 0)  # grew after 3
  for _ in range(6):
    s = adjust(s, jnp.array(True))
  assert float(s.loss_scale) == 32.0  # clamped at max_scale
  for _ in range(5):
    s = adjust(s, jnp.array(False))
  assert float(s.loss_scale) == 2.0 and int(s.num_overflows) == 6  # clamped at min


@pytest.mark.parametrize("kwargs, pattern", [
    ({"growth_interval": 0}, "`growth_interval` must be an int >= 1"),
    ({"growth_factor": 0.5}, "`growth_factor` must be >= 1"),
    ({"backoff_factor": 1.0}, r"`backoff_factor` must be in \(0, 1\)"),
    ({"initial_scale": 0.5}, "min_scale <= initial_scale"),
    ({"max_scale": 2.0}, "initial_scale <= max_scale"),
])
def test_dynamic_loss_scale_bad_args(kwargs, pattern):
  with pytest.raises(ValueError, match=pattern):
    dynamic_loss_scale(**kwargs)


def test_scaled_value_and_grad_bad_args():
  scaler = dynamic_loss_scale()
  with pytest.raises(TypeError, match="`scaler` must be a LossScaler"):
    scaled_value_and_grad(mlp_loss, "scaler", scaler.init())
  with pytest.raises(TypeError, match="`state` must be the DynamicLossScale"):
    scaled_value_and_grad(mlp_loss, scaler, 1024.0)


def test_scaled_value_and_grad_equals_value_and_grad_in_f32(params, batch):
  scaler = dynamic_loss_scale(2.0**12)
  vg = scaled_value_and_grad(mlp_loss, scaler, scaler.init())
  loss, grads = jax.jit(vg)(params, batch)
  ref_loss, ref_grads = jax.value_and_grad(mlp_loss)(params, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


def test_scaled_value_and_grad_has_aux_and_microbatched(params, batch):
  scaler = dynamic_loss_scale(2.0**10)
  def loss(p, b):
    return mlp_loss(p, b), jnp.max(b["y"])
  vg = scaled_value_and_grad(loss, scaler, scaler.init(), has_aux=True)
  (value, aux), grads = jax.jit(microbatched(vg, 4, has_aux=True, aux_rules="max"))(
      params, batch)
  (ref_value, ref_aux), ref_grads = jax.value_and_grad(loss, has_aux=True)(params, batch)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  np.testing.assert_allclose(aux, ref_aux)  # the aux is not scaled
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


def test_loss_scaling_rescues_f16_underflow():
  # Gradients ~1e-8 are below float16's smallest subnormal (~6e-8): without a
  # scale the f16 backward flushes them to zero; scaled by 2**15 they survive.
  w = jnp.full((4,), 0.5)
  x = jnp.full((8, 4), 1e-3)
  def loss(w, x):
    return jnp.mean(x @ w) * 1e-5
  f16_loss = mixed_precision(loss, F16)
  ref = jax.grad(loss)(w, x)
  assert 1e-9 < float(ref[0]) < 6e-8
  plain = jax.grad(f16_loss)(w, x)
  assert float(jnp.max(jnp.abs(plain))) == 0.0
  scaler = dynamic_loss_scale(2.0**15)
  _, scaled = scaled_value_and_grad(f16_loss, scaler, scaler.init())(w, x)
  assert rel_err(scaled, ref) < 2e-2


def test_forced_overflow_is_skipped_by_accumulate_and_the_scale_shrinks():
  """fp16 + dynamic loss scale + accumulate(skip_nonfinite=True).

  Micro-batches: good, overflow, good. The overflow (a gradient of ~10 times
  a scale of 2**15 exceeds float16's 65504 in the backward pass, while the
  forward is finite) is dropped: no counter, buffer, optimizer state or param
  changes, only the scale halves. The window then closes on the two good
  micro-batches and equals one Adam step on their float32 mean gradient.
  """
  k = 2
  w0 = {"w": jnp.full((1,), 1.0)}
  def loss(p, b):
    return jnp.mean(0.5 * (b["x"] * p["w"] - b["y"]) ** 2)
  f16_loss = mixed_precision(loss, F16)
  good1 = {"x": jnp.array([0.1, 0.2]), "y": jnp.array([0.0, 0.05])}
  bad = {"x": jnp.array([10.0, 10.0]), "y": jnp.array([0.0, 0.0])}
  good2 = {"x": jnp.array([0.3, -0.1]), "y": jnp.array([0.1, 0.0])}

  scaler = dynamic_loss_scale(2.0**15, growth_interval=1000)
  tx = accumulate(k, optax.adam(1e-2), skip_nonfinite=True)

  @jax.jit
  def micro_step(params, opt_state, ls, batch):
    vg = scaled_value_and_grad(f16_loss, scaler, ls)
    value, grads = vg(params, batch)
    finite = all_finite(grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, scaler.adjust(ls, finite), value

  params, opt_state, ls = w0, tx.init(w0), scaler.init()
  params, opt_state, ls, _ = micro_step(params, opt_state, ls, good1)
  before = (params, opt_state)
  params, opt_state, ls, value = micro_step(params, opt_state, ls, bad)
  assert np.isfinite(float(value))  # forward finite: the overflow is in the backward
  assert float(ls.loss_scale) == 2.0**14 and int(ls.num_overflows) == 1
  assert int(opt_state.num_skipped) == 1
  after_skip = jax.tree.map(np.asarray, (params, opt_state._replace(num_skipped=0)))
  expected = jax.tree.map(np.asarray, (before[0], before[1]._replace(num_skipped=0)))
  for a, e in zip(jax.tree.leaves(after_skip), jax.tree.leaves(expected), strict=True):
    np.testing.assert_array_equal(a, e)  # nothing else changed
  params, opt_state, ls, _ = micro_step(params, opt_state, ls, good2)
  assert int(opt_state.gradient_step) == 1 and int(ls.num_overflows) == 1
  # Reference: one float32 Adam step on the mean of the two good micro-batches.
  g = jax.tree.map(lambda a, b: (a + b) / 2, jax.grad(loss)(w0, good1), jax.grad(loss)(w0, good2))
  ref_opt = optax.adam(1e-2)
  u, _ = ref_opt.update(g, ref_opt.init(w0), w0)
  np.testing.assert_allclose(params["w"], w0["w"] + u["w"], rtol=1e-4)


def test_all_finite():
  assert bool(all_finite({"a": jnp.ones(3), "b": [jnp.zeros(2)]}))
  assert not bool(all_finite({"a": jnp.ones(3), "b": [jnp.array([0.0, jnp.nan])]}))
  assert not bool(all_finite(jnp.array([-jnp.inf])))
  assert bool(all_finite({}))
