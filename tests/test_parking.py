"""The updates parked in the buffer.

Once a window closes its buffer is dead, so the emitting step writes the
updates there and ``update`` returns ``where(emitted, buffer, 0)``
(``_window.parking``). These tests check that the parked updates read back
bit for bit, that a leaf parks only where it fits exactly, and that the
noise estimate, which reads the window's sum too, still sees it.
"""

from __future__ import annotations

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
from tests._reference import (
  accumulate_run,
  assert_trees_close,
  init_params,
  large_batch_run,
  make_windows,
)


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
  assert got == {"w": parks}


def test_parking_is_per_leaf_and_off_where_the_buffer_is_busy() -> None:
  updates = {"a": _sds("float32"), "b": _sds("bfloat16")}
  buffer = {"a": jnp.zeros(3, jnp.bfloat16), "b": jnp.zeros(3, jnp.bfloat16)}
  assert _window.parking(_config(), updates, buffer) == {"a": False, "b": True}
  f32 = {"a": jnp.zeros(3), "b": jnp.zeros(3)}
  # The noise estimate reads the sum before the updates are written: they
  # park. A cross-device reduction materialises the sum elsewhere: none parks.
  assert _window.parking(_config(noise_decay=0.9), updates, f32) == {"a": True, "b": True}
  assert _window.parking(_config(axis_name="data"), updates, f32) == {"a": False, "b": False}
  # Nor when applying: no updates leave the step.
  assert _window.parking(_config(), updates, f32, apply=True) == {"a": False, "b": False}
  # Another shape (a per-device buffer) never parks.
  assert _window.parking(_config(), {"w": _sds("float32", (2, 3))},
                         {"w": jnp.zeros(3)}) == {"w": False}


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
  assert decisions[-1] == {"b": True, "w": True}
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
def test_parked_updates_are_the_unparked_ones(
    dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
  """Read back from the buffer, the updates are the ones returned directly.

  Unparked, the micro-batch is added before the conditional instead of in
  its branches, so XLA:CPU fuses the arithmetic differently: equal to an
  ulp or two (the read-back itself is exact: same dtype or an exact widening,
  ``test_updates_keep_their_precision_with_a_narrow_buffer``)."""
  params = {"w": jnp.linspace(-1.0, 1.0, 6, dtype=dtype).reshape(2, 3), "b": jnp.ones(3, dtype)}
  grads = [jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 1)).astype(p.dtype), params)
           for i in range(9)]
  tx = lambda: oa.accumulate(3, optax.adam(1e-2))
  parked = _run(tx(), params, grads)
  real = _window.parking
  monkeypatch.setattr(_window, "parking", lambda *a, **kw: jax.tree.map(
      lambda _: False, real(*a, **kw)))
  unparked = _run(tx(), params, grads)
  chex.assert_trees_all_close(parked, unparked, rtol=1e-6, atol=0)
  chex.assert_trees_all_equal_dtypes(parked, unparked)
  for i, u in enumerate(parked):  # mid-steps: exact zeros; emits: not
    assert all(bool(jnp.all(x == 0)) == (i % 3 != 2) for x in jax.tree.leaves(u)), i


@pytest.mark.catches("updates_rounded_to_the_buffer")
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


@pytest.mark.catches("closing_micro_batch_dropped")
def test_noise_tracking_equals_large_batch() -> None:
  """The estimate reads the window's sum where the inner optimizer does, and
  the updates then overwrite it: SGD, scale-sensitive, equals the large batch."""
  params, windows = init_params(jax.random.key(5)), make_windows(seed=3, k=3, n=3)
  ref = large_batch_run(optax.sgd(0.1), params, windows)
  got, state = accumulate_run(
      oa.accumulate(3, optax.sgd(0.1), track_noise_scale=True), params, windows)
  for r, g in zip(ref, got, strict=True):
    assert_trees_close(r, g)
  assert int(state.noise_stats.num_windows) == 3


@pytest.mark.parametrize("track_noise_scale", [False, True])
def test_after_an_emitting_step_the_buffer_holds_the_updates(track_noise_scale: bool) -> None:
  """The protocol path writes the updates into the buffer; ``update_and_apply``
  (nothing to park) adds the closing micro-batch inside the update and leaves
  the buffer unwritten, unless the noise estimate reads the window's sum (then
  the buffer holds it). Either is discarded by the next window's lazy reset."""
  params, grads = {"w": jnp.ones(3)}, {"w": jnp.array([1.0, 2.0, 4.0])}
  tx = oa.accumulate(1, optax.sgd(0.5), track_noise_scale=track_noise_scale)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  np.testing.assert_array_equal(updates["w"], -0.5 * grads["w"])
  np.testing.assert_array_equal(state.acc_grads["w"], updates["w"])
  new_params, state = jax.jit(lambda g, s, p: oa.update_and_apply(tx, g, s, p))(
      grads, tx.init(params), params)
  np.testing.assert_array_equal(new_params["w"], params["w"] - 0.5 * grads["w"])
  window_sum = grads["w"] if track_noise_scale else jnp.zeros(3)
  np.testing.assert_array_equal(state.acc_grads["w"], window_sum)


@pytest.mark.parametrize("use_multi_steps", [False, True], ids=["accumulate", "MultiSteps"])
def test_noise_tracking_changes_no_update(use_multi_steps: bool) -> None:
  """With and without the estimate, the same updates bit for bit (momentum
  SGD over four windows): reading the sum for the norm changes nothing."""
  params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.zeros(4)}
  grads = [jax.tree.map(lambda p, i=i: jnp.cos(p * (i + 2)) + 0.1 * i, params)
           for i in range(12)]

  def run(track: Any) -> list[Any]:
    make = oa.MultiSteps if use_multi_steps else oa.accumulate
    tx = make(optax.sgd(0.1, momentum=0.9), 3, track_noise_scale=track) if use_multi_steps \
        else make(3, optax.sgd(0.1, momentum=0.9), track_noise_scale=track)
    state, p, out = tx.init(params), params, []
    update = jax.jit(tx.update)
    for g in grads:
      u, state = update(g, state, p)
      p = optax.apply_updates(p, u)
      out.append(u)
    return out

  chex.assert_trees_all_equal(run(0.9), run(False))
