"""Save the accumulation state mid-window with orbax and resume exactly, on 1 device and on 8.

Run: ``python examples/checkpoint_resume.py`` (needs ``pip install orbax-checkpoint``).

The state is a plain pytree (a NamedTuple of arrays), so it goes into a
checkpoint with the parameters. Save it at any micro-step: the partly filled
buffer and the micro-step count come back, and the resumed run is
bit-identical to an uninterrupted one. The second part does the same on 8
(host CPU) devices under plain jit, where the buffer holds one partial sum per
device, and then resumes the same checkpoint on 4 devices through
``optax_accum.sharding.reshard_state``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# The second part's 8 devices (host CPU devices, before jax is imported).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum as oa
from optax_accum.sharding import local_value_and_grad, reshard_state

K = 4
tx = oa.accumulate(K, optax.adam(1e-2))


def loss_fn(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


@jax.jit
def train_step(params, opt_state, x, y):
  grads = jax.grad(loss_fn)(params, x, y)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def train(params, opt_state, x, y, start, stop):
  for i in range(start, stop):
    params, opt_state = train_step(params, opt_state, x[i], y[i])
  return params, opt_state


def main() -> None:
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(3 * K, 8, 3)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(3 * K, 8, 1)), jnp.float32)
  params = {"w": jnp.zeros((3, 1)), "b": jnp.zeros(1)}

  uninterrupted, _ = train(params, tx.init(params), x, y, 0, 3 * K)

  stop = K + 2  # interrupted two micro-batches into the second window
  p, s = train(params, tx.init(params), x, y, 0, stop)
  with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / "step_6"
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, {"params": p, "opt_state": s})
    checkpointer.wait_until_finished()
    # After a restart: build the target from `init`, then restore into it.
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                          {"params": params, "opt_state": tx.init(params)})
    restored = checkpointer.restore(path, target)
  print(f"restored mid-window: mini_step={int(restored['opt_state'].mini_step)}")
  resumed, _ = train(restored["params"], restored["opt_state"], x, y, stop, 3 * K)

  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  print("resumed == uninterrupted, bit for bit")
  many_devices(x, y, params)
  print("OK")


def many_devices(x: jax.Array, y: jax.Array, host_params: dict[str, jax.Array]) -> None:
  """Plain jit on every device, saved mid-window; resumed on all of them, then on half."""
  tx_dp = oa.accumulate(K, optax.adam(1e-2), axis_name="data")
  grad_fn = local_value_and_grad(loss_fn, "data", batch_argnums=(1, 2))
  step = jax.jit(lambda p, s, xb, yb: oa.update_and_apply(tx_dp, grad_fn(p, xb, yb)[1], s, p))

  def run(mesh, params, state, start, stop):
    rows = NamedSharding(mesh, P("data"))
    for i in range(start, stop):
      params, state = step(params, state, *jax.device_put((x[i], y[i]), rows))
    return params, state

  def fresh(mesh):  # the params and the state `init` builds on `mesh`
    params = jax.device_put(host_params, NamedSharding(mesh, P()))
    return params, tx_dp.init(params)

  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("data",))
  uninterrupted, _ = run(mesh, *fresh(mesh), 0, 3 * K)
  stop = K + 2
  p, s = run(mesh, *fresh(mesh), 0, stop)
  print(f"{n} devices: the buffer {jax.typeof(s.acc_grads['w'])}, one partial sum per device")
  with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / "step_6"
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, {"params": p, "opt_state": s})
    checkpointer.wait_until_finished()
    # The same mesh: restore into the state `init` builds there.
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, dict(zip(
        ("params", "opt_state"), fresh(mesh), strict=True)))
    restored = checkpointer.restore(path, target)
    resumed, _ = run(mesh, restored["params"], restored["opt_state"], stop, 3 * K)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    print(f"{n} devices: resumed == uninterrupted, bit for bit")
    # Half the devices: restore as host arrays, then lay the state out for the new mesh.
    half = jax.make_mesh((max(1, n // 2),), ("data",), devices=jax.devices()[:max(1, n // 2)])
    meta = checkpointer.metadata(path).item_metadata.tree
    host = checkpointer.restore(path, jax.tree.map(lambda m: np.empty(m.shape, m.dtype), meta))
  params, state = fresh(half)
  params = reshard_state(host["params"], params)
  state = reshard_state(host["opt_state"], state)  # the 8 partial sums, combined
  resumed, _ = run(half, params, state, stop, 3 * K)
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  print(f"{half.size} devices: resumed == uninterrupted, to float rounding")


if __name__ == "__main__":
  main()
