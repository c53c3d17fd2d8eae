"""Tests of `microbatched`: every result is checked against an independent
reference — the full-batch `jax.value_and_grad` call, or micro-batches cut by
hand with NumPy indexing — never against the code under test."""

from __future__ import annotations

import contextlib
import functools
import math
import re
import warnings

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum as oa
from optax_accum import gradient_noise
from optax_accum.debug import hlo_collectives
from optax_accum.microbatching import AuxRule, split_microbatches
from tests._reference import float64_eps, premise, xla_cpu_fact

RTOL, ATOL = 2e-5, 1e-6

# The 0.2.0 options (`split`, `rng_mode`, `accumulator_dtype`, `unroll`) keep working
# for one release; their warning is tested below.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`microbatched`'s .* is deprecated:DeprecationWarning")


def assert_trees_close(actual, expected, rtol=RTOL, atol=ATOL):
  a_leaves, a_def = jax.tree.flatten(actual)
  e_leaves, e_def = jax.tree.flatten(expected)
  assert a_def == e_def, (a_def, e_def)
  for a, e in zip(a_leaves, e_leaves, strict=True):
    assert jnp.shape(a) == jnp.shape(e)
    wide = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(e) else np.float64
    np.testing.assert_allclose(np.asarray(a, wide), np.asarray(e, wide), rtol=rtol, atol=atol)


def maybe_jit(f, jit: bool):
  return jax.jit(f) if jit else f


# ------------------------------------------------------------------- models
def init_mlp(key, d_in=5, d_hidden=7):
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (d_in, d_hidden)) * 0.5,
          "b1": jnp.zeros(d_hidden),
          "w2": jax.random.normal(k2, (d_hidden,)) * 0.5}


def per_example_loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  return (h @ params["w2"] - batch["y"]) ** 2


def mean_loss(params, batch):
  return jnp.mean(per_example_loss(params, batch))


def make_batch(key, n, d_in=5):
  kx, ky = jax.random.split(key)
  return {"x": jax.random.normal(kx, (n, d_in)), "y": jax.random.normal(ky, (n,))}


def manual_microbatches(batch, k, split):
  """Micro-batches cut by hand (independent of `split_microbatches`)."""
  n = jax.tree.leaves(batch)[0].shape[0]
  m = n // k
  if split == "strided":
    idx = [np.arange(i, n, k) for i in range(k)]
  else:
    idx = [np.arange(i * m, (i + 1) * m) for i in range(k)]
  return [jax.tree.map(lambda x, ix=ix: np.asarray(x)[ix], batch) for ix in idx]


@pytest.fixture(scope="module")
def params():
  return init_mlp(jax.random.key(0))


@pytest.fixture(scope="module")
def batch():
  return make_batch(jax.random.key(1), 16)


# ------------------------------------------------------------- mean / sum
# k = 1 is test_k1_is_identity; k = 16 is one row per micro-batch. The one un-jitted
# call of this file: jit and no jit trace the same program, so one check covers the rest.
@pytest.mark.parametrize("k, jit", [
    (2, True), pytest.param(4, True, marks=pytest.mark.catches("mean_off_by_one_microbatched")),
    (16, False)], ids=["k2-jit", "k4-jit", "k16-nojit"])
def test_mean_equals_full_batch(params, batch, k, jit):
  ref_loss, ref_grads = jax.value_and_grad(mean_loss)(params, batch)
  fn = maybe_jit(oa.microbatched(jax.value_and_grad(mean_loss), k), jit)
  loss, grads = fn(params, batch)
  assert_trees_close(loss, ref_loss)
  assert_trees_close(grads, ref_grads)
  assert loss.dtype == ref_loss.dtype
  assert jax.tree.map(lambda g: g.dtype, grads) == jax.tree.map(lambda g: g.dtype, ref_grads)


def test_k1_is_identity(params, batch):
  fn = jax.value_and_grad(mean_loss)
  out = oa.microbatched(fn, 1)(params, batch)
  ref = fn(params, batch)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
    np.testing.assert_array_equal(a, b)  # bitwise: no scan, no casts


def test_sum_equals_full_batch(params, batch):
  sum_loss = lambda p, b: jnp.sum(per_example_loss(p, b))
  ref_loss, ref_grads = jax.value_and_grad(sum_loss)(params, batch)
  fn = jax.jit(oa.microbatched(jax.value_and_grad(sum_loss), 4, normalize="sum"))
  loss, grads = fn(params, batch)
  assert_trees_close(loss, ref_loss)
  assert_trees_close(grads, ref_grads)


def test_mean_of_sum_loss_is_not_the_sum(params, batch):
  # Guards against "mean" silently summing: the two must differ by k.
  sum_loss = lambda p, b: jnp.sum(per_example_loss(p, b))
  ref_loss, _ = jax.value_and_grad(sum_loss)(params, batch)
  loss, _ = oa.microbatched(jax.value_and_grad(sum_loss), 4)(params, batch)
  np.testing.assert_allclose(loss, ref_loss / 4, rtol=RTOL)


def test_multiple_batch_args_and_extra_args(params, batch):
  def loss(p, x, scale, y):
    return scale * jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)
  ref = jax.value_and_grad(loss)(params, batch["x"], 3.0, batch["y"])
  fn = oa.microbatched(jax.value_and_grad(loss), 4, batch_argnums=(1, 3))
  out = jax.jit(fn)(params, batch["x"], 3.0, batch["y"])
  assert_trees_close(out, ref)


def test_kwargs_pass_through_unsplit(params, batch):
  def loss(p, b, *, offset):
    return mean_loss(p, b) + offset
  fn = oa.microbatched(jax.value_and_grad(loss), 4)
  loss_val, grads = fn(params, batch, offset=2.0)
  ref_loss, ref_grads = jax.value_and_grad(loss)(params, batch, offset=2.0)
  assert_trees_close((loss_val, grads), (ref_loss, ref_grads))


def test_nested_batch_pytree(params):
  batch = make_batch(jax.random.key(3), 12)
  nested = {"inputs": {"x": batch["x"]}, "targets": [batch["y"]]}
  def loss(p, b):
    return mean_loss(p, {"x": b["inputs"]["x"], "y": b["targets"][0]})
  ref = jax.value_and_grad(loss)(params, nested)
  out = jax.jit(oa.microbatched(jax.value_and_grad(loss), 3))(params, nested)
  assert_trees_close(out, ref)


# ----------------------------------------------------------------------- aux
def loss_with_aux(params, batch):
  per_ex = per_example_loss(params, batch)
  aux = {
      "mean_abs_err": jnp.mean(jnp.sqrt(per_ex)),
      "count": jnp.asarray(per_ex.shape[0], jnp.int32),
      "max_err": jnp.max(per_ex),
      "min_err": jnp.min(per_ex),
      "per_example": per_ex,
      "mb_mean": jnp.mean(per_ex),
      "last_y0": batch["y"][0],
  }
  return jnp.mean(per_ex), aux


AUX_RULES = {"mean_abs_err": "mean", "count": "sum", "max_err": "max", "min_err": "min",
             "per_example": "concat", "mb_mean": "stack", "last_y0": "last"}


