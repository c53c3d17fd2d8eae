"""debug.check_large_batch, on planted defects whose cause is known.

Each case's answer follows from the loss itself, not from the check: the
weights of a loss normalised per micro-batch are the micro-batches' shares of
the real rows (counted from the mask), a summed loss averaged again is off by
``k``, a mean divided by ``n - 1`` is off by ``(B - 1) / (B - k)``, and CLIP
and BatchNorm in training mode couple the examples of a batch.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optax_accum.debug import check_large_batch

K = 4
B = 32
_rng = np.random.default_rng(0)
X = jnp.asarray(_rng.normal(size=(B, 6)), jnp.float32)
Y = jnp.asarray(_rng.normal(size=(B, 1)), jnp.float32)
X2 = jnp.asarray(_rng.normal(size=(B, 6)), jnp.float32)  # CLIP's second modality
MASK = jnp.asarray(_rng.uniform(size=B) > 0.4, jnp.float32)  # 0: padding
PARAMS = {"w1": jnp.asarray(_rng.normal(size=(6, 16)) / 2.5, jnp.float32),
          "b1": jnp.zeros(16, jnp.float32),
          "w3": jnp.asarray(_rng.normal(size=(16, 16)) / 4, jnp.float32),
          "w2": jnp.asarray(_rng.normal(size=(16, 1)) / 4, jnp.float32)}


def per_example(p, x, y, dtype=jnp.float32):
  p = jax.tree.map(lambda a: a.astype(dtype), p)
  h = jnp.tanh(jnp.tanh(x.astype(dtype) @ p["w1"] + p["b1"]) @ p["w3"])
  return ((h @ p["w2"] - y.astype(dtype)) ** 2)[:, 0]


def mean_loss(p, x, y):
  return jnp.mean(per_example(p, x, y))


def mean_loss_bf16(p, x, y):  # bfloat16 compute, float32 params and gradients
  return jnp.mean(per_example(p, x, y, jnp.bfloat16)).astype(jnp.float32)


@functools.cache  # one jitted function per loss: its compilations are shared by the tests
def value_and_grad(loss, has_aux=False):
  return jax.jit(jax.value_and_grad(loss, has_aux=has_aux))


def checked(loss, *args, k=K, has_aux=False, **options):
  fn = value_and_grad(loss, has_aux)
  nums = tuple(range(1, len(args)))
  return check_large_batch(fn, k, batch_argnums=nums, has_aux=has_aux, **options)(*args)


def leaf_shares(grads) -> np.ndarray:
  """Each leaf's norm over the whole tree's: a uniform scale error ``s`` is ``|s| * this``."""
  norms = np.array([np.linalg.norm(np.asarray(g, np.float64)) for g in jax.tree.leaves(grads)])
  return norms / np.linalg.norm(norms)


def test_separable_mean_loss_is_equal_and_bf16_raises_no_false_alarm():
  f32 = checked(mean_loss, PARAMS, X, Y)
  assert f32.equal and f32.cause == "equal" and f32.weights is None
  assert f32.max_relative_error <= f32.tolerance < 1e-5
  assert f32.raise_if_different() is None
  for k in (4, 8):
    bf16 = checked(mean_loss_bf16, PARAMS, X, Y, k=k)
    assert bf16.cause == "equal", str(bf16)
    assert bf16.tolerance < 0.1  # a few percent, not a blanket pass
    # bfloat16's rounding is far above float32's tolerance: that one would be a false alarm.
    assert bf16.max_relative_error > 10 * f32.tolerance


def test_a_large_float32_batch_raises_no_false_alarm():
  """At 16384 rows the whole batch's own float32 rounding (1.5e-06 here) is three times
  one rounding of its norm: the check measures it on the batch permuted, which is what
  keeps it from reporting coupling."""
  rng = np.random.default_rng(1)
  x, y = (jnp.asarray(rng.normal(size=(16384, d)), jnp.float32) for d in (6, 1))
  report = checked(mean_loss, PARAMS, x, y, k=8)
  assert report.cause == "equal", str(report)
  eps = float(jnp.finfo(jnp.float32).eps)
  assert report.max_relative_error > 4 * eps  # above what an error budget of eps would allow
  assert report.tolerance < 1e-5


def masked_mean(p, x, y, m):  # the mean over the real rows of the batch it is given
  return jnp.sum(per_example(p, x, y) * m) / jnp.sum(m)


def test_padding_normalised_per_microbatch_gives_the_real_row_shares():
  report = checked(masked_mean, PARAMS, X, Y, MASK)
  counts = np.asarray(MASK).reshape(B // K, K).sum(axis=0)  # micro-batch i: rows i, i + K, ...
  assert len(set(counts.tolist())) > 1  # the planted case: unequal shares
  assert report.cause == "weights" and not report.equal
  np.testing.assert_allclose(report.weights, counts / counts.sum(), atol=1e-5)
  assert "normalize='weighted'" in report.fix
  # The error against an independent reference: the mean of the micro-batch means' gradients.
  micro = [jax.grad(masked_mean)(PARAMS, X[i::K], Y[i::K], MASK[i::K]) for i in range(K)]
  whole = jax.grad(masked_mean)(PARAMS, X, Y, MASK)
  diff = jax.tree.map(lambda w, *g: np.mean(np.stack(g), 0) - w, whole, *micro)
  expected = max(leaf_shares(diff) * np.linalg.norm(
      [np.linalg.norm(d) for d in jax.tree.leaves(diff)]) / np.linalg.norm(
      [np.linalg.norm(w) for w in jax.tree.leaves(whole)]))
  np.testing.assert_allclose(report.max_relative_error, expected, rtol=1e-4)
  with pytest.raises(AssertionError, match=r"cause 'weights'.*normalize='weighted'"):
    report.raise_if_different()
  assert "weights per micro-batch" in str(report) and "['w1']" in str(report)


def masked_terms(p, x, y, m):  # (sum of the real rows' losses, their count)
  return jnp.sum(per_example(p, x, y) * m), jnp.sum(m)


def test_the_same_loss_token_weighted_is_equal():
  fn = value_and_grad(masked_terms, has_aux=True)  # the value: (numerator, denominator)
  check = check_large_batch(fn, K, batch_argnums=(1, 2, 3), normalize="weighted")
  report = check(PARAMS, X, Y, MASK)
  assert report.cause == "equal", str(report)
  # A micro-batch of only padding (rows 0, 4, 8, ...): weight 0, not a NaN gradient.
  report = check(PARAMS, X, Y, MASK.at[0::K].set(0.0))
  assert report.cause == "equal" and np.isfinite(report.max_relative_error), str(report)
  # The tolerance keeps its epsilon floor (twice one float32 rounding of |G| and more).
  assert report.tolerance >= 2 * float(jnp.finfo(jnp.float32).eps)


def sum_loss(p, x, y):
  return jnp.sum(per_example(p, x, y))


def test_summed_loss_averaged_again_is_a_scale_of_k():
  report = checked(sum_loss, PARAMS, X, Y)
  assert report.cause == "scale"
  np.testing.assert_allclose(report.weights, [1 / K] * K, rtol=1e-6)
  # The accumulated gradient is the whole batch's over k: each leaf is off by (1 - 1/k).
  expected = (1 - 1 / K) * leaf_shares(jax.grad(sum_loss)(PARAMS, X, Y)).max()
  np.testing.assert_allclose(report.max_relative_error, expected, rtol=1e-5)
  assert "normalize='sum'" in report.fix and f"{K:.4g} times" in report.fix
  assert checked(sum_loss, PARAMS, X, Y, normalize="sum").cause == "equal"


def test_mean_loss_summed_is_a_scale_of_one_over_k():
  """The mirror case: each micro-batch's mean, summed, is ``k`` times the whole batch's."""
  report = checked(mean_loss, PARAMS, X, Y, normalize="sum")
  assert report.cause == "scale" and not report.equal
  np.testing.assert_allclose(report.weights, [1 / K] * K, rtol=1e-6)
  expected = (K - 1) * leaf_shares(jax.grad(mean_loss)(PARAMS, X, Y)).max()
  np.testing.assert_allclose(report.max_relative_error, expected, rtol=1e-5)
  assert "normalize='mean'" in report.fix and f"{1 / K:.4g} times" in report.fix


def test_a_defect_of_one_percent_is_found():
  """A mean over ``n - 1`` rows: the micro-batches give ``(B - 1) / (B - k)`` times the whole."""
  b = 320
  x, y = (jnp.asarray(_rng.normal(size=(b, d)), jnp.float32) for d in (6, 1))

  def bessel(p, x, y):
    return jnp.sum(per_example(p, x, y)) / (x.shape[0] - 1)

  report = checked(bessel, PARAMS, x, y)
  scale = (b - 1) / (b - K) - 1  # 0.95%
  expected = scale * leaf_shares(jax.grad(bessel)(PARAMS, x, y)).max()
  assert not report.equal and report.cause == "scale"
  np.testing.assert_allclose(report.max_relative_error, expected, rtol=1e-3)
  assert report.tolerance < expected / 100


def tower(p, x):
  e = jnp.tanh(x @ p["w1"]) @ p["w2"]
  return e / jnp.linalg.norm(e, axis=-1, keepdims=True)


def clip_loss(p, a, b):
  ea, eb = tower(p["a"], a), tower(p["b"], b)
  logits = jnp.exp(p["t"]) * ea @ eb.T
  d = jnp.arange(a.shape[0])
  return -(jnp.mean(jax.nn.log_softmax(logits)[d, d])
           + jnp.mean(jax.nn.log_softmax(logits.T)[d, d])) / 2


CLIP_PARAMS = {
    "a": {"w1": PARAMS["w1"], "w2": jnp.asarray(_rng.normal(size=(16, 4)), jnp.float32)},
    "b": {"w1": jnp.asarray(_rng.normal(size=(6, 16)) / 2.5, jnp.float32),
          "w2": jnp.asarray(_rng.normal(size=(16, 4)), jnp.float32)},
    "t": jnp.asarray(1.0, jnp.float32)}


def test_clip_is_coupling_for_every_k_but_one():
  report = checked(clip_loss, CLIP_PARAMS, X, X2)
  assert report.cause == "coupling" and report.weights is None
  assert report.max_relative_error > 0.05  # each micro-batch sees a quarter of the negatives
  assert "cached_microbatched" in report.fix
  assert checked(clip_loss, CLIP_PARAMS, X, X2, k=1).cause == "equal"  # why k = 1 proves nothing


class BatchNormNet(nn.Module):
  train: bool = True

  @nn.compact
  def __call__(self, x):
    h = nn.BatchNorm(use_running_average=not self.train)(nn.Dense(16)(x))
    return nn.Dense(1)(nn.relu(h))


@pytest.mark.parametrize("train", [True, False])
def test_flax_batchnorm_in_training_mode_is_coupling(train):
  model = BatchNormNet(train)
  variables = BatchNormNet(True).init(jax.random.key(0), X)

  def loss(params, stats, x, y):  # the new running statistics as the aux
    out, new = model.apply({"params": params, "batch_stats": stats}, x, mutable=["batch_stats"])
    return jnp.mean((out - y) ** 2), new.get("batch_stats", stats)

  fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
  report = check_large_batch(fn, K, batch_argnums=(2, 3), has_aux=True)(
      variables["params"], variables["batch_stats"], X, Y)
  if train:  # each micro-batch normalised with its own statistics: ghost batch norm
    assert report.cause == "coupling" and "BatchNorm" in report.fix
  else:  # the running statistics: no coupling
    assert report.cause == "equal", str(report)


def test_zero_gradient_is_equal():
  report = checked(lambda p, x, y: 0.0 * mean_loss(p, x, y), PARAMS, X, Y)
  assert report.cause == "equal" and report.max_relative_error == 0.0


def test_bad_input_names_the_argument_and_the_fix():
  with pytest.raises(ValueError, match=r"num_microbatches=3.*one of \[1, 2, 4, 8, 16, 32\]"):
    checked(mean_loss, PARAMS, X, Y, k=3)
  for fn in (mean_loss, jax.grad(mean_loss)):
    with pytest.raises(TypeError, match=r"jax\.value_and_grad\(loss_fn\)"):
      check_large_batch(fn, K, batch_argnums=(1, 2))(PARAMS, X, Y)


@pytest.mark.parametrize("key", [jax.random.key(0), jax.random.PRNGKey(0)],
                         ids=["typed", "raw"])
def test_a_prng_key_is_refused(key):
  def dropout_loss(p, x, y, key):
    keep = jax.random.bernoulli(key, 0.9, (x.shape[0],))
    return jnp.mean(per_example(p, x, y) * keep)

  with pytest.raises(ValueError, match=r"argument 3 is a PRNG key.*deterministic"):
    check_large_batch(jax.value_and_grad(dropout_loss), K, batch_argnums=(1, 2))(
        PARAMS, X, Y, key)


def test_too_few_gradient_entries_to_tell_weights_from_coupling_is_an_error():
  """Four micro-batch gradients of 3 entries combine into any gradient: no verdict."""
  def masked_mean(p, x, mask):
    per = ((x[:, :3] @ p["w"] - 1.0) ** 2)[:, 0] * mask
    return jnp.sum(per) / jnp.sum(mask)

  with pytest.raises(ValueError, match=r"3 gradient entries for num_microbatches=4.*< 3"):
    checked(masked_mean, {"w": jnp.ones((3, 1))}, X, MASK)
  # With as few entries, a loss that is the large batch still says so.
  exact = lambda p, x, y: jnp.mean(((x[:, :3] @ p["w"] - y) ** 2)[:, 0])
  assert checked(exact, {"w": jnp.ones((3, 1))}, X, Y).cause == "equal"
