"""Whatever layout the user gives the optimizer state, every path takes the large batch's step.

The matrix: the state laid out like the params, or ZeRO-1 style (the inner
optimizer's state sharded over ``"data"`` on its leading dim wherever that
divides by the device count, beside replicated params); Auto and Explicit mesh
axes; the four ways a step reaches the params (``update`` + ``apply_updates``,
``update_and_apply``, ``oa.MultiSteps``, ``oa.flax.TrainState.apply_gradients``).
Each is compared with an independent one-device reference: the optimizer
applied once per window to the gradient of the whole window as one batch.
One optimizer holds both kinds: SGD with momentum, scale-sensitive (a
gradient summed over devices, or reduced twice, moves the params by another
amount), and Adam, whose moments carry across windows.
Where the axes are Explicit the layout is in the types: the params come back
in the params' layout and the state in the one it was given.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum as oa
from optax_accum.flax import TrainState
from tests._reference import assert_trees_close

N_DEV, K, WINDOWS, ROWS = 8, 2, 2, 4
pytestmark = pytest.mark.skipif(jax.device_count() < N_DEV, reason="needs 8 devices")

# One optimizer, one compiled step per case: SGD with momentum on "w" and "c", Adam on "b".
OPTIMIZER = optax.multi_transform(
    {"sgd": optax.sgd(0.3, momentum=0.9), "adam": optax.adam(0.1)},
    {"w": "sgd", "b": "adam", "c": "sgd"})
PATHS = ("update", "update_and_apply", "multi_steps", "train_state")


def loss(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
  x, y = batch
  return jnp.mean((jnp.tanh((x + params["b"]) @ params["w"]) + params["c"] - y) ** 2)


def init_params() -> dict[str, np.ndarray]:
  # "w" and "b" have a leading dim of 8 (sharded under ZeRO-1), "c" of 3 (replicated).
  rng = np.random.default_rng(0)
  return {"w": rng.normal(size=(8, 3)).astype(np.float32) * 0.5,
          "b": rng.normal(size=(8,)).astype(np.float32) * 0.1,
          "c": np.zeros(3, np.float32)}


def batches() -> list[list[tuple[np.ndarray, np.ndarray]]]:
  rng = np.random.default_rng(1)
  return [[(rng.normal(size=(ROWS, 8)).astype(np.float32),
            rng.normal(size=(ROWS, 3)).astype(np.float32)) for _ in range(K)]
          for _ in range(WINDOWS)]


@functools.cache
def large_batch() -> list[Any]:
  """The params after each window: one step on the whole window's gradient, one device."""
  opt, params = OPTIMIZER, jax.tree.map(jnp.asarray, init_params())
  state, history = opt.init(params), []
  for window in batches():
    whole = tuple(np.concatenate(parts) for parts in zip(*window, strict=True))
    updates, state = opt.update(jax.grad(loss)(params, whole), state, params)
    params = optax.apply_updates(params, updates)
    history.append(params)
  return history


@functools.cache
def mesh(kind: str) -> jax.sharding.Mesh:
  return jax.make_mesh((N_DEV,), ("data",), axis_types=(getattr(AxisType, kind),))


def zero1(tree: Any, mesh: jax.sharding.Mesh) -> Any:
  """Each leaf sharded over ``"data"`` on its leading dim where it divides, else replicated."""
  return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P(
      "data") if jnp.ndim(x) and jnp.shape(x)[0] % N_DEV == 0 else P())), tree)


def make_step(path: str, tx: Any) -> Any:
  """``step(params, opt_state, batch) -> (params, opt_state)`` for ``path``, jitted."""
  def step(params: Any, opt_state: Any, batch: Any) -> Any:
    grads = jax.grad(loss)(params, batch)
    if path == "update":
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state
    if path == "train_state":
      state = TrainState(step=0, apply_fn=None, params=params, tx=tx, opt_state=opt_state)
      state = state.apply_gradients(grads=grads)
      return state.params, state.opt_state
    return oa.update_and_apply(tx, grads, opt_state, params)
  return jax.jit(step)


@pytest.mark.parametrize("kind", ["Explicit", "Auto"])
@pytest.mark.parametrize("path", PATHS)
def test_every_state_layout_takes_the_large_batch_step(path: str, kind: str) -> None:
  m = mesh(kind)
  tx = oa.MultiSteps(OPTIMIZER, K) if path == "multi_steps" else oa.accumulate(K, OPTIMIZER)
  step = make_step(path, tx)  # one compiled step per layout of the state
  for layout in ("params'", "zero1"):
    params = jax.device_put(init_params(), NamedSharding(m, P()))
    state = tx.init(params)
    if layout == "zero1":
      state = state._replace(inner_opt_state=zero1(state.inner_opt_state, m))
    given = jax.tree.map(lambda x: x.sharding, state)
    for window, expected in zip(batches(), large_batch(), strict=True):
      for batch in window:
        params, state = step(params, state, jax.device_put(batch, NamedSharding(m, P())))
      assert_trees_close(params, expected)
      if kind == "Explicit":  # the layout is in the types: nothing moved
        assert not any(e for x in jax.tree.leaves(params) for e in x.sharding.spec), layout
        assert all(jax.tree.leaves(jax.tree.map(
            lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), state, given))), layout


def test_a_field_added_to_the_per_device_list_is_followed_everywhere(
    monkeypatch: pytest.MonkeyPatch) -> None:
  """``_state.STATE`` is the one list: ``init``, ``per_device_state``, ``shard_map_specs``,
  ``reshard_state`` and ``update``'s checks all lay out (or check) what it names."""
  from optax_accum import _state
  from optax_accum.sharding import per_device_state, reshard_state, shard_map_specs

  tx = oa.accumulate(2, optax.sgd(0.1), axis_name="data")
  def init_on(n: int) -> Any:  # plain jit on a mesh of n devices
    m = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    return tx.init(jax.device_put({"w": jnp.zeros(3)}, NamedSharding(m, P())))

  before = init_on(N_DEV)
  monkeypatch.setattr(_state, "STATE", (*_state.STATE, "gradient_step"))
  # init: one copy per device, sharded over the data axis.
  after = init_on(N_DEV)
  assert after.gradient_step.shape == (N_DEV,) and after.gradient_step.sharding.spec == P("data")
  # update's checks: a state without the copies is refused, naming the field.
  grads = jax.device_put({"w": jnp.zeros((N_DEV, 3))}, after.acc_grads["w"].sharding)
  with pytest.raises(ValueError, match=r"accumulator at \.gradient_step has shape \(\)"):
    tx.update(grads, before, {"w": jnp.zeros(3)})
  # reshard_state: the saved copies are summed onto the first device.
  saved = jax.device_get(after)._replace(gradient_step=np.ones(N_DEV, np.int32))
  assert reshard_state(saved, init_on(2)).gradient_step.tolist() == [N_DEV, 0]
  # shard_map: per_device_state gives it a leading axis, shard_map_specs the data axis.
  wrapped = per_device_state(oa.accumulate(2, optax.sgd(0.1), axis_name="data"), "data")
  specs = shard_map_specs(wrapped, {"w": jnp.zeros(3)}, "data")
  assert specs.gradient_step == P("data") and specs.mini_step == P()
  state = jax.jit(jax.shard_map(wrapped.init, mesh=mesh("Explicit"), in_specs=P(),
                                out_specs=specs))({"w": jnp.zeros(3)})
  assert state.gradient_step.shape == (N_DEV,) and state.mini_step.shape == ()
