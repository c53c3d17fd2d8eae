"""Gradient accumulation with Equinox (``eqx.filter``-ed parameters).

Run: ``python examples/equinox_example.py`` (needs ``pip install equinox``).

Initialise the transform on the array leaves of the model, pass the
``eqx.filter_grad`` gradients, and apply the updates with
``eqx.apply_updates``. Non-array leaves (activation functions, static fields)
are ``None`` in both trees and are left alone.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum as oa

K = 4


def loss_fn(model: eqx.nn.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def main() -> None:
  model = eqx.nn.MLP(3, 1, width_size=16, depth=1, key=jax.random.key(0))
  tx = oa.accumulate(K, optax.adam(1e-2))
  opt_state = tx.init(eqx.filter(model, eqx.is_array))

  @eqx.filter_jit
  def train_step(model, opt_state, x, y):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss

  rng = np.random.default_rng(0)
  x = rng.normal(size=(5 * K, 8, 3)).astype(np.float32)
  y = x.sum(-1, keepdims=True) ** 2
  first = float(loss_fn(model, jnp.asarray(x.reshape(-1, 3)), jnp.asarray(y.reshape(-1, 1))))
  for i in range(len(x)):
    model, opt_state, loss = train_step(model, opt_state, jnp.asarray(x[i]), jnp.asarray(y[i]))
    if oa.has_updated(opt_state):
      print(f"optimizer step {int(opt_state.gradient_step)}: micro-batch loss {float(loss):.4f}")
  last = float(loss_fn(model, jnp.asarray(x.reshape(-1, 3)), jnp.asarray(y.reshape(-1, 1))))
  assert int(opt_state.gradient_step) == 5 and last < first
  print("OK")


if __name__ == "__main__":
  main()
