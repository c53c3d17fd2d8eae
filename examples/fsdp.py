"""FSDP + tensor parallelism on a 2-D mesh with gradient accumulation.

The params are sharded over a ``data x model`` mesh (ZeRO-3 style over
``data``, tensor parallel over ``model``), the batch over ``data``. Plain
``jax.jit`` partitions the step; :func:`optax_accum.sharding.state_shardings`
lays the accumulation buffer and Adam's moments out exactly like the params,
so no device ever holds a full copy of either. The run is checked against
single-device large-batch training (Adam on the gradient of each whole
window).

Run on 8 host CPU devices (no accelerator needed)::

    python examples/fsdp.py --windows 5 --k 4

On a GPU/TPU host with 8 devices the same script runs unchanged.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before jax is imported
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum as oa
from optax_accum.sharding import state_shardings

D_IN, D_HID, D_OUT = 16, 32, 8
SPECS = {"w1": P("data", "model"), "b1": P("model"), "w2": P("model", "data"), "b2": P()}


def init_params(seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {
      "w1": (rng.normal(size=(D_IN, D_HID)) / np.sqrt(D_IN)).astype(np.float32),
      "b1": np.zeros(D_HID, np.float32),
      "w2": (rng.normal(size=(D_HID, D_OUT)) / np.sqrt(D_HID)).astype(np.float32),
      "b2": np.zeros(D_OUT, np.float32),
  }


def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
  h = jax.nn.gelu(x @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


def make_data(windows: int, k: int, batch: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """A fixed random teacher network to regress on."""
  rng = np.random.default_rng(seed)
  teacher = init_params(seed + 1)
  x = rng.normal(size=(windows, k, batch, D_IN)).astype(np.float32)
  y = np.asarray(jnp.tanh(x @ teacher["w1"]) @ teacher["w2"])
  return x, y


def main(argv: list[str] | None = None) -> dict[str, float]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--windows", type=int, default=5, help="optimizer steps")
  parser.add_argument("--k", type=int, default=4, help="micro-batches per step")
  parser.add_argument("--micro-batch", type=int, default=16, help="examples per micro-batch")
  parser.add_argument("--lr", type=float, default=3e-2)
  parser.add_argument("--quiet", action="store_true")
  args = parser.parse_args(argv)
  if jax.device_count() < 8:
    raise SystemExit(
        f"This example needs 8 devices (got {jax.device_count()}); on CPU set"
        " XLA_FLAGS=--xla_force_host_platform_device_count=8 before starting Python.")

  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
  host_params = init_params(0)
  params = jax.tree.map(
      lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), host_params, SPECS)
  tx = oa.accumulate(args.k, optax.adam(args.lr))
  shardings = state_shardings(tx, params)  # buffer + Adam moments like the params
  state = jax.jit(tx.init, out_shardings=shardings)(params)
  param_shardings = jax.tree.map(lambda p: p.sharding, params)
  batch_sharding = NamedSharding(mesh, P("data"))

  def train_step(p: Any, s: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any, jax.Array]:
    value, grads = jax.value_and_grad(loss_fn)(p, x, y)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s, value

  step = jax.jit(
      train_step, in_shardings=(param_shardings, shardings, batch_sharding, batch_sharding),
      out_shardings=(param_shardings, shardings, NamedSharding(mesh, P())),
      donate_argnums=(0, 1))

  x, y = make_data(args.windows, args.k, args.micro_batch, seed=1)
  losses = []
  for w in range(args.windows):
    window_loss = 0.0
    for i in range(args.k):
      params, state, value = step(params, state, x[w, i], y[w, i])
      window_loss += float(value) / args.k
    losses.append(window_loss)
    if not args.quiet:
      print(f"step {w + 1}: loss {window_loss:.5f}")
  for name, leaf in state.acc_grads.items():  # still laid out like the params
    assert leaf.sharding.is_equivalent_to(params[name].sharding, leaf.ndim), name

  # Reference: single-device Adam on the gradient of each whole window.
  ref = jax.tree.map(jnp.asarray, host_params)
  opt = optax.adam(args.lr)
  opt_state = opt.init(ref)
  for w in range(args.windows):
    grads = jax.grad(loss_fn)(ref, x[w].reshape(-1, D_IN), y[w].reshape(-1, D_OUT))
    updates, opt_state = opt.update(grads, opt_state, ref)
    ref = optax.apply_updates(ref, updates)
  diff = max(float(jnp.max(jnp.abs(np.asarray(params[n]) - ref[n]))) for n in ref)
  result = {
      "initial_loss": float(loss_fn(host_params, x[0].reshape(-1, D_IN), y[0].reshape(-1, D_OUT))),
      "final_loss": float(loss_fn(params, x[0].reshape(-1, D_IN), y[0].reshape(-1, D_OUT))),
      "max_abs_diff_vs_large_batch": diff,
  }
  if not args.quiet:
    print(f"max |params - single-device large batch| = {diff:.2e}")
    mu = state.inner_opt_state[0].mu
    print(f"w1 sharding: {params['w1'].sharding.spec} | buffer:"
          f" {state.acc_grads['w1'].sharding.spec} | adam mu: {mu['w1'].sharding.spec}")
  return result


if __name__ == "__main__":
  main()
