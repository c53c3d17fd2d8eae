"""Save the accumulation state mid-window with orbax and resume exactly.

Run: ``python examples/checkpoint_resume.py`` (needs ``pip install orbax-checkpoint``).

The state is a plain pytree (a NamedTuple of arrays), so it goes into a
checkpoint with the parameters. Save it at any micro-step: the partly filled
buffer and the micro-step count come back, and the resumed run is
bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import optax_accum as oa

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
  print("OK")


if __name__ == "__main__":
  main()
