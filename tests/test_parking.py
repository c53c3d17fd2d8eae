"""The updates parked in the buffer, and the core's per-backend branch order.

Once a window closes its buffer is dead, so the emitting step writes the
updates there and ``update`` returns ``where(stepped, buffer, 0)``
(``_window.parking``). These tests check that the parked updates read back
bit for bit, that a leaf parks only where it fits exactly, and that the
layouts XLA:GPU and TPU compile (their ``lax.platform_dependent`` branches)
train exactly like the one XLA:CPU compiles.
"""

from __future__ import annotations

import types
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum as oa
from optax_accum import _window
from tests import test_accumulate, test_noise_scale


def _config(**kw: Any) -> _window.Config:
  return _window.Config(k=4, inner=optax.sgd(0.1), **kw)


def _sds(dtype: Any, shape: tuple[int, ...] = (3,)) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


@pytest.mark.parametrize(
    ("updates", "buffer", "parks"),
    [
        ("float32", "float32", True),
        ("bfloat16", "float32", True),  # bf16 params, f32 buffer: exact
        ("float16", "float32", True),
        ("float32", "bfloat16", False),  # accumulator_dtype narrower: would round
        ("float32", "float16", False),
        ("complex64", "complex64", True),
        ("float32", "complex64", False),
    ],
)
def test_a_leaf_parks_only_where_it_reads_back_exactly(updates: str, buffer: str,
                                                       parks: bool) -> None:
  got = _window.parking(_config(), {"w": _sds(updates)}, {"w": jnp.zeros(3, buffer)})
  assert got == ([True] if parks else None)


def test_parking_is_per_leaf_and_off_where_the_buffer_is_busy() -> None:
  updates = {"a": _sds("float32"), "b": _sds("bfloat16")}
  buffer = {"a": jnp.zeros(3, jnp.bfloat16), "b": jnp.zeros(3, jnp.bfloat16)}
  assert _window.parking(_config(), updates, buffer) == [False, True]
  f32 = {"a": jnp.zeros(3), "b": jnp.zeros(3)}
  # The noise estimate keeps the window's sum in the buffer; a cross-device
  # reduction materialises the sum elsewhere: neither parks.
  assert _window.parking(_config(noise_decay=0.9), updates, f32) is None
  assert _window.parking(_config(axis_name="data"), updates, f32) is None
  # Another shape (a per-device buffer) never parks.
  assert _window.parking(_config(), {"w": _sds("float32", (2, 3))}, {"w": jnp.zeros(3)}) is None


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py)")
def test_sharded_params_park_and_equal_large_batch(monkeypatch: pytest.MonkeyPatch) -> None:
  """FSDP-style params on an Explicit mesh, no ``axis_name``: every leaf parks
  (the buffer and the updates share the params' sharding), and training
  equals the large-batch step computed without a mesh."""
  decisions: list[Any] = []
  real = _window.parking
  monkeypatch.setattr(_window, "parking",
                      lambda *a, **kw: decisions.append(real(*a, **kw)) or decisions[-1])
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  rng = np.random.default_rng(0)
  host = {"w": rng.normal(size=(8, 4)).astype(np.float32), "b": np.zeros(4, np.float32)}
  grads = [jax.tree.map(lambda x, i=i: np.sin(x + i).astype(np.float32), host) for i in range(4)]
  specs = {"w": P("data", "model"), "b": P("model")}
  with jax.set_mesh(mesh):
    put = lambda t: jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), t, specs)
    tx = oa.accumulate(2, optax.adam(0.1))
    params = put(host)
    state = tx.init(params)

    @jax.jit
    def step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
      updates, s = tx.update(g, s, p)
      return optax.apply_updates(p, updates), s

    for g in grads:
      params, state = step(params, state, put(g))
    assert jax.typeof(params["w"]).sharding.spec == P("data", "model")
  assert decisions[-1] == [True, True]
  ref, ref_state = host, optax.adam(0.1).init(host)
  for window in (grads[:2], grads[2:]):
    mean = jax.tree.map(lambda a, b: (a + b) / 2, *window)
    updates, ref_state = optax.adam(0.1).update(mean, ref_state, ref)
    ref = optax.apply_updates(ref, updates)
  chex.assert_trees_all_close(jax.tree.map(np.asarray, params), ref, rtol=1e-6, atol=1e-7)


