"""Gradient accumulation with a Flax Linen ``TrainState``.

Run: ``python examples/flax_linen.py`` (a few seconds on a CPU).

Use ``optax_accum.flax.TrainState`` (a drop-in subclass of Flax's) with
``tx=oa.accumulate(k, tx)`` and call ``apply_gradients`` once per
micro-batch. Its ``apply_gradients`` calls ``oa.update_and_apply``: on a
mid-step the params pass through untouched (jit with the state donated), and
after ``k`` calls the state equals the ``TrainState`` that took one step on
the concatenated batch (checked below). ``step`` counts micro-batches; the
optimizer steps are ``state.opt_state.gradient_step``. ``apply_gradients``
also takes ``weight=`` (with ``reduction="weighted"``) and ``emit_now=``.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import optax_accum as oa
from optax_accum.flax import TrainState

K = 4


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return nn.Dense(1)(nn.relu(nn.Dense(16)(x)))


def main() -> None:
  model = MLP()
  params = model.init(jax.random.key(0), jnp.zeros((1, 3)))["params"]

  def loss_fn(params, x, y):
    return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

  @functools.partial(jax.jit, donate_argnums=0)
  def train_step(state: TrainState, x: jax.Array, y: jax.Array) -> TrainState:
    grads = jax.grad(loss_fn)(state.params, x, y)
    return state.apply_gradients(grads=grads)

  tx = optax.sgd(0.05, momentum=0.9)
  state = TrainState.create(apply_fn=model.apply, params=params, tx=oa.accumulate(K, tx))
  # The reference, on its own copy of the params (train_step donates its input).
  big = train_state.TrainState.create(
      apply_fn=model.apply, params=jax.tree.map(jnp.copy, params), tx=tx)

  rng = np.random.default_rng(0)
  x = rng.normal(size=(3 * K, 8, 3)).astype(np.float32)
  y = x.sum(-1, keepdims=True) ** 2
  for w in range(3):
    for i in range(w * K, (w + 1) * K):
      state = train_step(state, jnp.asarray(x[i]), jnp.asarray(y[i]))
    big = train_step(big, jnp.asarray(x[w * K:(w + 1) * K].reshape(-1, 3)),
                     jnp.asarray(y[w * K:(w + 1) * K].reshape(-1, 1)))
    diff = max(float(jnp.max(jnp.abs(a - b)))
               for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(big.params),
                               strict=True))
    print(f"window {w + 1}: max |accumulated - large batch| = {diff:.2e}")
    assert diff < 1e-5
  assert int(state.opt_state.gradient_step) == 3 and int(state.step) == 3 * K
  print("OK")


if __name__ == "__main__":
  main()