def test_aux_rules_against_full_batch_and_manual_split(params, batch):
  k, split = 4, "strided"
  fn = jax.value_and_grad(loss_with_aux, has_aux=True)
  (ref_loss, ref_aux), ref_grads = fn(params, batch)
  wrapped = jax.jit(oa.microbatched(fn, k, has_aux=True, aux_rules=AUX_RULES))
  (loss, aux), grads = wrapped(params, batch)
  assert_trees_close(loss, ref_loss)
  assert_trees_close(grads, ref_grads)
  # Full-batch quantities.
  np.testing.assert_allclose(aux["mean_abs_err"], ref_aux["mean_abs_err"], rtol=RTOL)
  assert aux["count"] == 16 and aux["count"].dtype == jnp.int32
  np.testing.assert_allclose(aux["max_err"], ref_aux["max_err"], rtol=RTOL)
  # The smallest squared error is ~7e-5: its float32 rounding is relative to the batch's.
  np.testing.assert_allclose(aux["min_err"], ref_aux["min_err"], rtol=RTOL, atol=1e-8)
  # concat restores the original batch order, not the strided one.
  np.testing.assert_allclose(aux["per_example"], ref_aux["per_example"], rtol=RTOL, atol=ATOL)
  # Per-micro-batch quantities, against micro-batches cut by hand.
  mbs = manual_microbatches(batch, k, split)
  expected_stack = [float(mean_loss(params, mb)) for mb in mbs]
  np.testing.assert_allclose(aux["mb_mean"], expected_stack, rtol=RTOL)
  np.testing.assert_allclose(aux["last_y0"], mbs[-1]["y"][0], rtol=RTOL)


def test_aux_single_rule_broadcasts_and_prefix_trees(params, batch):
  def loss(p, b):
    per_ex = per_example_loss(p, b)
    return jnp.mean(per_ex), {"a": jnp.mean(per_ex), "b": (jnp.mean(b["y"]), jnp.max(b["y"]))}
  fn = jax.value_and_grad(loss, has_aux=True)
  (_, ref_aux), _ = fn(params, batch)
  (_, aux), _ = oa.microbatched(fn, 4, has_aux=True)(params, batch)  # "mean" for all
  np.testing.assert_allclose(aux["a"], ref_aux["a"], rtol=RTOL)
  np.testing.assert_allclose(aux["b"][0], ref_aux["b"][0], rtol=RTOL, atol=ATOL)
  assert not np.isclose(aux["b"][1], ref_aux["b"][1])  # mean of maxes != max
  (_, aux), _ = oa.microbatched(fn, 4, has_aux=True, aux_rules={"a": "mean", "b": "max"})(
      params, batch)
  np.testing.assert_allclose(aux["b"][1], ref_aux["b"][1], rtol=RTOL)


def test_custom_aux_rule(params, batch):
  # Weighted mean of a per-micro-batch metric, weights = micro-batch index + 1.
  rule = AuxRule(
      init=lambda s: (jnp.zeros(s.shape, jnp.float32), jnp.zeros([], jnp.float32)),
      update=lambda c, v, i: (c[0] + (i + 1) * v, c[1] + (i + 1)),
      finalize=lambda c: c[0] / c[1],
  )
  fn = jax.value_and_grad(lambda p, b: (mean_loss(p, b), mean_loss(p, b)), has_aux=True)
  (_, aux), _ = jax.jit(oa.microbatched(fn, 4, has_aux=True, aux_rules=rule))(params, batch)
  mbs = manual_microbatches(batch, 4, "strided")
  vals = np.array([float(mean_loss(params, mb)) for mb in mbs])
  np.testing.assert_allclose(aux, np.sum(vals * np.arange(1, 5)) / 10, rtol=RTOL)


# ------------------------------------------------------------- token-weighted
SEQ = 6


def token_batch(n=8, seed=0, lengths=None):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, SEQ, 5)).astype(np.float32)
  y = rng.normal(size=(n, SEQ)).astype(np.float32)
  if lengths is None:
    lengths = rng.integers(0, SEQ + 1, size=n)
  mask = (np.arange(SEQ)[None, :] < np.asarray(lengths)[:, None]).astype(np.float32)
  return {"x": jnp.asarray(x), "y": jnp.asarray(y), "mask": jnp.asarray(mask)}