def _run(tx: optax.GradientTransformation, params: Any, grads: list[Any]) -> list[Any]:
  state = tx.init(params)
  update = jax.jit(tx.update)
  out = []
  for g in grads:
    u, state = update(g, state, params)
    out.append(u)
    params = optax.apply_updates(params, u)
  return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_parked_updates_are_the_unparked_ones_bit_for_bit(
    dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
  params = {"w": jnp.linspace(-1.0, 1.0, 6, dtype=dtype).reshape(2, 3), "b": jnp.ones(3, dtype)}
  grads = [jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 1)).astype(p.dtype), params)
           for i in range(9)]
  tx = lambda: oa.accumulate(3, optax.adam(1e-2))
  parked = _run(tx(), params, grads)
  monkeypatch.setattr(_window, "parking", lambda *a, **kw: None)
  unparked = _run(tx(), params, grads)
  chex.assert_trees_all_equal(parked, unparked)
  chex.assert_trees_all_equal_dtypes(parked, unparked)
  for i, u in enumerate(parked):  # mid-steps: exact zeros; emits: not
    assert all(bool(jnp.all(x == 0)) == (i % 3 != 2) for x in jax.tree.leaves(u)), i


def test_updates_keep_their_precision_with_a_narrow_buffer() -> None:
  """A bf16 buffer holds the gradients, never the f32 updates.

  The gradients are small integers (exact in bf16, and so is their mean);
  SGD's update -0.1 * mean is not a bf16 number, so parking it in the buffer
  would round it.
  """
  params = {"w": jnp.zeros(4)}
  tx = oa.accumulate(2, optax.sgd(0.1), accumulator_dtype=jnp.bfloat16)
  grads = [{"w": jnp.array([1.0, 2.0, 3.0, 5.0])}, {"w": jnp.array([2.0, 5.0, 7.0, 8.0])}]
  updates = _run(tx, params, grads)[-1]
  mean = (np.array([1.0, 2.0, 3.0, 5.0], np.float32) + np.array([2, 5, 7, 8], np.float32)) / 2
  np.testing.assert_array_equal(np.asarray(updates["w"]), np.float32(-0.1) * mean)


