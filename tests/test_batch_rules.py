"""One set of batch rules: every entry point that takes a batch raises the same error.

`microbatched`, `cached_microbatched` and `local_value_and_grad` each read
their batch arguments through one `_batch.Batch`: fed the same bad input, each
raises the same error (a test per rule). Fed the same inputs, the two in-step
wrappers give the same answer (a loss that does not couple the examples, with
dropout). The reference cuts the micro-batches and folds the keys by hand: micro-batch `i`
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


# ------------------------------------------- one rule, three entry points, one error
# Every entry point that takes a batch builds one `_batch.Batch` per call. Each rule below
# feeds the same bad input to all three and expects one message.
ENTRIES = ("microbatched", "cached_microbatched", "local_value_and_grad")


def any_loss(p: dict, *args) -> jax.Array:
  """A mean loss of whatever arrays it is given (rows of the batch arguments, or others)."""
  h = sum(jnp.mean(x.reshape(x.shape[0], -1)) for x in jax.tree.leaves(args) if jnp.ndim(x))
  return jnp.mean(p["v"] ** 2) * h + jnp.sum(p["w"] ** 2)


def any_embed(p: dict, *args) -> jax.Array:
  rows = [x.reshape(x.shape[0], -1) for x in jax.tree.leaves(args) if jnp.ndim(x)]
  return jnp.concatenate(rows, axis=1) @ jnp.ones(sum(r.shape[1] for r in rows)) * p["v"][0]


def data_mesh():
  return jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Explicit,))


def call(entry: str, args: tuple, batch_argnums, k: int = 2, axis_name=None):
  """``entry`` with ``batch_argnums`` (and ``k`` micro-batches) called on ``args``, on a mesh of
  every device."""
  with jax.set_mesh(data_mesh()):
    return _call(entry, args, batch_argnums, k, {} if axis_name is None else {
        "axis_name": axis_name})


def _call(entry: str, args: tuple, batch_argnums, k: int, named: dict):
  if entry == "microbatched":
    return jax.jit(oa.microbatched(jax.value_and_grad(any_loss), k, batch_argnums=batch_argnums,
                                   **named))(*args)
  if entry == "cached_microbatched":
    return jax.jit(oa.cached_microbatched(any_embed, lambda p, e, *a: jnp.mean(e ** 2), k,
                                          batch_argnums=batch_argnums, **named))(*args)
  return oa.sharding.local_value_and_grad(any_loss, "data", batch_argnums=batch_argnums)(*args)


def errors_of(entries: tuple, args: tuple, batch_argnums, exc, pattern, **kw) -> set:
  """Each entry point's error on ``args``: one message, if they agree."""
  found = set()
  for entry in entries:
    with pytest.raises(exc, match=pattern) as info:
      call(entry, args, batch_argnums, **kw)
    found.add(str(info.value))
  return found


# rule: (args, batch_argnums, the error, what the message says)
RULES = {
    "the params as the batch": (
        lambda: (make_params(), make_batch(16)), (0, 1), ValueError,
        r"`batch_argnums=\(0, 1\)` names position 0, the params"),
    "an argument named twice": (
        lambda: (make_params(), make_batch(16)), (1, -1), ValueError,
        r"`batch_argnums=\(1, -1\)` names argument 1 twice"),
    "a position out of range": (
        lambda: (make_params(), make_batch(16)), 2, ValueError,
        r"`batch_argnums` contains 2, but the function was called with 2 positional"),
    "leaves of different sizes": (
        lambda: (make_params(), {"x": make_batch(16)["x"], "y": make_batch(12)["y"]}), 1,
        ValueError, r"disagree on the batch size: argument 1\['x'\] has 16 rows but"
        r" argument 1\['y'\] has 12"),
    "arguments of different sizes": (
        lambda: (make_params(), make_batch(16)["x"], make_batch(12)["y"]), (1, 2), ValueError,
        r"disagree on the batch size: argument 1 has 16 rows but argument 2 has 12"),
    "a scalar leaf": (
        lambda: (make_params(), {"x": make_batch(16)["x"], "y": np.float32(1)}), 1, ValueError,
        r"The batch leaf at argument 1\['y'\] is a scalar"),
    "no leaves": (
        lambda: (make_params(), {}), 1, ValueError, r"The batch argument 1 has no array leaves"),
}


@pytest.mark.parametrize("rule, entry", [(rule, entry) for rule in RULES for entry in ENTRIES])
def test_each_rule_one_error_from_every_entry_point(rule, entry):
  make_args, nums, exc, pattern = RULES[rule]
  found = errors_of((entry, "microbatched"), make_args(), nums, exc, pattern)
  assert len(found) == 1, found  # the message microbatched gives, word for word


K_RULE = (r"A batch of 16 examples cannot be split into 3 equal micro-batches"
          r" \(num_microbatches=3\)\.")


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e != "local_value_and_grad"])
def test_k_must_divide_the_batch(entry):
  """No k in local_value_and_grad: each device's rows are one micro-batch there."""
  args = (make_params(), make_batch(16))
  with pytest.raises(ValueError, match=K_RULE + r" Use a k that divides 16 \(one"
                     r" of \[1, 2, 4, 8, 16\]\), or pad the batch to a multiple of 3"):
    call(entry, args, 1, k=3)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (conftest)")
@pytest.mark.parametrize("entry", [e for e in ENTRIES if e != "local_value_and_grad"])
def test_k_must_divide_each_devices_rows(entry):
  """32 rows on 8 devices: 4 each, which k = 8 does not divide (32 does)."""
  with jax.set_mesh(data_mesh()):
    args = (jax.device_put(make_params(), P()), jax.device_put(make_batch(32), P("data")))
    assert len(errors_of((entry, "microbatched"), args, 1, ValueError,
                         r"32 examples cannot be split into 8 equal micro-batches on each of 8"
                         r" devices \(mesh axes \('data',\)\).*\[1, 2, 4\].* multiple of 64",
                         k=8)) == 1


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (conftest)")
@pytest.mark.parametrize("entry", ["cached_microbatched", "local_value_and_grad"])
def test_the_devices_must_divide_the_batch(entry):
  """A batch named split over the data axis (`axis_name`) whose rows the 8 devices do not
  divide (a batch placed on the mesh has rows the devices divide)."""
  args = (make_params(), make_batch(20))
  found = errors_of((entry, "microbatched"), args, 1, ValueError,
                    r"A batch of 20 examples cannot be split evenly over the 8 devices of mesh"
                    r" axes \('data',\)\. Pad the batch to a multiple of 8", k=1,
                    axis_name="data")
  assert len(found) == 1


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