def token_losses(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  return (h @ params["w2"] - batch["y"]) ** 2


def token_sum_loss(params, batch):
  """(sum of real-token losses, number of real tokens)."""
  return jnp.sum(token_losses(params, batch) * batch["mask"]), jnp.sum(batch["mask"])


def token_mean_loss(params, batch):
  """The full-batch reference: mean over all real tokens of the batch."""
  num, den = token_sum_loss(params, batch)
  return num / den


# Uneven padding: micro-batch 0 (strided rows 0, 4) has 12 real tokens, the
# others very few, so the mean of per-micro-batch means is far from the truth.
UNEVEN = [6, 1, 0, 1, 6, 0, 1, 0]


@pytest.mark.catches("weighted_scale_is_the_mean_microbatched")
def test_weighted_equals_full_batch_and_mean_of_means_does_not(params):
  batch = token_batch(lengths=UNEVEN)
  ref_loss, ref_grads = jax.value_and_grad(token_mean_loss)(params, batch)
  fn = jax.value_and_grad(token_sum_loss, has_aux=True)
  loss, grads = jax.jit(oa.microbatched(fn, 4, normalize="weighted"))(params, batch)
  assert_trees_close(loss, ref_loss)
  assert_trees_close(grads, ref_grads)
  # The trap: the mean over micro-batches of per-micro-batch token means.
  def mb_token_mean(p, b):
    num, den = token_sum_loss(p, b)
    return num / jnp.maximum(den, 1.0)
  mom_loss, mom_grads = oa.microbatched(jax.value_and_grad(mb_token_mean), 4)(params, batch)
  assert abs(float(mom_loss) - float(ref_loss)) > 0.05 * abs(float(ref_loss))
  assert not np.allclose(mom_grads["w2"], ref_grads["w2"], rtol=1e-2)


def test_weighted_with_aux(params):
  batch = token_batch(lengths=UNEVEN)
  def loss(p, b):
    num, den = token_sum_loss(p, b)
    return num, (den, {"tokens": den, "max_loss": jnp.max(token_losses(p, b) * b["mask"])})
  fn = jax.value_and_grad(loss, has_aux=True)
  (loss_val, aux), g = jax.jit(oa.microbatched(
      fn, 2, normalize="weighted", has_aux=True, aux_rules={"tokens": "sum", "max_loss": "max"}))(
          params, batch)
  ref_loss, ref_grads = jax.value_and_grad(token_mean_loss)(params, batch)
  assert_trees_close((loss_val, g), (ref_loss, ref_grads))
  assert float(aux["tokens"]) == sum(UNEVEN)
  np.testing.assert_allclose(
      aux["max_loss"], jnp.max(token_losses(params, batch) * batch["mask"]), rtol=RTOL)


def test_weighted_all_padding_is_zero_not_nan(params):
  batch = token_batch(lengths=[0] * 8)
  fn = jax.value_and_grad(token_sum_loss, has_aux=True)
  for k in (1, 4):
    loss, grads = jax.jit(oa.microbatched(fn, k, normalize="weighted"))(params, batch)
    assert float(loss) == 0.0
    for g in jax.tree.leaves(grads):
      np.testing.assert_array_equal(g, np.zeros_like(g))


def test_weighted_k1_divides(params):
  batch = token_batch(lengths=UNEVEN)
  fn = jax.value_and_grad(token_sum_loss, has_aux=True)
  out = oa.microbatched(fn, 1, normalize="weighted")(params, batch)
  assert_trees_close(out, jax.value_and_grad(token_mean_loss)(params, batch))


def test_weighted_integer_denominator(params):
  batch = token_batch(lengths=UNEVEN)
  def loss(p, b):
    num, den = token_sum_loss(p, b)
    return num, den.astype(jnp.int32)
  out = oa.microbatched(jax.value_and_grad(loss, has_aux=True), 4, normalize="weighted")(
      params, batch)
  assert_trees_close(out, jax.value_and_grad(token_mean_loss)(params, batch))


# ----------------------------------------------------------------------- RNG
def noisy_loss(params, batch, key):
  noise = jax.random.normal(key, batch["y"].shape)
  loss = jnp.mean((batch["x"] @ params["w1"] @ params["w2"] + noise - batch["y"]) ** 2)
  return loss, jax.random.key_data(key)


def test_rng_differs_per_microbatch(params, batch):
  key = jax.random.key(42)
  k = 4
  fn = jax.value_and_grad(noisy_loss, has_aux=True)
  wrapped = jax.jit(oa.microbatched(fn, k, has_aux=True, aux_rules="stack", rng_argnums=2))
  (loss, keys), grads = wrapped(params, batch, key)
  keys = np.asarray(keys)
  assert keys.shape[0] == k
  distinct = {tuple(r.ravel()) for r in keys}
  assert len(distinct) == k  # never one key reused
  assert tuple(np.asarray(jax.random.key_data(key)).ravel()) not in distinct
  # The documented derivation, and the loss it gives, against a manual loop.
  sub = [jax.random.fold_in(key, i) for i in range(k)]
  np.testing.assert_array_equal(keys, np.stack([jax.random.key_data(s) for s in sub]))
  mbs = manual_microbatches(batch, k, "strided")
  per_mb = [jax.value_and_grad(noisy_loss, has_aux=True)(params, mb, s)
            for mb, s in zip(mbs, sub, strict=True)]
  np.testing.assert_allclose(loss, np.mean([float(o[0][0]) for o in per_mb]), rtol=RTOL)
  assert_trees_close(grads, jax.tree.map(lambda *g: sum(g) / k, *[o[1] for o in per_mb]))


def test_rng_raw_uint32_key_and_k1_folds_in_like_microbatch_0(params, batch):
  # k = 1 derives its key as micro-batch 0 of any k does: the key passed in
  # is never given to `fn` (it used to be, unchanged, for k = 1 only).
  key = jax.random.PRNGKey(7)
  fn = jax.value_and_grad(lambda p, b, kk: (mean_loss(p, b), kk), has_aux=True)
  (_, keys), _ = oa.microbatched(fn, 2, has_aux=True, aux_rules="stack", rng_argnums=2)(
      params, batch, key)
  assert not np.array_equal(keys[0], keys[1])
  (_, one), _ = oa.microbatched(fn, 1, has_aux=True, aux_rules="stack", rng_argnums=2)(
      params, batch, key)
  assert one.shape == (1, *key.shape) and one.dtype == key.dtype
  np.testing.assert_array_equal(one[0], jax.random.fold_in(key, 0))
  np.testing.assert_array_equal(one[0], keys[0])
  assert not np.array_equal(one[0], key)


# ------------------------------------------- k = 1 follows the rules of k > 1
def test_k1_aux_rules_apply_like_any_k(params, batch):
  fn = jax.value_and_grad(loss_with_aux, has_aux=True)
  (ref_loss, ref_aux), ref_grads = fn(params, batch)
  (loss, aux), grads = jax.jit(oa.microbatched(fn, 1, has_aux=True, aux_rules=AUX_RULES))(
      params, batch)
  assert_trees_close((loss, grads), (ref_loss, ref_grads))
  # "stack": one value per micro-batch, so a leading axis of 1.
  assert aux["mb_mean"].shape == (1,)
  np.testing.assert_allclose(aux["mb_mean"], [ref_aux["mb_mean"]], rtol=RTOL)
  # "concat": the whole batch, in order.
  assert aux["per_example"].shape == (16,)
  np.testing.assert_allclose(aux["per_example"], ref_aux["per_example"], rtol=RTOL, atol=ATOL)
  assert aux["count"] == 16 and aux["count"].dtype == jnp.int32
  for name in ("mean_abs_err", "max_err", "min_err", "last_y0"):
    np.testing.assert_allclose(aux[name], ref_aux[name], rtol=RTOL, err_msg=name)


def test_k1_custom_aux_rule_is_applied(params, batch):
  # Every stage leaves a mark: (0 + (i + 1) * v + 10) * 2 with i = 0.
  rule = AuxRule(init=lambda s: jnp.zeros(s.shape, s.dtype),
                 update=lambda c, v, i: c + (i + 1) * v + 10.0,
                 finalize=lambda c: 2.0 * c)
  fn = jax.value_and_grad(lambda p, b: (mean_loss(p, b), mean_loss(p, b)), has_aux=True)
  (_, aux), _ = jax.jit(oa.microbatched(fn, 1, has_aux=True, aux_rules=rule))(params, batch)
  np.testing.assert_allclose(aux, 2.0 * (float(mean_loss(params, batch)) + 10.0), rtol=RTOL)


def test_k1_rng_key_is_derived_never_passed(params, batch):
  key = jax.random.key(3)
  fn = jax.value_and_grad(noisy_loss, has_aux=True)
  (loss, keys), grads = jax.jit(oa.microbatched(
      fn, 1, has_aux=True, aux_rules="stack", rng_argnums=2))(params, batch, key)
  expected = jax.random.fold_in(key, 0)
  np.testing.assert_array_equal(keys, jax.random.key_data(expected)[None])
  assert not np.array_equal(keys[0], jax.random.key_data(key))
  # micro-batch 0 of any k gets the same key
  (_, keys4), _ = jax.jit(oa.microbatched(
      fn, 4, has_aux=True, aux_rules="stack", rng_argnums=2))(params, batch, key)
  np.testing.assert_array_equal(keys[0], keys4[0])
  (ref_loss, _), ref_grads = fn(params, batch, expected)
  assert_trees_close((loss, grads), (ref_loss, ref_grads))


# -------------------------------------------------------------------- dtypes
def test_bf16_gradients_accumulate_in_f32_and_come_back_bf16():
  # Each micro-batch's gradient is bf16(0.1); 512 of them. A bf16 running sum
  # stalls near 32 (its spacing there exceeds 0.1); the f32 one is exact.
  k = 512
  g = jnp.asarray(0.1, jnp.bfloat16)
  fn = lambda w, b: (jnp.sum(b).astype(jnp.bfloat16), jnp.full((3,), g) + 0 * w)
  w = jnp.zeros(3, jnp.bfloat16)
  b = jnp.ones((k,), jnp.bfloat16)
  loss, grads = jax.jit(oa.microbatched(fn, k))(w, b)
  assert grads.dtype == jnp.bfloat16 and loss.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(grads, np.float32), np.full(3, float(g)))
  # None is the default rule (bf16 -> f32); an explicit bf16 buffer is honoured.
  _, rule = jax.jit(oa.microbatched(fn, k, accumulator_dtype=None))(w, b)
  np.testing.assert_array_equal(np.asarray(rule, np.float32), np.full(3, float(g)))
  _, low = jax.jit(oa.microbatched(fn, k, accumulator_dtype=jnp.bfloat16))(w, b)
  assert low.dtype == jnp.bfloat16
  assert abs(float(low[0]) - float(g)) > 0.01


