"""`microbatched` and `cached_microbatched` follow one set of batch rules.

Fed the same inputs, the two wrappers give the same answer (a loss that does
not couple the examples, with dropout) and raise the same error. The
reference cuts the micro-batches and folds the keys by hand: micro-batch `i`
holds rows `i, i + k, ...` of a device's rows, its key is
`fold_in(fold_in(key, device), i)` (no device fold on one device).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import optax_accum as oa

D, H = 8, 4


def make_params() -> dict:
  rng = np.random.default_rng(0)
  return {"w": jnp.asarray(rng.normal(size=(D, H)) / 3, jnp.float32),
          "v": jnp.asarray(rng.normal(size=H), jnp.float32)}


def make_batch(n: int) -> dict:
  rng = np.random.default_rng(1)
  return {"x": rng.normal(size=(n, D)).astype(np.float32),
          "y": rng.normal(size=n).astype(np.float32)}


def embed(p: dict, batch: dict, key: jax.Array) -> jax.Array:
  h = jnp.tanh(batch["x"] @ p["w"])
  h = jnp.where(jax.random.bernoulli(key, np.float32(0.75), h.shape), h / 0.75, 0.0)
  return h @ p["v"]  # one prediction per example


def loss_fn(p: dict, pred: jax.Array, batch: dict, key: jax.Array) -> jax.Array:
  return jnp.mean((pred - batch["y"]) ** 2)  # examples not coupled: both wrappers apply


def composed(p: dict, batch: dict, key: jax.Array) -> jax.Array:
  return loss_fn(p, embed(p, batch, key), batch, key)


def wrappers(k, **kwargs):
  opts = dict(rng_argnums=2, **kwargs)
  return {"microbatched": oa.microbatched(jax.value_and_grad(composed), k, **opts),
          "cached_microbatched": oa.cached_microbatched(embed, loss_fn, k, **opts)}


def by_hand(params: dict, batch: dict, key: jax.Array, k: int, devices: int) -> tuple:
  """The mean over every device's micro-batches, each cut and keyed by hand."""
  def loss(p):
    rows = len(batch["y"]) // devices
    total = 0.0
    for d in range(devices):
      dev_key = key if devices == 1 else jax.random.fold_in(key, d)
      for i in range(k):
        micro = {name: x[d * rows:(d + 1) * rows][i::k] for name, x in batch.items()}
        total += composed(p, micro, jax.random.fold_in(dev_key, i))
    return total / (k * devices)
  return jax.value_and_grad(loss)(params)


def assert_close(out, ref):
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


def test_same_answer_on_one_device():
  params, batch, key = make_params(), make_batch(16), jax.random.key(3)
  ref = by_hand(params, batch, key, 4, 1)
  for fn in wrappers(4).values():
    assert_close(jax.jit(fn)(params, batch, key), ref)
  # The keys matter: the same micro-batches under the key as given differ.
  unfolded = jax.value_and_grad(lambda p: jnp.mean(jnp.stack(
      [composed(p, {n: x[i::4] for n, x in batch.items()}, key) for i in range(4)])))(params)
  assert abs(float(unfolded[0]) - float(ref[0])) > 1e-3


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (conftest)")
def test_same_answer_and_layout_on_a_mesh():
  """Per-device keys, each device's strided rows, gradients back in the params' sharding."""
  params, batch, key = make_params(), make_batch(64), jax.random.key(3)
  ref = by_hand(params, batch, key, 2, 8)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    fsdp = {"w": jax.device_put(params["w"], P("data")), "v": jax.device_put(params["v"], P())}
    sharded = jax.device_put(batch, P("data"))
    for fn in wrappers(2).values():
      value, grads = jax.jit(fn)(fsdp, sharded, key)
      assert jax.typeof(grads["w"]).sharding.spec == P("data", None)
      assert_close((value, grads), ref)


