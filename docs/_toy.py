import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax_accum as oa

# A linear model, its mean squared error, and one batch of 32 examples
# cut into 4 micro-batches of 8.
def loss_fn(params, x, y):
  pred = x @ params["w"] + params["b"]
  return jnp.mean((pred - y) ** 2)

params = {"w": jnp.zeros((8, 1)), "b": jnp.zeros((1,))}
x = jax.random.normal(jax.random.key(0), (32, 8))
y = x @ jnp.arange(8.0).reshape(8, 1) + 1.0
micro_batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)]