def test_mixed_dtype_gradients_keep_their_dtypes(batch):
  params = {"a": jnp.ones(5, jnp.bfloat16), "b": jnp.ones(5, jnp.float32)}
  def loss(p, b):
    return jnp.mean(b["x"] @ (p["a"].astype(jnp.float32) * p["b"]))
  _, ref_grads = jax.value_and_grad(loss)(params, batch)
  _, grads = oa.microbatched(jax.value_and_grad(loss), 4)(params, batch)
  assert grads["a"].dtype == jnp.bfloat16 and grads["b"].dtype == jnp.float32
  assert_trees_close(grads, ref_grads, rtol=1e-2, atol=1e-2)


def _x64():
  """A context that enables float64 (jax >= 0.9: `jax.enable_x64`; older: experimental)."""
  if hasattr(jax, "enable_x64"):
    return jax.enable_x64(True)
  from jax.experimental import enable_x64
  return enable_x64()


def abs2_loss(w, x):
  return jnp.sum(jnp.abs(x @ w) ** 2)


def complex_problem(seed=0, n=8, d=3):
  rng = np.random.default_rng(seed)
  w = jnp.asarray(rng.normal(size=d) + 1j * rng.normal(size=d), jnp.complex64)
  x = jnp.asarray(rng.normal(size=(n, d)) + 1j * rng.normal(size=(n, d)), jnp.complex64)
  return w, x


@pytest.mark.parametrize("normalize", ["sum", "mean"])
def test_complex64_gradients_keep_the_imaginary_part(normalize):
  w, x = complex_problem()
  loss = abs2_loss if normalize == "sum" else (lambda w, x: abs2_loss(w, x) / x.shape[0])
  ref_loss, ref_grads = jax.value_and_grad(loss)(w, x)
  assert np.min(np.abs(np.imag(ref_grads))) > 0.1  # the part that used to be dropped
  out_loss, grads = jax.jit(oa.microbatched(jax.value_and_grad(loss), 4, normalize=normalize))(
      w, x)
  assert grads.dtype == jnp.complex64 and out_loss.dtype == ref_loss.dtype
  assert_trees_close((out_loss, grads), (ref_loss, ref_grads), rtol=1e-5, atol=1e-5)


def test_complex_aux_mean_and_sum_keep_the_imaginary_part():
  w, x = complex_problem(seed=1)
  def loss(w, x):
    z = x @ w
    return jnp.mean(jnp.abs(z) ** 2), {"mean": jnp.mean(z), "sum": jnp.sum(z)}
  fn = jax.value_and_grad(loss, has_aux=True)
  (_, ref_aux), _ = fn(w, x)
  (_, aux), _ = oa.microbatched(fn, 4, has_aux=True, aux_rules={"mean": "mean", "sum": "sum"})(
      w, x)
  assert aux["mean"].dtype == aux["sum"].dtype == jnp.complex64
  assert abs(np.imag(ref_aux["sum"])) > 0.1
  assert_trees_close(aux, ref_aux, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rule", ["mean", "sum", "max", "last", "stack"])
def test_a_python_number_in_the_aux_is_a_value_like_any(rule):
  """A loss returning ``{"n": x.shape[0]}`` (a Python int) raised AttributeError."""
  def loss(w, x):
    return jnp.sum(x @ w), {"rows": x.shape[0], "half": 0.5}

  (_, aux), _ = oa.microbatched(jax.value_and_grad(loss, has_aux=True), 4, has_aux=True,
                                aux_rules=rule)(jnp.ones(3), jnp.ones((8, 3)))
  expected = {"mean": 2, "sum": 8, "max": 2, "last": 2, "stack": [2, 2, 2, 2]}[rule]
  np.testing.assert_array_equal(aux["rows"], expected)
  assert np.asarray(aux["half"]).shape == np.shape(expected)


def test_integer_aux_mean_is_a_float_and_sum_stays_an_integer():
  """A count per micro-batch (strided rows i and i + 4 of 0..7 above 2.5: 1, 1, 1, 2):
  its mean is 1.25, not truncated to the count's dtype; its sum keeps int32."""
  def loss(w, x):
    count = jnp.sum(x > 2.5).astype(jnp.int32)
    return jnp.mean(w * x), {"mean": count, "sum": count}
  fn = jax.value_and_grad(loss, has_aux=True)
  (_, aux), _ = jax.jit(oa.microbatched(fn, 4, has_aux=True, aux_rules={
      "mean": "mean", "sum": "sum"}))(1.0, jnp.arange(8.0))
  assert aux["mean"].dtype == jnp.float32 and float(aux["mean"]) == 1.25
  assert aux["sum"].dtype == jnp.int32 and int(aux["sum"]) == 5


def test_real_accumulator_dtype_for_complex_values_raises():
  w, x = complex_problem()
  fn = oa.microbatched(jax.value_and_grad(abs2_loss), 2, accumulator_dtype=jnp.float32)
  with pytest.raises(TypeError, match=r"`accumulator_dtype=float32` is real.*complex"):
    fn(w, x)


def tiny_signal_problem():
  """Micro-batch 0's gradient is 1, micro-batch 1's is 1e-12: float32 sums lose it."""
  w = jnp.asarray([1.0, 0.5], jnp.float64)
  x = jnp.asarray([[1.0, 1.0], [1e-12, -1e-12]], jnp.float64)
  return w, x


def test_float64_under_x64_accumulates_in_float64():
  with _x64():
    w, x = tiny_signal_problem()
    assert x.dtype == jnp.float64
    loss = lambda w, x: jnp.sum(x @ w)
    value, grads = jax.jit(oa.microbatched(jax.value_and_grad(loss), 2, normalize="sum"))(w, x)
    assert value.dtype == grads.dtype == jnp.float64
    x64, w64 = np.asarray(x), np.asarray(w)  # the float64 reference: column sums
    ref_grads, ref_value = x64[0] + x64[1], x64[0] @ w64 + x64[1] @ w64
    assert ref_grads[0] - 1.0 > 0.9e-12  # the signal is there in float64 ...
    assert np.float32(1.0) + np.float32(1e-12) == 1.0  # ... and gone in float32
    np.testing.assert_allclose(grads, ref_grads, rtol=0, atol=1e-15)
    np.testing.assert_allclose(value, ref_value, rtol=0, atol=1e-15)


def test_explicit_narrower_accumulator_dtype_is_honoured():
  with _x64():
    w, x = tiny_signal_problem()
    loss = lambda w, x: jnp.sum(x @ w)
    value, grads = oa.microbatched(jax.value_and_grad(loss), 2, normalize="sum",
                                accumulator_dtype=jnp.float32)(w, x)
    assert value.dtype == grads.dtype == jnp.float64  # cast back to fn's dtypes
    np.testing.assert_array_equal(grads, [1.0, 1.0])  # the 1e-12 rounded away in float32
    assert float(value) == 1.5


# ------------------------------------------------ composed with accumulate
def test_microbatched_inside_step_and_accumulate_across_steps(params):
  """2 steps x 4 micro-batches with weighted normalisation across both levels
  equal one SGD step on the full 16-example batch's token-mean gradient (SGD,
  not Adam, whose first step is only the gradient's sign)."""
  import optax

  from optax_accum.accumulation import accumulate

  full = token_batch(n=16, seed=4, lengths=[6, 1, 0, 2, 5, 0, 3, 1, 6, 6, 0, 1, 2, 2, 4, 0])
  steps = [jax.tree.map(lambda x, s=s: x[s * 8:(s + 1) * 8], full) for s in range(2)]
  def loss(p, b):
    num, den = token_sum_loss(p, b)
    return num, (den, den)  # the token count also comes out as an aux
  grad_fn = oa.microbatched(jax.value_and_grad(loss, has_aux=True), 4, normalize="weighted",
                         has_aux=True, aux_rules="sum")
  tx = accumulate(2, optax.sgd(0.5), reduction="weighted")
  def step(p, state, b):
    (_, tokens), grads = grad_fn(p, b)
    updates, state = tx.update(grads, state, p, weight=tokens)
    return optax.apply_updates(p, updates), state
  step = jax.jit(step)
  p, state = params, tx.init(params)
  for b in steps:
    p, state = step(p, state, b)
  assert int(state.gradient_step) == 1
  ref_grads = jax.grad(token_mean_loss)(params, full)
  expected = jax.tree.map(lambda w, g: w - 0.5 * g, params, ref_grads)
  assert_trees_close(p, expected, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------- remat
def deep_loss(params, batch, *, remat_policy=None):
  def layer(w, h):
    return jnp.tanh(h @ w)
  if remat_policy is not None:
    layer = jax.checkpoint(layer, policy=remat_policy)
  h = batch["x"]
  for w in params["ws"]:
    h = layer(w, h)
  return jnp.mean((h.sum(-1) - batch["y"]) ** 2)


@pytest.mark.parametrize("policy", [jax.checkpoint_policies.nothing_saveable,
                                    jax.checkpoint_policies.dots_with_no_batch_dims_saveable])
def test_remat_inside_microbatch_gives_same_gradients(batch, policy):
  keys = jax.random.split(jax.random.key(5), 3)
  params = {"ws": [jax.random.normal(k, (5, 5)) * 0.4 for k in keys]}
  ref = jax.value_and_grad(deep_loss)(params, batch)
  remat_loss = functools.partial(deep_loss, remat_policy=policy)
  out = jax.jit(oa.microbatched(jax.value_and_grad(remat_loss), 4))(params, batch)
  assert_trees_close(out, ref)
  # The recomputation really is there: more tanh ops than without remat.
  count = lambda f: jax.jit(f).lower(params, batch).as_text().count("tanh")
  assert count(oa.microbatched(jax.value_and_grad(remat_loss), 4)) > count(
      oa.microbatched(jax.value_and_grad(deep_loss), 4))


# -------------------------------------------------------------------- memory
def wide_loss(params, batch):
  h = jax.nn.relu(batch["x"] @ params["w1"])
  h = jax.nn.relu(h @ params["w2"])
  return jnp.mean((h @ params["w3"] - batch["y"]) ** 2)


def temp_bytes(f, *args):
  return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_temporaries_shrink_with_k_under_bound():
  d, hidden, n = 32, 512, 1024
  ks = jax.random.split(jax.random.key(0), 3)
  params = {"w1": jax.ShapeDtypeStruct((d, hidden), jnp.float32),
            "w2": jax.ShapeDtypeStruct((hidden, hidden), jnp.float32),
            "w3": jax.ShapeDtypeStruct((hidden,), jnp.float32)}
  del ks
  batch = {"x": jax.ShapeDtypeStruct((n, d), jnp.float32),
           "y": jax.ShapeDtypeStruct((n,), jnp.float32)}
  grad_bytes = sum(math.prod(p.shape) * 4 for p in jax.tree.leaves(params))
  full = temp_bytes(jax.value_and_grad(wide_loss), params, batch)
  premise(full > 4 * grad_bytes,  # activations dominate: the regime that matters
          f"the whole batch's activations are temporaries of memory_analysis() (got {full:,}"
          f" bytes for gradients of {grad_bytes:,})")
  # The loop's own overhead: on XLA:CPU one gradient-sized accumulator; the
  # H200 compiler (deviceless compile, benchmarks/gpu_hlo.py's setup) keeps
  # the carry and the body's gradients apart: about three gradient buffers.
  overhead = 1 if jax.default_backend() == "cpu" else 3
  for k in (2, 4, 8, 16):
    mb = temp_bytes(oa.microbatched(jax.value_and_grad(wide_loss), k), params, batch)
    assert mb <= 1.3 * full / k + overhead * grad_bytes, (k, mb, full, grad_bytes)


def test_no_peeled_microbatch_program_size(params, batch):
  # One copy of the loss in the program: as many dots as the full-batch call.
  count = lambda f: jax.jit(f).lower(params, batch).as_text().count("dot_general")
  full = count(jax.value_and_grad(mean_loss))
  assert count(oa.microbatched(jax.value_and_grad(mean_loss), 8)) == full


# ------------------------------------------------------- data parallel (axis)
def _mesh():
  devices = jax.devices()
  if len(devices) < 8:
    pytest.skip("needs 8 devices (tests/conftest.py forces 8 host CPU devices)")
  return Mesh(np.array(devices[:8]), ("data",))


def _shard_map_step(fn, mesh):
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))


