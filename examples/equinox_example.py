"""Gradient accumulation with Equinox, on the fast path (``update_and_apply``).

Run: ``python examples/equinox_example.py`` (needs ``pip install equinox``).

Split the model once with ``eqx.partition(model, eqx.is_array)``: the arrays
are the params the transform sees, the rest is static and closed over. Jit
the step with params and optimizer state donated and call
``oa.update_and_apply``: a mid-step then only adds the gradients to the
buffer, and the params pass through untouched. After ``K`` calls the params
equal one step of the plain optimizer on the concatenated batch (checked
below).
"""

from __future__ import annotations

import functools

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
  params, static = eqx.partition(model, eqx.is_array)
  tx = oa.accumulate(K, optax.sgd(0.05, momentum=0.9))
  opt_state = tx.init(params)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(eqx.combine(p, static), x, y))(params)
    params, opt_state = oa.update_and_apply(tx, grads, opt_state, params)
    return params, opt_state, loss

  ref_tx = optax.sgd(0.05, momentum=0.9)  # the reference: one step per window's whole batch
  ref_params = jax.tree.map(jnp.copy, params)  # a copy: `params` will be donated
  ref_state = ref_tx.init(ref_params)
  ref_grad = jax.jit(jax.grad(lambda p, x, y: loss_fn(eqx.combine(p, static), x, y)))

  rng = np.random.default_rng(0)
  x = rng.normal(size=(3 * K, 8, 3)).astype(np.float32)
  y = x.sum(-1, keepdims=True) ** 2
  for w in range(3):
    g = ref_grad(ref_params, jnp.asarray(x[w * K:(w + 1) * K].reshape(-1, 3)),
                 jnp.asarray(y[w * K:(w + 1) * K].reshape(-1, 1)))
    updates, ref_state = ref_tx.update(g, ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, updates)
    losses = []
    for i in range(w * K, (w + 1) * K):
      params, opt_state, loss = train_step(params, opt_state, jnp.asarray(x[i]), jnp.asarray(y[i]))
      losses.append(float(loss))
    diff = max(float(jnp.max(jnp.abs(a - b)))
               for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True))
    print(f"optimizer step {int(opt_state.gradient_step)}: window loss {np.mean(losses):.4f},"
          f" max |accumulated - large batch| = {diff:.2e}")
    assert bool(oa.has_updated(opt_state)) and diff < 1e-5
  model = eqx.combine(params, static)  # back to a callable model
  print(f"loss on all data: {float(loss_fn(model, x.reshape(-1, 3), y.reshape(-1, 1))):.4f}")
  print("OK")


if __name__ == "__main__":
  main()