# name: (num_microbatches, options, rows, the error, what its message says)
BAD_CALLS = {
    "a float k": (4.0, {}, 16, TypeError, r"`num_microbatches` must be a positive int.* 4\.0"),
    "a schedule k": (lambda step: 4, {}, 16, TypeError, "schedules are not supported"),
    "k = 0": (0, {}, 16, ValueError, "`num_microbatches` must be >= 1"),
    "k < 0": (-2, {}, 16, ValueError, "`num_microbatches` must be >= 1"),
    "a bool k": (True, {}, 16, TypeError, "`num_microbatches` must be a positive int"),
    "an indivisible batch": (4, {}, 30, ValueError,
                             r"30 examples .*num_microbatches=4.*\[1, 2, 3, 5, 6, 10, 15, 30\]"),
    "the params as the batch": (4, {"batch_argnums": (0, 1)}, 16, ValueError,
                                "position 0, the params"),
    "a key that is the batch": (4, {"batch_argnums": 1, "rng_argnums": 1}, 16, ValueError,
                                "must not overlap"),
}


@pytest.mark.parametrize("name", BAD_CALLS)
def test_same_error(name):
  k, kwargs, rows, exc, pattern = BAD_CALLS[name]
  params, batch, key = make_params(), make_batch(rows), jax.random.key(0)
  errors = {}
  for wrapper in ("microbatched", "cached_microbatched"):
    opts = {"rng_argnums": 2, **kwargs}
    with pytest.raises(exc, match=pattern) as info:
      if wrapper == "microbatched":
        fn = oa.microbatched(jax.value_and_grad(composed), k, **opts)
      else:
        fn = oa.cached_microbatched(embed, loss_fn, k, **opts)
      fn(params, batch, key)
    errors[wrapper] = (info.type, str(info.value))
  assert errors["microbatched"] == errors["cached_microbatched"]


def test_disagreeing_batch_leaves_and_sizes_per_device_raise_alike():
  params, key = make_params(), jax.random.key(0)
  ragged = {"x": make_batch(16)["x"], "y": make_batch(12)["y"]}
  messages = set()
  for fn in wrappers(4).values():
    with pytest.raises(ValueError, match="disagree on the batch size") as info:
      fn(params, ragged, key)
    messages.add(str(info.value))
  assert len(messages) == 1
  if len(jax.devices()) < 8:
    return
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  messages = set()
  with jax.set_mesh(mesh):
    sharded = jax.device_put(make_batch(32), P("data"))
    for fn in wrappers(8).values():
      with pytest.raises(ValueError, match=r"32 examples .* on each of 8 devices .*\[1, 2, 4\]"
                         r".* multiple of 64") as info:
        jax.jit(fn)(params, sharded, key)
      messages.add(str(info.value))
  assert len(messages) == 1


def test_a_pooled_embedding_is_refused_whatever_its_width():
  """A mean over the batch of width 8 at 8 rows per micro-batch has the rows' leading dim."""
  params, batch, key = make_params(), make_batch(32), jax.random.key(0)

  def pooled(p, b, key):  # [8] at 8 rows: per example by its shape, pooled by its values
    h = jnp.tanh(b["x"] @ p["w"])
    return jnp.mean(h @ p["w"].T, axis=0)

  grad_fn = oa.cached_microbatched(pooled, lambda p, e, b, key: jnp.sum(e), 4, rng_argnums=2)
  with pytest.raises(ValueError, match=r"`embed_fn` returned shape \(8,\) at output for a"
                                       r" micro-batch of 16 examples: every output leaf"):
    grad_fn(params, batch, key)
  # The per-example embedding of the same width passes.
  per_example = oa.cached_microbatched(
      lambda p, b, key: jnp.tanh(b["x"] @ p["w"]) @ p["w"].T,
      lambda p, e, b, key: jnp.mean(e), 4, rng_argnums=2)
  assert jnp.isfinite(per_example(params, batch, key)[0])