def _put(mesh, params, batch):
  return (jax.device_put(params, NamedSharding(mesh, P())),
          jax.device_put(batch, NamedSharding(mesh, P("data"))))


def test_axis_name_shard_map_mean_equals_full_batch(params):
  mesh = _mesh()
  batch = make_batch(jax.random.key(9), 32)  # 4 per device, k=2 -> 2 per micro-batch
  fn = oa.microbatched(jax.value_and_grad(mean_loss), 2, axis_name="data")
  loss, grads = _shard_map_step(fn, mesh)(*_put(mesh, params, batch))
  assert_trees_close((loss, grads), jax.value_and_grad(mean_loss)(params, batch))


@pytest.mark.catches("scalars_averaged_across_devices")
def test_axis_name_shard_map_weighted_is_global(params):
  mesh = _mesh()
  lengths = [6, 0, 0, 0, 1, 0, 0, 0] + [0] * 8 + [6, 6, 6, 6, 5, 5, 5, 5] + [1] * 8
  batch = token_batch(n=32, seed=3, lengths=lengths)
  fn = oa.microbatched(jax.value_and_grad(token_sum_loss, has_aux=True), 2,
                    normalize="weighted", axis_name="data")
  loss, grads = _shard_map_step(fn, mesh)(*_put(mesh, params, batch))
  ref = jax.value_and_grad(token_mean_loss)(params, batch)
  assert_trees_close((loss, grads), ref)


def _primitives(jaxpr, inside_scan=False, found=None):
  """(primitive name, inside a scan body?) for every equation, recursively."""
  found = [] if found is None else found
  for eqn in jaxpr.eqns:
    found.append((eqn.primitive.name, inside_scan))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      _primitives(sub, inside_scan or eqn.primitive.name == "scan", found)
  return found


def test_axis_name_reduces_once_after_the_loop(params):
  mesh = _mesh()
  batch = make_batch(jax.random.key(9), 32)
  fn = oa.microbatched(jax.value_and_grad(mean_loss), 2, axis_name="data")
  jaxpr = jax.make_jaxpr(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data")),
                                       out_specs=P()))(params, batch)
  prims = _primitives(jaxpr.jaxpr)
  collectives = {"psum", "psum_invariant", "pmean", "all_reduce", "psum2"}
  assert any(name in collectives and not in_scan for name, in_scan in prims)
  assert not any(name in collectives and in_scan for name, in_scan in prims), prims
  assert any(name == "scan" for name, _ in prims)


def test_axis_name_pmap_equals_full_batch(params):
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices")
  batch = make_batch(jax.random.key(9), 32)
  sharded = jax.tree.map(lambda x: x.reshape(8, 4, *x.shape[1:]), batch)
  fn = oa.microbatched(jax.value_and_grad(mean_loss), 2, axis_name="d")
  loss, grads = jax.pmap(fn, axis_name="d", in_axes=(None, 0))(params, sharded)
  ref_loss, ref_grads = jax.value_and_grad(mean_loss)(params, batch)
  assert_trees_close(loss[3], ref_loss)
  assert_trees_close(jax.tree.map(lambda g: g[5], grads), ref_grads)


