"""Gradient accumulation with a Flax NNX optimizer.

Run: ``python examples/flax_nnx.py`` (a few seconds on a CPU).

``optax_accum.flax.Optimizer`` is a drop-in subclass of ``nnx.Optimizer``
whose ``update`` calls ``oa.update_and_apply``: with ``oa.accumulate(k, tx)``
the parameters move once per ``k`` calls (on the other calls they pass
through untouched), and the inner optimizer (its step count, Adam moments,
learning-rate schedule) steps once per window. ``optimizer.step`` counts
``update`` calls, i.e. micro-batches; the optimizer steps are
``optimizer.opt_state.gradient_step``. ``update`` forwards ``weight=`` and
``emit_now=`` and returns ``None`` (the updates tree is never built).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import optax_accum as oa
from optax_accum.flax import Optimizer

K = 4  # micro-batches per optimizer step


class MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs) -> None:
    self.l1 = nnx.Linear(3, 16, rngs=rngs)
    self.l2 = nnx.Linear(16, 1, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.l2(nnx.relu(self.l1(x)))


def loss_fn(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean((model(x) - y) ** 2)


@nnx.jit
def train_step(model: MLP, optimizer: Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
  loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
  optimizer.update(model, grads)  # a no-op on the params except every K-th call
  return loss


def main() -> None:
  schedule = optax.cosine_decay_schedule(1e-2, decay_steps=10)  # counts optimizer steps
  model = MLP(nnx.Rngs(0))
  optimizer = Optimizer(model, oa.accumulate(K, optax.adam(schedule)), wrt=nnx.Param)

  rng = np.random.default_rng(0)
  x = rng.normal(size=(8 * K, 8, 3)).astype(np.float32)  # 8 windows of K micro-batches of 8
  y = x.sum(-1, keepdims=True) ** 2
  window_losses = []
  for i in range(len(x)):
    window_losses.append(train_step(model, optimizer, jnp.asarray(x[i]), jnp.asarray(y[i])))
    state = nnx.as_pure(optimizer.opt_state)  # plain arrays, for has_updated and logging
    if oa.has_updated(state):  # log once per optimizer step
      print(f"optimizer step {int(state.gradient_step)}:"
            f" loss {float(jnp.mean(jnp.stack(window_losses))):.4f}")
      window_losses = []

  assert int(optimizer.opt_state.gradient_step[...]) == len(x) // K
  assert int(optimizer.step[...]) == len(x)  # nnx counts update() calls
  print("OK")


if __name__ == "__main__":
  main()
