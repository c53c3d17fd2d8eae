"""A 16-bit accumulation buffer that rounds stochastically: unbiased and reproducible.

``accumulator_dtype=jnp.bfloat16`` (or ``float16``) halves the buffer. Each
write computes the new value in float32 and rounds it up or down with the
probability that makes the rounding unbiased. Rounding to nearest would stall:
a bfloat16 sum of 1,024 ones is 256. Every test here fails under round to
nearest (``test_round_to_nearest_fails_these_tests`` checks that it does).
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum as oa
from optax_accum import _rounding

NARROW = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _make(kind: str, k: int, opt: Any, **kw: Any) -> Any:
  if kind == "MultiSteps":
    return oa.MultiSteps(opt, k, **kw)
  return oa.accumulate(k, opt, **kw)


def _window_mean(kind: str, dtype: Any, grads: list[Any], params: Any) -> Any:
  """What the chain form (identity optimizer) emits for one window of ``grads``."""
  tx = _make(kind, len(grads), optax.identity(), accumulator_dtype=dtype)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for g in grads:
    out, state = update(g, state, params)
  return out


@pytest.mark.parametrize("kind", ["accumulate", "MultiSteps"])
@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_a_long_window_of_ones_emits_one(kind: str, dtype: str) -> None:
  """1,024 micro-batches of ones: the mean is 1 (within 1%). Round to nearest
  emits 0.25 for ``accumulate`` (256 + 1 rounds back to 256 in bf16)."""
  params = {"w": jnp.zeros(4096)}
  ones = {"w": jnp.ones(4096)}
  out = _window_mean(kind, NARROW[dtype], [ones] * 1024, params)
  mean = float(jnp.mean(out["w"]))
  assert abs(mean - 1.0) < 0.01, mean


@pytest.mark.parametrize("kind", ["accumulate", "MultiSteps"])
@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_small_values_after_a_large_one_are_not_lost(kind: str, dtype: str) -> None:
  """512 then 511 micro-batches of 0.25: the sum is 639.75, not 512."""
  params = {"w": jnp.zeros(4096)}
  grads = [{"w": jnp.full(4096, 512.0)}] + [{"w": jnp.full(4096, 0.25)}] * 511
  out = _window_mean(kind, NARROW[dtype], grads, params)
  want = (512.0 + 511 * 0.25) / 512
  mean = float(jnp.mean(out["w"]))
  assert abs(mean - want) < 0.01 * want, (mean, want)


@pytest.mark.parametrize("dtype", sorted(NARROW))
def test_the_window_error_has_mean_zero(dtype: str) -> None:
  """Random streams (a large first gradient, then small ones, as late in a
  window when the sum dwarfs each addend), many elements and windows: the
  emitted mean's error against a float64 reference has mean zero within 4
  standard errors, and a spread within one rounding gap per add."""
  k, n, windows = 64, 2048, 4
  rng = np.random.default_rng(0)
  tx = oa.accumulate(k, optax.identity(), accumulator_dtype=NARROW[dtype])
  params = {"w": jnp.zeros(n)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  errors = []
  for _ in range(windows):
    stream = rng.exponential(0.05, size=(k, n)).astype(np.float32)
    stream[0] = rng.uniform(1.0, 2.0, size=n)
    for g in stream:
      out, state = update({"w": jnp.asarray(g)}, state, params)
    errors.append(np.asarray(out["w"], np.float64) - stream.astype(np.float64).mean(axis=0))
  err = np.concatenate(errors)
  standard_error = err.std() / np.sqrt(err.size)
  assert abs(err.mean()) < 4 * standard_error, (err.mean(), standard_error)
  # Each add's rounding error is at most one gap (eps times the sum, ~<6 here):
  # a random walk of k of them, divided by k.
  assert err.std() < float(jnp.finfo(NARROW[dtype]).eps) * 6.0 / np.sqrt(k), err.std()


def test_rounding_is_unbiased_value_by_value() -> None:
  """One rounding of x = 1 + 1/3 (between two bf16 neighbours): the average
  over many uniforms is x, not the nearest neighbour."""
  # Jitted, as the buffer calls it (eagerly, XLA:CPU compiles each op of the hash).
  round_stochastic = jax.jit(_rounding.round_stochastic, static_argnums=1)
  x = jnp.full((1 << 18,), 1.0 + 1.0 / 3.0, jnp.float32)
  for dtype in NARROW.values():
    y = round_stochastic(x, dtype, jax.jit(lambda: _rounding.random_bits(x.shape, [7]))())
    got = float(jnp.mean(y.astype(jnp.float32)))
    nearest = float(x[0].astype(dtype).astype(jnp.float32))
    assert abs(got - float(x[0])) < 0.05 * abs(nearest - float(x[0])), (got, nearest)
  special = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 0.0, 1.0, -2.0])
  for dtype in NARROW.values():
    out = round_stochastic(special, dtype, jnp.full(6, 2**32 - 1, jnp.uint32))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(special))


def test_every_position_of_a_leaf_draws_its_own_bits() -> None:
  """Rounding decisions are independent across a leaf's elements: the positions of a
  leaf of 4096 (64 x 64, 16 x 256, 4 x 32 x 32) get 4096 different draws, and the
  draws change with the counters (step, micro-step, leaf)."""
  for shape in ((64, 64), (16, 256), (4, 32, 32)):
    bits = np.asarray(_rounding.random_bits(shape, [7, 1, 0]))
    assert bits.shape == shape and len(np.unique(bits)) > 4090, shape
  a, b = (np.asarray(_rounding.random_bits((64, 64), c)) for c in ([7, 1, 0], [7, 2, 0]))
  assert np.mean(a == b) < 0.01


def _stream(n: int, seed: int = 0) -> list[Any]:
  rng = np.random.default_rng(seed)
  return [{"w": jnp.asarray(rng.normal(size=(64,)).astype(np.float32)),
           "b": jnp.asarray(rng.normal(size=(3, 5)).astype(np.float32))} for _ in range(n)]


@pytest.mark.parametrize("kind", ["accumulate", "MultiSteps"])
def test_reruns_and_mid_window_resume_are_bit_identical(kind: str) -> None:
  params = {"w": jnp.zeros(64), "b": jnp.zeros((3, 5))}
  grads = _stream(10)
  tx = _make(kind, 4, optax.sgd(0.1), accumulator_dtype=jnp.bfloat16)
  update = jax.jit(tx.update)

  def run(state: Any, stream: list[Any]) -> tuple[list[Any], Any]:
    outs = []
    for g in stream:
      u, state = update(g, state, params)
      outs.append(u)
    return outs, state

  first, state_a = run(tx.init(params), grads)
  again, state_b = run(tx.init(params), grads)
  chex.assert_trees_all_equal((first, state_a), (again, state_b))
  # A checkpoint taken mid-window (after 6 micro-batches: 2 into the second
  # window), restored from host copies, resumes bit for bit.
  head, mid_state = run(tx.init(params), grads[:6])
  restored = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), mid_state)
  tail, state_c = run(restored, grads[6:])
  chex.assert_trees_all_equal(head + tail, first)
  chex.assert_trees_all_equal(state_c, state_a)
  # Rounding does depend on the window: the buffer is not a fixed function of the values.
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state_a.acc_grads))


def test_the_state_holds_nothing_parameter_sized_but_the_buffer() -> None:
  params = {"w": jnp.zeros(1000)}
  for tx in (oa.accumulate(4, optax.sgd(0.1), accumulator_dtype=jnp.bfloat16),
             oa.MultiSteps(optax.sgd(0.1), 4, accumulator_dtype=jnp.bfloat16)):
    narrow = oa.accumulate(4, optax.sgd(0.1))
    sizes = lambda s: sorted(x.size for x in jax.tree.leaves(s))
    assert sizes(tx.init(params)) == sizes(narrow.init(params)) or (
        sizes(tx.init(params)) == sizes(oa.MultiSteps(optax.sgd(0.1), 4).init(params)))
    assert tx.init(params).acc_grads["w"].dtype == jnp.bfloat16


def test_skip_nonfinite_weighted_and_flush_with_a_narrow_buffer() -> None:
  """A NaN micro-batch is skipped, weights scale, a flush closes the window:
  the same answers (within bf16 rounding) as the float32 buffer."""
  params = {"w": jnp.zeros(256)}
  rng = np.random.default_rng(3)
  grads = [{"w": jnp.asarray(rng.normal(size=256).astype(np.float32))} for _ in range(7)]
  grads[2] = {"w": grads[2]["w"].at[5].set(jnp.nan)}
  weights = [1.0, 2.0, 3.0, 0.5, 1.0, 4.0, 2.0]

  def run(dtype: Any) -> Any:
    tx = oa.accumulate(4, optax.sgd(1.0), reduction="weighted", skip_nonfinite=True,
                       accumulator_dtype=dtype)
    state, outs = tx.init(params), []
    update = jax.jit(tx.update)
    for g, w in zip(grads, weights, strict=True):
      u, state = update(g, state, params, weight=jnp.float32(w))
      outs.append(u)
    u, state = oa.flush(tx, state, params)
    outs.append(u)
    return outs, state

  narrow, narrow_state = run(jnp.bfloat16)
  wide, wide_state = run(None)
  assert int(narrow_state.num_skipped) == int(wide_state.num_skipped) == 1
  assert int(narrow_state.gradient_step) == int(wide_state.gradient_step) == 2
  for n, w in zip(narrow, wide, strict=True):
    np.testing.assert_allclose(n["w"], w["w"], rtol=0, atol=0.05)
    assert bool(jnp.all(jnp.isfinite(n["w"])))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py)")
def test_axis_name_under_shard_map_with_a_narrow_buffer() -> None:
  """Each device keeps a bf16 buffer of its own gradients; one psum per window.
  256 micro-batches of 1/3 (not a bf16 number) per device, each device rounding
  with its own bits: mid-window the devices' buffers differ though their
  gradients are equal, and the window's mean over every device's micro-batches
  is 1/3."""
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  from optax_accum.sharding import per_device_state, shard_map_specs

  mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
  tx = per_device_state(
      oa.accumulate(256, optax.identity(), axis_name="data", accumulator_dtype=jnp.bfloat16),
      "data")
  params = {"w": jnp.zeros(512)}
  specs = shard_map_specs(tx, params, "data")

  def body(s: Any, x: jax.Array) -> Any:
    return tx.update({"w": x[0]}, s, params)

  run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P("data")),
                              out_specs=(P(), specs)))
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
  thirds = jnp.full((8, 512), 1 / 3)
  for i in range(256):
    out, state = run(state, thirds)
    if i == 99:
      copies = np.asarray(state.acc_grads["w"], np.float32)  # one row per device
      assert copies.shape == (8, 512)
      assert all(not np.array_equal(copies[0], row) for row in copies[1:])
  mean = float(jnp.mean(out["w"]))  # the global mean over devices and micro-batches
  assert abs(mean - 1 / 3) < 0.01 / 3, mean
  assert state.acc_grads["w"].dtype == jnp.bfloat16


def test_a_model_trains_to_the_f32_buffers_loss_at_k_64() -> None:
  """Linear regression, Adam, 64 micro-batches per step: the bf16 buffer's
  final loss is within 10% of the f32 buffer's (round to nearest stalls the
  window's sum and ends far off)."""
  rng = np.random.default_rng(0)
  w_true = rng.normal(size=(16,)).astype(np.float32)
  xs = rng.normal(size=(64 * 40, 4, 16)).astype(np.float32)
  ys = xs @ w_true + 0.1 * rng.normal(size=(64 * 40, 4)).astype(np.float32)
  loss = lambda p, x, y: jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

  def train(dtype: Any) -> float:
    tx = oa.accumulate(64, optax.adam(0.05), accumulator_dtype=dtype)
    params = {"w": jnp.zeros(16), "b": jnp.zeros(())}
    state = tx.init(params)

    @jax.jit
    def step(p: Any, s: Any, x: Any, y: Any) -> Any:
      return oa.update_and_apply(tx, jax.grad(loss)(p, x, y), s, p)

    for x, y in zip(xs, ys, strict=True):
      params, state = step(params, state, x, y)
    return float(loss(params, xs.reshape(-1, 16), ys.reshape(-1)))

  wide, narrow = train(None), train(jnp.bfloat16)
  assert narrow < 1.1 * wide + 1e-3, (narrow, wide)


def test_round_to_nearest_fails_these_tests(monkeypatch: pytest.MonkeyPatch) -> None:
  """The tests above are not vacuous: with the rounding replaced by rounding
  to nearest, the window of ones and the unbiasedness test fail."""
  monkeypatch.setattr(_rounding, "round_stochastic", lambda x, dtype, bits: x.astype(dtype))
  failed = []
  for test in (lambda: test_a_long_window_of_ones_emits_one("accumulate", "bfloat16"),
               lambda: test_small_values_after_a_large_one_are_not_lost("MultiSteps", "bfloat16"),
               lambda: test_the_window_error_has_mean_zero("bfloat16")):
    try:
      test()
    except AssertionError:
      failed.append(test)
  assert len(failed) == 3