def test_axis_name_rng_differs_across_devices(params):
  mesh = _mesh()
  batch = make_batch(jax.random.key(9), 16)
  fn = oa.microbatched(jax.value_and_grad(noisy_loss, has_aux=True), 2, has_aux=True,
                    aux_rules="stack", rng_argnums=2, axis_name="data")
  step = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data"), P()),
                               out_specs=((P(), P("data")), P())))
  p, b = _put(mesh, params, batch)
  (_, keys), _ = step(p, b, jax.random.key(0))
  keys = np.asarray(keys).reshape(16, -1)  # 8 devices x 2 micro-batches
  assert len({tuple(r) for r in keys}) == 16


def test_axis_name_k1_rng_differs_across_devices(params):
  mesh = _mesh()
  batch = make_batch(jax.random.key(9), 16)
  key = jax.random.key(0)
  fn = oa.microbatched(jax.value_and_grad(noisy_loss, has_aux=True), 1, has_aux=True,
                    aux_rules="stack", rng_argnums=2, axis_name="data")
  step = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data"), P()),
                               out_specs=((P(), P("data")), P())))
  p, b = _put(mesh, params, batch)
  (loss, keys), grads = step(p, b, key)
  keys = np.asarray(keys)  # 8 devices x 1 micro-batch
  assert len({tuple(r.ravel()) for r in keys}) == 8
  # Device d, micro-batch 0: fold_in(fold_in(key, d), 0); the loss is their mean.
  dev_keys = [jax.random.fold_in(jax.random.fold_in(key, d), 0) for d in range(8)]
  np.testing.assert_array_equal(keys, np.stack([jax.random.key_data(k) for k in dev_keys]))
  shards = [jax.tree.map(lambda x, d=d: np.asarray(x)[2 * d:2 * d + 2], batch) for d in range(8)]
  per_dev = [jax.value_and_grad(noisy_loss, has_aux=True)(params, s, k)
             for s, k in zip(shards, dev_keys, strict=True)]
  np.testing.assert_allclose(loss, np.mean([float(o[0][0]) for o in per_dev]), rtol=RTOL)
  assert_trees_close(grads, jax.tree.map(lambda *g: sum(g) / 8, *[o[1] for o in per_dev]))


# ------------------------------------------------------------- split helper
def test_split_microbatches_matches_manual(batch):
  for split in ("strided", "contiguous"):
    stacked = split_microbatches(batch, 4, split)
    for i, mb in enumerate(manual_microbatches(batch, 4, split)):
      assert_trees_close(jax.tree.map(lambda x, i=i: x[i], stacked), mb, rtol=0, atol=0)


# ---------------------------------------------------------------- properties
# Each new shape compiles (two programs: the reference and microbatched): 10 examples over 96
# shapes (split="contiguous" is deprecated and tested once, in
# test_deprecated_options_warn_and_still_work).
@settings(max_examples=10, deadline=None)
@given(k=st.integers(1, 6), m=st.integers(1, 4), d=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_property_random_shapes_equal_full_batch(k, m, d, seed):
  rng = np.random.default_rng(seed)
  f32 = lambda *shape: jax.device_put(rng.normal(size=shape).astype(np.float32))
  params = {"w": f32(d), "c": f32()}
  batch = {"x": f32(k * m, d), "y": f32(k * m)}
  loss = lambda p, b: jnp.mean(jnp.sin(b["x"] @ p["w"] + p["c"]) * b["y"])
  # Both jitted: a program each per shape, not an eager one per op (test_mean_equals_full_batch
  # has the un-jitted call).
  ref = jax.jit(jax.value_and_grad(loss))(params, batch)
  out = jax.jit(oa.microbatched(jax.value_and_grad(loss), k))(params, batch)
  assert_trees_close(out, ref, rtol=1e-4, atol=1e-5)


@settings(max_examples=10, deadline=None)
@given(k=st.sampled_from([1, 2, 4]), lengths=st.lists(st.integers(0, SEQ), min_size=8,
                                                      max_size=8))
def test_property_weighted_any_padding_equals_full_batch(k, lengths):
  params = init_mlp(jax.random.key(0))
  batch = token_batch(lengths=lengths)
  out = oa.microbatched(jax.value_and_grad(token_sum_loss, has_aux=True), k,
                     normalize="weighted")(params, batch)
  if sum(lengths) == 0:
    assert float(out[0]) == 0.0
    return
  assert_trees_close(out, jax.value_and_grad(token_mean_loss)(params, batch),
                     rtol=1e-4, atol=1e-5)


PROPERTY_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32,
                   "float64": jnp.float64, "complex64": jnp.complex64}


def _numpy_reference(w, x, y, c):
  """float64/complex128: value sum(c |x w - y|^2), its JAX gradient, aux sum(x w),
  and the sums of absolute terms that bound the rounding of each."""
  r = x @ w - y
  value = np.sum(c * np.abs(r) ** 2)
  grads = 2 * x.T @ (c * np.conj(r))  # JAX's convention for complex: conj(dL/dw*) * 2
  aux = np.sum(x @ w)
  scales = (np.sum(c * np.abs(r) ** 2), 2 * np.abs(x).T @ (c * np.abs(r)),
            np.sum(np.abs(x) @ np.abs(w)))
  return (value, grads, aux), scales


def _property_loss(normalize):
  def loss(w, x, y, mask):
    per_example, aux = jnp.abs(x @ w - y) ** 2, jnp.sum(x @ w)
    if normalize == "weighted":
      return jnp.sum(per_example * mask), (jnp.sum(mask), aux)
    return (jnp.mean if normalize == "mean" else jnp.sum)(per_example), aux
  return loss


@functools.cache
def _property_fn(normalize, k):
  """One jitted function per (normalize, k), shared by the examples: each recompiles
  only for a new dtype or shape."""
  return jax.jit(oa.microbatched(
      jax.value_and_grad(_property_loss(normalize), has_aux=True), k, batch_argnums=(1, 2, 3),
      has_aux=True, normalize=normalize, aux_rules="sum"))


# Two shapes (k = 1, and k = 4 of 2 rows): the property is about dtypes; shapes are
# test_property_random_shapes_equal_full_batch's.
@settings(max_examples=15, deadline=None)
@given(dtype=st.sampled_from(sorted(PROPERTY_DTYPES)),
       normalize=st.sampled_from(["mean", "sum", "weighted"]),
       k_m=st.sampled_from([(1, 3), (4, 2)]), seed=st.integers(0, 2**16))