def _lowered_for(platform: str, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
  """The core as ``platform``'s compiler gets it, traced and run on this CPU.

  ``lax.platform_dependent`` picks a branch when the program is lowered for
  a platform: this makes it pick ``platform``'s (or the default; ``"cpu"``
  is what this machine gets anyway).
  """
  taken: list[bool] = []

  def pick(*args: Any, default: Any, **per_platform: Any) -> Any:
    taken.append(True)
    return per_platform.get(platform, default)(*args)

  monkeypatch.setattr(_window, "lax", types.SimpleNamespace(
      **{**vars(jax.lax), "platform_dependent": pick}))
  return taken


_acc = test_accumulate
LAYOUT_CHECKS = {
    "sgd equals large batch": lambda: _acc.test_equals_large_batch_for_every_optimizer("sgd"),
    "adam equals large batch": lambda: _acc.test_equals_large_batch_for_every_optimizer("adam"),
    "zero-weight window": _acc.test_weighted_zero_weight_micro_batch_and_zero_weight_window,
    "NaN never poisons a later window": _acc.test_nan_never_poisons_a_later_window,
    "noise estimate": test_noise_scale.test_weighted_windows_give_average_micro_batches,
}


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("name", sorted(LAYOUT_CHECKS))
def test_the_gpu_and_tpu_layouts_train_like_the_cpu_one(
    name: str, platform: str, monkeypatch: pytest.MonkeyPatch) -> None:
  """The branch order (and, with noise tracking, the parking) chosen for
  XLA:GPU and TPU, run here: the same answers as the large batch."""
  taken = _lowered_for(platform, monkeypatch)
  LAYOUT_CHECKS[name]()
  assert taken, "the core did not reach its per-backend choice"


@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
def test_noise_tracking_equals_large_batch_on_every_layout(platform: str) -> None:
  """Where the window's sum is made differs per backend with the noise
  estimate (XLA:CPU adds the closing micro-batch into the buffer first, the
  others sum it on the fly): SGD, scale-sensitive, equals the large batch."""
  params, windows = _acc.init_params(jax.random.key(5)), _acc._windows(seed=3)
  ref = _acc.large_batch_run(optax.sgd(0.1), params, windows)
  with pytest.MonkeyPatch.context() as monkeypatch:
    taken = _lowered_for(platform, monkeypatch)
    got, state = _acc._run_accumulate(
        oa.accumulate(_acc.K, optax.sgd(0.1), track_noise_scale=True), params, windows)
  assert taken
  for r, g in zip(ref, got, strict=True):
    _acc.assert_trees_close(r, g)
  assert int(state.noise_stats.num_windows) == _acc.NUM_WINDOWS


def test_noise_tracking_parks_except_on_the_tpu(monkeypatch: pytest.MonkeyPatch) -> None:
  """With the noise estimate the updates park where that holds no more
  temporaries (XLA:GPU, XLA:CPU); on a TPU the window's sum stays in the
  buffer. Read from the buffer after an emitting step."""
  params, grads = {"w": jnp.ones(3)}, {"w": jnp.array([1.0, 2.0, 4.0])}
  for platform, buffer_holds in (("cuda", "updates"), ("cpu", "updates"), ("tpu", "sum")):
    tx = oa.accumulate(1, optax.sgd(0.5), track_noise_scale=True)  # a new trace each time
    taken = _lowered_for(platform, monkeypatch)
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert taken, platform
    np.testing.assert_array_equal(updates["w"], -0.5 * grads["w"])
    want = updates if buffer_holds == "updates" else grads
    np.testing.assert_array_equal(state.acc_grads["w"], want["w"], err_msg=platform)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("use_multi_steps", [False, True], ids=["accumulate", "MultiSteps"])
def test_noise_tracking_gives_the_same_updates_and_estimate_on_every_layout(
    use_multi_steps: bool, platform: str, monkeypatch: pytest.MonkeyPatch) -> None:
  """XLA:CPU parks the updates and reads the window's sum from the buffer
  (its norm first); the GPU layout parks and sums the window on the fly; the
  TPU layout sums on the fly and keeps the sum in the buffer. Same numbers."""
  params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.zeros(4)}
  grads = [jax.tree.map(lambda p, i=i: jnp.cos(p * (i + 2)) + 0.1 * i, params)
           for i in range(12)]

  def run() -> tuple[list[Any], Any]:
    if use_multi_steps:
      tx = oa.MultiSteps(optax.sgd(0.1, momentum=0.9), 3, track_noise_scale=0.9)
    else:
      tx = oa.accumulate(3, optax.sgd(0.1, momentum=0.9), track_noise_scale=0.9)
    state, p, out = tx.init(params), params, []
    update = jax.jit(tx.update)
    for g in grads:
      u, state = update(g, state, p)
      p = optax.apply_updates(p, u)
      out.append(u)
    noise = state.skip_state[1] if use_multi_steps else state.noise_stats
    return out, noise

  cpu_updates, cpu_noise = run()
  taken = _lowered_for(platform, monkeypatch)
  other_updates, other_noise = run()
  assert taken
  chex.assert_trees_all_close(other_updates, cpu_updates, rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(other_noise, cpu_noise, rtol=1e-6, atol=1e-9)
