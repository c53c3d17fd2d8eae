"""FSDP + tensor parallelism under plain ``jax.jit``, one gradient reduction per window.

The params are sharded over a ``data x model`` mesh (ZeRO-3 style over
``data``, tensor parallel over ``model``), the batch over ``data``. The mesh
axes are ``AxisType.Explicit`` and set with ``jax.set_mesh``: the gradients
are taken with respect to ``defer_reduction(params, "data")`` (all-gathered
over ``data`` for the forward pass, as FSDP does), so they come back
*unreduced*: each device's partial sum, with no communication.
``accumulate(k, opt, axis_name="data")`` adds each device's into its own copy
of the buffer (one per device, stacked along a leading axis sharded over
``data``: ordinary arrays, which checkpoint as they are), and when the window
closes reduce-scatters their sum once to the params' own sharding and steps
the optimizer there; its momentum is laid out like the params. The run is
checked against single-device large-batch training (SGD with momentum on the
gradient of each whole window: a gradient reduced twice, or summed instead of
averaged, would show).

Run on 8 host CPU devices (no accelerator needed)::

    python examples/fsdp.py --windows 5 --k 4

On a GPU/TPU host with 8 devices the same script runs unchanged.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before jax is imported
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import optax_accum as oa
from optax_accum.sharding import broadcast_like, defer_reduction

D_IN, D_HID, D_OUT = 16, 32, 8
MOMENTUM = 0.9
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
  z = x @ params["w1"]
  h = jax.nn.gelu(z + broadcast_like(params["b1"], z))
  if jax.sharding.get_abstract_mesh().empty:  # the single-device reference
    o = h @ params["w2"]
  else:  # contracts over "model": say how the result is sharded (an all-reduce)
    o = jnp.einsum("bh,ho->bo", h, params["w2"], out_sharding=P("data", None))
  return jnp.mean((o + broadcast_like(params["b2"], o) - y) ** 2)


def make_data(windows: int, k: int, batch: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """A fixed random teacher network to regress on."""
  rng = np.random.default_rng(seed)
  teacher = init_params(seed + 1)
  x = rng.normal(size=(windows, k, batch, D_IN)).astype(np.float32)
  y = np.tanh(x @ teacher["w1"]) @ teacher["w2"]
  return x, y.astype(np.float32)


def large_batch_reference(
    host_params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, lr: float,
) -> dict[str, jax.Array]:
  """Single device: SGD with momentum on the gradient of each whole window."""
  params = jax.tree.map(jnp.asarray, host_params)
  opt = optax.sgd(lr, momentum=MOMENTUM)
  opt_state = opt.init(params)
  for w in range(x.shape[0]):
    grads = jax.grad(loss_fn)(params, x[w].reshape(-1, D_IN), y[w].reshape(-1, D_OUT))
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return params


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

  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2,
                       devices=jax.devices()[:8])
  host_params = init_params(0)
  x, y = make_data(args.windows, args.k, args.micro_batch, seed=1)
  tx = oa.accumulate(args.k, optax.sgd(args.lr, momentum=MOMENTUM), axis_name="data")

  @partial(jax.jit, donate_argnums=(0, 1))
  def step(p: Any, s: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any, jax.Array]:
    # Unreduced gradients: no gradient communication on this micro-step.
    value, grads = jax.value_and_grad(loss_fn)(defer_reduction(p, "data"), x, y)
    p, s = oa.update_and_apply(tx, grads, s, p)  # reduce-scatter only when emitting
    return p, s, value

  with jax.set_mesh(mesh):
    params = {name: jax.device_put(v, SPECS[name]) for name, v in host_params.items()}
    state = jax.jit(tx.init)(params)  # buffer: a copy per device; momentum like params
    losses = []
    for w in range(args.windows):
      window_loss = 0.0
      for i in range(args.k):
        xb, yb = (jax.device_put(a[w, i], P("data")) for a in (x, y))
        params, state, value = step(params, state, xb, yb)
        window_loss += float(value) / args.k
      losses.append(window_loss)
      if not args.quiet:
        print(f"step {w + 1}: loss {window_loss:.5f}")
    momentum = state.inner_opt_state[0].trace
    for name, p in params.items():  # the momentum stays laid out like the params
      assert momentum[name].sharding.is_equivalent_to(p.sharding, p.ndim), name
    layout = (f"w1: {jax.typeof(params['w1'])} | buffer: {jax.typeof(state.acc_grads['w1'])}"
              f" | momentum: {jax.typeof(momentum['w1'])}")
    final = jax.tree.map(np.asarray, params)

  ref = large_batch_reference(host_params, x, y, args.lr)
  diff = max(float(np.max(np.abs(final[n] - np.asarray(ref[n])))) for n in ref)
  first = (x[0].reshape(-1, D_IN), y[0].reshape(-1, D_OUT))
  result = {
      "initial_loss": float(loss_fn(host_params, *first)),
      "final_loss": float(loss_fn(final, *first)),
      "max_abs_diff_vs_large_batch": diff,
  }
  if not args.quiet:
    print(f"max |params - single-device large batch| = {diff:.2e}")
    print(layout)
  return result


if __name__ == "__main__":
  main()