def test_property_dtypes_equal_wide_numpy_reference(dtype, normalize, k_m, seed):
  """Every dtype's accumulation is as exact as the dtype itself: bf16/f16 sum in
  f32, f64 (under x64) in f64, complex64 keeps its imaginary part."""
  (k, m), d = k_m, 3
  n = k * m
  is_complex = dtype.startswith("complex")
  with _x64() if dtype == "float64" else contextlib.nullcontext():
    rng = np.random.default_rng(seed)
    def draw(*shape):
      v = rng.normal(size=shape)
      return v + 1j * rng.normal(size=shape) if is_complex else v
    w, x, y = (jnp.asarray(draw(*s), PROPERTY_DTYPES[dtype]) for s in ((d,), (n, d), (n,)))
    mask = rng.integers(0, 2, size=n)
    mask[rng.integers(n)] = 1  # at least one real example
    mask_j = jnp.asarray(mask, w.real.dtype)
    (value, aux), grads = _property_fn(normalize, k)(w, x, y, mask_j)
    assert grads.dtype == w.dtype and aux.dtype == w.dtype and value.dtype == w.real.dtype
    wide = np.complex128 if is_complex else np.float64
    c = {"mean": np.full(n, 1 / n), "sum": np.ones(n), "weighted": mask / mask.sum()}[normalize]
    refs, scales = _numpy_reference(*(np.asarray(a, wide) for a in (w, x, y)), c)
  # float64's eps, or what its rounding measures where it is emulated (float64_eps)
  eps = float64_eps() if dtype == "float64" else float(jnp.finfo(PROPERTY_DTYPES[dtype]).eps)
  for name, out, ref, scale in zip(("value", "grads", "aux"), (value, grads, aux), refs, scales,
                                   strict=True):
    err = np.abs(np.asarray(out, wide) - ref)
    bound = 4 * (n + d + 4) * eps * scale
    assert np.all(err <= bound), (name, err, bound)


# ------------------------------------------------------- noise statistics
def sum_loss(params, batch):
  return jnp.sum(per_example_loss(params, batch))


# Strided k=4 over 8 rows: micro-batches 1 (rows 1, 5) and 3 (rows 3, 7) are
# pure padding, so two of the four count.
PADDED = [6, 0, 1, 0, 2, 0, 5, 0]


def _noise_problem(normalize):
  """`fn` for microbatched, and the per-micro-batch (gradient, weight) that
  accumulate sees for the same micro-batches, computed independently."""
  if normalize == "weighted":
    batch = token_batch(lengths=PADDED)
    fn = jax.value_and_grad(token_sum_loss, has_aux=True)
    def per_mb(p, b):
      _, den = token_sum_loss(p, b)
      return jax.grad(lambda q: token_sum_loss(q, b)[0] / den)(p), den
  else:
    batch = make_batch(jax.random.key(3), 8)
    loss = mean_loss if normalize == "mean" else sum_loss
    fn = jax.value_and_grad(loss)
    def per_mb(p, b):
      return jax.grad(loss)(p, b), None
  return batch, fn, per_mb


def _accumulate_window(params, per_mb, micro_batches, reduction, decay):
  """One window through accumulate(track_noise_scale=...): its folded state."""
  tx = oa.accumulate(len(micro_batches), None, reduction=reduction, track_noise_scale=decay)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for mb in micro_batches:
    g, w = per_mb(params, mb)
    _, state = update(g, state, params, **({} if w is None else {"weight": w}))
  return state.noise_stats


@pytest.mark.parametrize("normalize", ["mean", "sum", "weighted"])
def test_noise_stats_equal_what_accumulate_keeps(params, normalize):
  batch, fn, per_mb = _noise_problem(normalize)
  wrapped = oa.microbatched(fn, 4, normalize=normalize, return_noise_stats=True)
  out, stats = jax.jit(wrapped)(params, batch)
  # The outputs are unchanged by the option.
  assert_trees_close(out, oa.microbatched(fn, 4, normalize=normalize)(params, batch))
  assert int(stats.window_count) == (2 if normalize == "weighted" else 4)
  ref = _accumulate_window(params, per_mb, manual_microbatches(batch, 4, "strided"),
                           normalize, 0.9)
  mine = gradient_noise.fold(gradient_noise.init(), stats, decay=0.9)
  assert int(ref.num_windows) == int(mine.num_windows) == 1
  np.testing.assert_allclose(mine.signal, ref.signal, rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(mine.noise, ref.noise, rtol=1e-4, atol=1e-7)
  assert float(mine.noise) > 0  # a real estimate, not two zeros


def test_noise_stats_are_invariant_to_the_loss_scale(params):
  batch = make_batch(jax.random.key(4), 16)
  def ratio(scale):
    fn = jax.value_and_grad(lambda p, b: scale * mean_loss(p, b))
    _, stats = oa.microbatched(fn, 8, return_noise_stats=True)(params, batch)
    state = gradient_noise.fold(gradient_noise.init(), stats, decay=0.5)
    return float(state.noise / state.signal)
  assert np.isfinite(ratio(1.0))
  np.testing.assert_allclose(ratio(1000.0), ratio(1.0), rtol=1e-4)
  np.testing.assert_allclose(ratio(1e-3), ratio(1.0), rtol=1e-4)


def test_noise_stats_with_has_aux_and_k1(params, batch):
  fn = jax.value_and_grad(loss_with_aux, has_aux=True)
  ((loss, aux), grads), stats = oa.microbatched(fn, 1, has_aux=True, return_noise_stats=True)(
      params, batch)
  (ref_loss, ref_aux), ref_grads = fn(params, batch)
  assert_trees_close((loss, aux, grads), (ref_loss, ref_aux, ref_grads))
  assert int(stats.window_count) == 1  # one micro-batch: fold leaves the estimate alone
  np.testing.assert_allclose(stats.window_sq_norms, stats.mean_sq_norm, rtol=1e-6)
  assert int(gradient_noise.fold(gradient_noise.init(), stats).num_windows) == 0


def test_noise_scale_of_linear_regression_is_near_the_closed_form():
  # x ~ N(0, I_d), y = x.w* + sigma * eps, loss 0.5 * mean residual^2, at
  # w = w* + delta: per example G = delta, tr(Sigma) = (d + 1)|delta|^2 + sigma^2 d.
  d, sigma, b, k, windows = 4, 1.0, 4, 8, 400
  delta = jnp.ones(d) / 2.0  # |delta|^2 = 1
  w_star = jnp.arange(d, dtype=jnp.float32)
  b_simple = ((d + 1) * 1.0 + sigma**2 * d) / 1.0  # 9 examples
  def loss(w, batch):
    return 0.5 * jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
  fn = oa.microbatched(jax.value_and_grad(loss), k, return_noise_stats=True)

  def window(state, key):
    kx, ke = jax.random.split(key)
    x = jax.random.normal(kx, (k * b, d))
    batch = {"x": x, "y": x @ w_star + sigma * jax.random.normal(ke, (k * b,))}
    _, stats = fn(w_star + delta, batch)
    return gradient_noise.fold(state, stats, decay=0.99), None
  keys = jax.random.split(jax.random.key(0), windows)
  state, _ = jax.jit(lambda s: lax.scan(window, s, keys))(gradient_noise.init())
  estimate = float(oa.noise_scale(state)) * b  # micro-batches -> examples
  assert abs(estimate - b_simple) < 0.2 * b_simple, (estimate, b_simple)


@xla_cpu_fact("bytes of memory_analysis() temporaries (on a TPU v5e the noise statistics"
              " added 0.64x the parameters' bytes to a program that reported none)")
def test_noise_stats_add_no_parameter_sized_memory():
  d, hidden, n = 32, 512, 1024
  params = {"w1": jax.ShapeDtypeStruct((d, hidden), jnp.float32),
            "w2": jax.ShapeDtypeStruct((hidden, hidden), jnp.float32),
            "w3": jax.ShapeDtypeStruct((hidden,), jnp.float32)}
  batch = {"x": jax.ShapeDtypeStruct((n, d), jnp.float32),
           "y": jax.ShapeDtypeStruct((n,), jnp.float32)}
  param_bytes = sum(math.prod(p.shape) * 4 for p in jax.tree.leaves(params))
  fn = jax.value_and_grad(wide_loss)
  without = temp_bytes(oa.microbatched(fn, 8), params, batch)
  with_stats = temp_bytes(oa.microbatched(fn, 8, return_noise_stats=True), params, batch)
  assert abs(with_stats - without) <= 0.05 * param_bytes, (with_stats, without, param_bytes)


def test_noise_stats_under_shard_map_span_all_devices_in_the_one_reduction(params):
  mesh = _mesh()
  batch = make_batch(jax.random.key(9), 32)  # 4 rows per device, k=2
  def step(return_noise_stats):
    fn = oa.microbatched(jax.value_and_grad(mean_loss), 2, axis_name="data",
                      return_noise_stats=return_noise_stats)
    out_specs = (P(), P()) if return_noise_stats else P()
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data")),
                                 out_specs=out_specs))
  p, b = _put(mesh, params, batch)
  out, stats = step(True)(p, b)
  assert_trees_close(out, jax.value_and_grad(mean_loss)(params, batch))
  assert int(stats.window_count) == 16
  device_mbs = [mb for dev in range(8) for mb in manual_microbatches(
      jax.tree.map(lambda x, dev=dev: np.asarray(x)[4 * dev:4 * dev + 4], batch), 2, "strided")]
  ref = _accumulate_window(params, lambda q, mb: (jax.grad(mean_loss)(q, mb), None),
                           device_mbs, "mean", 0.9)
  mine = gradient_noise.fold(gradient_noise.init(), stats, decay=0.9)
  np.testing.assert_allclose((mine.signal, mine.noise), (ref.signal, ref.noise), rtol=1e-4)
  # The statistics ride in the gradients' reduction: no extra collective.
  count = lambda f: sum(c.op.startswith("all-reduce")
                        for c in hlo_collectives(f.lower(p, b).compile()))
  assert count(step(True)) == count(step(False)) == 1


# ---------------------------------------------------------------- bad inputs
# A bad `num_microbatches` and an indivisible batch: tests/test_batch_rules.py, for both
# wrappers at once.
@pytest.mark.parametrize("kwargs, exc, pattern", [
    ({"normalize": "avg"}, ValueError, "`normalize` must be one of"),
    ({"split": "random"}, ValueError, "`split` must be one of"),
    ({"rng_mode": "reuse"}, ValueError, "`rng_mode` must be one of"),
    ({"aux_rules": "median"}, ValueError, "`aux_rules` holds 'median'"),
    ({"batch_argnums": "1"}, TypeError, "`batch_argnums` must be an int"),
    ({"batch_argnums": ()}, ValueError, "`batch_argnums` is empty"),
    ({"has_aux": 1}, TypeError, "`has_aux` must be a bool"),
    ({"return_noise_stats": "yes"}, TypeError, "`return_noise_stats` must be a bool"),
    ({"accumulator_dtype": jnp.int32}, TypeError, "`accumulator_dtype` must be a floating"),
])
def test_bad_options(kwargs, exc, pattern):
  with pytest.raises(exc, match=re.compile(pattern)):
    oa.microbatched(jax.value_and_grad(mean_loss), 2, **kwargs)


@pytest.mark.parametrize("option, value", [
    ("split", "contiguous"), ("rng_mode", "split"), ("accumulator_dtype", jnp.float32),
    ("unroll", 2)])
def test_deprecated_options_warn_and_still_work(params, batch, option, value):
  """One release of the 0.2.0 options: a DeprecationWarning naming the option, and
  the numbers of micro-batches cut and keyed by hand as the option says (the only
  test of each option's behaviour: contiguous rows, split keys)."""
  k, key = 4, jax.random.key(42)
  fn = jax.value_and_grad(noisy_loss, has_aux=True)
  with pytest.warns(DeprecationWarning, match=f"`{option}=` is deprecated"):
    wrapped = oa.microbatched(fn, k, has_aux=True, aux_rules="stack", rng_argnums=2,
                              **{option: value})
  (loss, keys), grads = wrapped(params, batch, key)
  split = value if option == "split" else "strided"
  sub = (list(jax.random.split(key, k)) if option == "rng_mode"
         else [jax.random.fold_in(key, i) for i in range(k)])
  np.testing.assert_array_equal(keys, np.stack([jax.random.key_data(s) for s in sub]))
  per_mb = [fn(params, mb, s) for mb, s in zip(manual_microbatches(batch, k, split), sub,
                                               strict=True)]
  np.testing.assert_allclose(loss, np.mean([float(o[0][0]) for o in per_mb]), rtol=RTOL)
  assert_trees_close(grads, jax.tree.map(lambda *g: sum(g) / k, *[o[1] for o in per_mb]))


def test_default_options_do_not_warn(params, batch):
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    oa.microbatched(jax.value_and_grad(mean_loss), 4)(params, batch)


def test_unknown_keyword_is_an_error_naming_the_parameters():
  with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['splt'\].*rng_argnums"):
    oa.microbatched(jax.value_and_grad(mean_loss), 2, splt="contiguous")


def test_bad_fn():
  with pytest.raises(TypeError, match="`fn` must be callable"):
    oa.microbatched("not a function", 2)


def test_bad_batches(params):
  fn = oa.microbatched(jax.value_and_grad(mean_loss), 2)
  with pytest.raises(ValueError, match=r"argument 1\['x'\] has 8 rows but argument 1\['y'\]"
                     r" has 6|argument 1\['y'\] has 6"):
    fn(params, {"x": jnp.ones((8, 5)), "y": jnp.ones(6)})
  with pytest.raises(ValueError, match="is a scalar"):
    fn(params, {"x": jnp.ones((8, 5)), "y": jnp.ones(())})
  with pytest.raises(ValueError, match="`batch_argnums` contains 1"):
    fn(params)
  with pytest.raises(ValueError, match="no array leaves"):
    fn(params, {})


def test_bad_fn_outputs(params, batch):
  with pytest.raises(TypeError, match=r"must return `\(value, grads\)`"):
    oa.microbatched(lambda p, b: mean_loss(p, b), 2)(params, batch)
  with pytest.raises(TypeError, match="has_aux=True needs"):
    oa.microbatched(jax.value_and_grad(mean_loss), 2, has_aux=True)(params, batch)
  with pytest.raises(TypeError, match=r"normalize='weighted' needs `fn`'s value"):
    oa.microbatched(jax.value_and_grad(mean_loss), 2, normalize="weighted")(params, batch)
  vec_den = jax.value_and_grad(lambda p, b: (mean_loss(p, b), b["y"]), has_aux=True)
  with pytest.raises(ValueError, match="scalar denominator"):
    oa.microbatched(vec_den, 2, normalize="weighted")(params, batch)


def test_bad_aux_rules_at_call_time(params, batch):
  fn = jax.value_and_grad(loss_with_aux, has_aux=True)
  with pytest.raises(ValueError, match="prefix of the aux"):
    oa.microbatched(fn, 2, has_aux=True, aux_rules={"nope": "sum"})(params, batch)
  scalar_aux = jax.value_and_grad(lambda p, b: (mean_loss(p, b), mean_loss(p, b)), has_aux=True)
  with pytest.raises(ValueError, match="Use 'stack'"):
    oa.microbatched(scalar_aux, 2, has_aux=True, aux_rules="concat")(params, batch)


def test_overlapping_rng_and_batch_argnums(params, batch):
  fn = oa.microbatched(jax.value_and_grad(noisy_loss, has_aux=True), 2, has_aux=True,
                    rng_argnums=1)
  with pytest.raises(ValueError, match="overlap"):
    fn(params, batch, jax.random.key(0))
