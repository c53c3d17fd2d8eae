"""Data-parallel and sharded accumulation on 8 host CPU devices.

``tests/conftest.py`` forces 8 CPU devices before jax is imported. Every run
is compared with an independent single-device reference: the inner optimizer
applied to the gradient of the whole window's data as one large batch.
SGD with momentum is used where the scale matters (Adam would hide a gradient
scaled by the number of devices).
"""

from __future__ import annotations

import importlib.util
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum as oa
from optax_accum.debug import hlo_collectives
from optax_accum.sharding import (
    per_device_state,
    shard_map_specs,
    state_shardings,
)

N_DEV = 8
# The 0.2.0 options (`split`, `rng_mode`, `accumulator_dtype`, `unroll`) keep working
# for one release; their warning is tested in test_microbatching.py.
_deprecated_options = pytest.mark.filterwarnings(
    "ignore:`microbatched`'s .* is deprecated:DeprecationWarning")
pytestmark = pytest.mark.skipif(
    jax.device_count() < N_DEV,
    reason="needs 8 devices: run through pytest so tests/conftest.py sets XLA_FLAGS",
)

D_IN, D_HID, D_OUT = 8, 8, 4


def make_params(seed: int = 0) -> dict[str, jax.Array]:
  rng = np.random.default_rng(seed)
  return {
      "w1": jnp.asarray(rng.normal(size=(D_IN, D_HID)) / np.sqrt(D_IN), jnp.float32),
      "b1": jnp.zeros((D_HID,), jnp.float32),
      "w2": jnp.asarray(rng.normal(size=(D_HID, D_OUT)) / np.sqrt(D_HID), jnp.float32),
      "b2": jnp.zeros((D_OUT,), jnp.float32),
  }


def make_data(windows: int, k: int, batch: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """``(windows, k, batch, ...)`` inputs and targets."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(windows, k, batch, D_IN)).astype(np.float32)
  y = rng.normal(size=(windows, k, batch, D_OUT)).astype(np.float32)
  return x, y


def per_example_loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return jnp.sum((h @ params["w2"] + params["b2"] - y) ** 2, axis=-1)


def loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean(per_example_loss(params, x, y))


def large_batch_reference(
    params: Any, opt: optax.GradientTransformation, x: np.ndarray, y: np.ndarray
) -> Any:
  """The inner optimizer on the gradient of each whole window, on one device."""
  state = opt.init(params)
  for w in range(x.shape[0]):
    xs = x[w].reshape(-1, x.shape[-1])
    ys = y[w].reshape(-1, y.shape[-1])
    grads = jax.grad(loss)(params, xs, ys)
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params


def assert_trees_close(actual: Any, expected: Any, rtol: float = 2e-5, atol: float = 2e-6) -> None:
  jax.tree.map(
      lambda a, e: np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol),
      actual, expected)


def inner_opt() -> optax.GradientTransformation:
  return optax.sgd(0.3, momentum=0.9)


def data_mesh() -> Mesh:
  return Mesh(np.array(jax.devices()[:N_DEV]), ("data",))


# --- pmap ---------------------------------------------------------------------------------


def test_pmap_matches_large_batch() -> None:
  k, windows, per_dev = 4, 2, 2
  x, y = make_data(windows, k, N_DEV * per_dev)
  params = make_params()
  tx = oa.accumulate(k, inner_opt(), axis_name="batch")

  @partial(jax.pmap, axis_name="batch")
  def step(p: Any, s: Any, xb: jax.Array, yb: jax.Array) -> tuple[Any, Any]:
    grads = jax.grad(loss)(p, xb, yb)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  stack = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(a, (N_DEV, *a.shape)), t)
  p, s = stack(params), stack(tx.init(params))
  for w in range(windows):
    for i in range(k):
      xb = x[w, i].reshape(N_DEV, per_dev, D_IN)
      yb = y[w, i].reshape(N_DEV, per_dev, D_OUT)
      p, s = step(p, s, xb, yb)
      assert bool(s.emitted[0]) == (i == k - 1)
  expected = large_batch_reference(params, inner_opt(), x, y)
  for d in (0, N_DEV - 1):
    assert_trees_close(jax.tree.map(lambda a, d=d: a[d], p), expected)
  assert int(s.gradient_step[0]) == windows


# --- shard_map ----------------------------------------------------------------------------


def shard_map_step(tx: Any, mesh: Mesh, params: Any, *, weighted: bool = False) -> Any:
  specs = shard_map_specs(tx, params, "data")

  def body(p: Any, s: Any, xb: jax.Array, yb: jax.Array, mb: jax.Array) -> tuple[Any, Any]:
    local = lax.pcast(p, "data", to="varying")
    if weighted:
      count = jnp.sum(mb)

      def masked_loss(q: Any) -> jax.Array:
        return jnp.sum(per_example_loss(q, xb, yb) * mb) / jnp.maximum(count, 1.0)

      grads = jax.grad(masked_loss)(local)
      updates, s = tx.update(grads, s, p, weight=count)
    else:
      grads = jax.grad(loss)(local, xb, yb)
      updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  return jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(P(), specs, P("data"), P("data"), P("data")),
      out_specs=(P(), specs)))


def shard_map_init(tx: Any, mesh: Mesh, params: Any) -> Any:
  specs = shard_map_specs(tx, params, "data")
  return jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)


def test_shard_map_matches_large_batch_and_accumulates_locally() -> None:
  k, windows, per_dev = 3, 2, 2
  x, y = make_data(windows, k, N_DEV * per_dev, seed=2)
  params = make_params()
  mesh = data_mesh()
  tx = per_device_state(oa.accumulate(k, inner_opt(), axis_name="data"), "data")
  step = shard_map_step(tx, mesh, params)
  state = shard_map_init(tx, mesh, params)
  assert state.acc_grads["w1"].shape == (N_DEV, D_IN, D_HID)
  ones = np.ones((N_DEV * per_dev,), np.float32)
  p = params
  for w in range(windows):
    for i in range(k):
      p_before = p
      p, state = step(p, state, x[w, i], y[w, i], ones)
      if i == 0:
        # First micro-step of a window: each device holds exactly its own local
        # gradient (nothing reduced, nothing left over from the last window).
        for d in range(N_DEV):
          sl = slice(d * per_dev, (d + 1) * per_dev)
          local = jax.grad(loss)(p_before, x[w, 0, sl], y[w, 0, sl])
          assert_trees_close(jax.tree.map(lambda a, d=d: a[d], state.acc_grads), local)
        assert not np.allclose(state.acc_grads["w1"][0], state.acc_grads["w1"][1])
      if i < k - 1:
        assert_trees_close(p, p_before, rtol=0, atol=0)
  expected = large_batch_reference(params, inner_opt(), x, y)
  assert_trees_close(p, expected)
  assert int(state.gradient_step) == windows


def test_update_and_apply_through_per_device_state_under_shard_map() -> None:
  """The fast path through the wrapper: params untouched mid-window, one
  all-reduce in the emitting branch, and the large-batch result."""
  k, windows, per_dev = 2, 2, 2
  x, y = make_data(windows, k, N_DEV * per_dev, seed=5)
  params, mesh = make_params(), data_mesh()
  tx = per_device_state(oa.accumulate(k, inner_opt(), axis_name="data"), "data")
  specs = shard_map_specs(tx, params, "data")

  def body(p: Any, s: Any, xb: jax.Array, yb: jax.Array) -> tuple[Any, Any]:
    grads = jax.grad(loss)(lax.pcast(p, "data", to="varying"), xb, yb)
    return oa.update_and_apply(tx, grads, s, p)

  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                               out_specs=(P(), specs)))
  state, p = shard_map_init(tx, mesh, params), params
  for w in range(windows):
    for i in range(k):
      p_before = p
      p, state = step(p, state, x[w, i], y[w, i])
      if i < k - 1:
        assert_trees_close(p, p_before, rtol=0, atol=0)
  assert_trees_close(p, large_batch_reference(params, inner_opt(), x, y))
  compiled = step.lower(params, state, x[0, 0], y[0, 0]).compile()
  assert {c.context for c in _all_reduces(compiled)} == {(("conditional", 1),)}


def test_shard_map_weighted_with_skipped_nonfinite_micro_batch() -> None:
  """Token-weighted mean across devices; a NaN on one device skips the step on all."""
  k, per_dev = 3, 4
  x, y = make_data(1, k + 1, N_DEV * per_dev, seed=3)
  rng = np.random.default_rng(4)
  mask = (rng.random(size=x.shape[:3]) < 0.6).astype(np.float32)
  mask[0, 0, :per_dev] = 0.0  # device 0 has only padding in its first micro-batch
  bad = 2  # micro-step with a NaN input on device 5 only: skipped everywhere
  x_bad = x.copy()
  x_bad[0, bad, 5 * per_dev] = np.nan
  params = make_params()
  mesh = data_mesh()
  tx = per_device_state(
      oa.accumulate(k, inner_opt(), reduction="weighted", skip_nonfinite=True, axis_name="data"),
      "data")
  step = shard_map_step(tx, mesh, params, weighted=True)
  state = shard_map_init(tx, mesh, params)
  p = params
  for i in range(k + 1):
    p, state = step(p, state, x_bad[0, i], y[0, i], mask[0, i])
  assert int(state.num_skipped) == 1
  assert int(state.gradient_step) == 1

  # Reference: one step on sum(token losses) / total tokens of the accepted micro-batches.
  keep = [i for i in range(k + 1) if i != bad]
  xs = x[0, keep].reshape(-1, D_IN)
  ys = y[0, keep].reshape(-1, D_OUT)
  ms = mask[0, keep].reshape(-1)
  grads = jax.grad(lambda q: jnp.sum(per_example_loss(q, xs, ys) * ms) / ms.sum())(params)
  opt = inner_opt()
  updates, _ = opt.update(grads, opt.init(params), params)
  assert_trees_close(p, optax.apply_updates(params, updates))


def test_per_device_state_rejects_already_reduced_gradients() -> None:
  mesh = data_mesh()
  params = make_params()
  tx = per_device_state(oa.accumulate(2, inner_opt(), axis_name="data"), "data")
  specs = shard_map_specs(tx, params, "data")
  state = shard_map_init(tx, mesh, params)

  def body(p: Any, s: Any, xb: jax.Array, yb: jax.Array) -> tuple[Any, Any]:
    grads = jax.grad(loss)(p, xb, yb)  # w.r.t. replicated params: summed over devices
    return tx.update(grads, s, p)

  step = jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")), out_specs=(P(), specs)))
  x, y = make_data(1, 1, 16)
  with pytest.raises(ValueError, match=r"pcast\(params, 'data', to='varying'\)"):
    step(params, state, x[0, 0], y[0, 0])


def test_per_device_state_needs_an_accumulate_transform() -> None:
  with pytest.raises(TypeError, match="accumulate"):
    per_device_state(optax.sgd(0.1), "data").init(make_params())


# A model that is separable over features, so params sharded over "model" need
# no communication except for the shared scale `s` (whose gradient JAX sums
# over "model", since `s` is replicated there).
SEP_SPECS = {"w": P("model"), "b": P("model"), "s": P()}


def separable_loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
  pred = x * params["w"] * params["s"] + params["b"]
  return jnp.mean(jnp.sum((pred - y) ** 2, axis=-1))


def separable_optimizer(name: str) -> optax.GradientTransformation:
  if name == "masked":
    return optax.masked(optax.adam(1e-2), {"w": True, "b": False, "s": True})
  return optax.multi_transform(
      {"adam": optax.adam(1e-2), "momentum": optax.sgd(0.1, momentum=0.9)},
      {"w": "adam", "b": "momentum", "s": "adam"})


@pytest.mark.parametrize("name", ["masked", "multi_transform"])
def test_shard_map_specs_follow_each_param_through_masks_and_partitions(name: str) -> None:
  k, windows, batch, features = 2, 2, 16, 8
  mesh = fsdp_mesh()
  rng = np.random.default_rng(13)
  params = {"w": jnp.asarray(rng.normal(size=features), jnp.float32),
            "b": jnp.zeros((features,), jnp.float32), "s": jnp.float32(0.7)}
  x = rng.normal(size=(windows, k, batch, features)).astype(np.float32)
  y = rng.normal(size=(windows, k, batch, features)).astype(np.float32)
  tx = per_device_state(
      oa.accumulate(k, separable_optimizer(name), axis_name="data"), "data")
  specs = shard_map_specs(tx, params, "data", SEP_SPECS)

  # Leaf by leaf: the buffer is per device on "data" then its param's spec; the
  # moments kept have their param's spec; everything else is replicated.
  flat_specs = jax.tree_util.tree_flatten_with_path(specs)[0]
  flat_state = jax.tree_util.tree_flatten_with_path(jax.eval_shape(tx.init, params))[0]
  assert [p for p, _ in flat_specs] == [p for p, _ in flat_state]
  owned = 0
  for path, spec in flat_specs:
    owner = param_of(path, SEP_SPECS)
    owned += owner is not None
    if owner is not None and path[-2].name == "acc_grads":
      assert spec == P("data", *SEP_SPECS[owner]), jax.tree_util.keystr(path)
    elif path[-1] == jax.tree_util.GetAttrKey("acc_weight"):
      assert spec == P("data"), jax.tree_util.keystr(path)
    else:
      assert spec == (SEP_SPECS[owner] if owner else P()), jax.tree_util.keystr(path)
  assert owned == {"masked": 3 + 2 * 2, "multi_transform": 3 + 2 * 2 + 1}[name]

  # init type-checks the specs: a moment local to a "model" shard with a
  # replicated out-spec is rejected.
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(SEP_SPECS,), out_specs=specs))
  state = init(params)
  assert state.acc_grads["w"].shape == (4, features)  # one buffer per "data" device

  # With vma checking on: the gradient of the "model"-replicated scale is
  # summed over "model" by JAX, and each "data" device keeps its own buffer.
  def body(p: Any, st: Any, xb: jax.Array, yb: jax.Array) -> tuple[Any, Any]:
    grads = jax.grad(separable_loss)(lax.pcast(p, "data", to="varying"), xb, yb)
    updates, st = tx.update(grads, st, p)
    return optax.apply_updates(p, updates), st

  data_spec = P("data", "model")
  step = jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(SEP_SPECS, specs, data_spec, data_spec),
      out_specs=(SEP_SPECS, specs)))

  # The single-device run: the same optimizer, accumulating whole micro-batches.
  ref_tx = oa.accumulate(k, separable_optimizer(name))
  ref_state = ref_tx.init(params)
  p, ref_p = params, params
  for w in range(windows):
    for i in range(k):
      p, state = step(p, state, x[w, i], y[w, i])
      grads = jax.grad(separable_loss)(ref_p, x[w, i], y[w, i])
      updates, ref_state = ref_tx.update(grads, ref_state, ref_p)
      ref_p = optax.apply_updates(ref_p, updates)
  assert_trees_close(p, ref_p)
  assert_trees_equal_numbers(state.inner_opt_state, ref_state.inner_opt_state)
  assert not np.allclose(p["w"], params["w"])


def test_shard_map_step_type_checks_with_params_sharded_over_a_second_axis() -> None:
  """Both cond branches vary over "model" (the mid branch's zeros included)."""
  mesh = fsdp_mesh()
  params = {"w": jnp.ones((8,), jnp.float32), "b": jnp.zeros((8,), jnp.float32),
            "s": jnp.float32(1.0)}
  tx = per_device_state(oa.accumulate(2, optax.sgd(0.1), axis_name="data"), "data")
  specs = shard_map_specs(tx, params, "data", SEP_SPECS)

  def body(p: Any, st: Any, xb: jax.Array, yb: jax.Array) -> tuple[Any, Any]:
    grads = jax.grad(separable_loss)(lax.pcast(p, "data", to="varying"), xb, yb)
    updates, st = tx.update(grads, st, p)
    return optax.apply_updates(p, updates), st

  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(SEP_SPECS,), out_specs=specs))(
      params)
  data_spec = P("data", "model")
  step = jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(SEP_SPECS, specs, data_spec, data_spec),
      out_specs=(SEP_SPECS, specs)))
  key = jax.random.key(3)
  xs = jax.random.normal(key, (2, 16, 8))
  ys = jax.random.normal(jax.random.fold_in(key, 1), (2, 16, 8))
  p = params
  for i in range(2):
    p, state = step(p, state, xs[i], ys[i])
  # One SGD step on the gradient of the whole window, on one device.
  ref = jax.grad(lambda q: (separable_loss(q, xs[0], ys[0]) + separable_loss(q, xs[1], ys[1]))
                 / 2)(params)
  assert_trees_close(p, jax.tree.map(lambda q, g: q - 0.1 * g, params, ref))


# --- the communication claim, read from the compiled HLO -----------------------------------


def _all_reduces(compiled: Any) -> list[Any]:
  return [c for c in hlo_collectives(compiled) if c.op in ("all-reduce", "all-reduce-start")]


def _param_bytes(params: Any) -> int:
  return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))


def test_hlo_all_reduce_only_in_emitting_branch() -> None:
  k = 8
  mesh = data_mesh()
  params = make_params()
  x, y = make_data(1, 1, 16)
  ones = np.ones((16,), np.float32)

  # Ours: shard_map with per-device buffers.
  tx = per_device_state(oa.accumulate(k, inner_opt(), axis_name="data"), "data")
  state = shard_map_init(tx, mesh, params)
  compiled = shard_map_step(tx, mesh, params).lower(
      params, state, x[0, 0], y[0, 0], ones).compile()
  ours = _all_reduces(compiled)
  assert ours, "expected the window's gradient all-reduce in the compiled step"
  assert all(c.context == (("conditional", 1),) for c in ours), ours
  assert sum(c.bytes for c in ours) >= _param_bytes(params)

  # Ours under pmap.
  ptx = oa.accumulate(k, inner_opt(), axis_name="batch")

  def pstep(p: Any, s: Any, xb: jax.Array, yb: jax.Array) -> tuple[Any, Any]:
    updates, s = ptx.update(jax.grad(loss)(p, xb, yb), s, p)
    return optax.apply_updates(p, updates), s

  stack = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(a, (N_DEV, *a.shape)), t)
  pcompiled = jax.pmap(pstep, axis_name="batch").lower(
      stack(params), stack(ptx.init(params)), x[0, 0].reshape(N_DEV, 2, D_IN),
      y[0, 0].reshape(N_DEV, 2, D_OUT)).compile()
  pours = _all_reduces(pcompiled)
  assert pours and all(c.context == (("conditional", 1),) for c in pours), pours

  # Naive: pmean of the gradients on every micro-step, then accumulate.
  naive_tx = oa.accumulate(k, inner_opt())

  def naive_body(p: Any, s: Any, xb: jax.Array, yb: jax.Array) -> tuple[Any, Any]:
    grads = lax.pmean(jax.grad(loss)(lax.pcast(p, "data", to="varying"), xb, yb), "data")
    updates, s = naive_tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  naive = jax.jit(jax.shard_map(
      naive_body, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P())))
  naive_compiled = naive.lower(params, naive_tx.init(params), x[0, 0], y[0, 0]).compile()
  naive_ar = _all_reduces(naive_compiled)
  in_step_path = [c for c in naive_ar if c.context == ()]
  assert sum(c.bytes for c in in_step_path) >= _param_bytes(params), naive_ar


# --- jit with NamedSharding (FSDP / tensor parallel on a 2-D mesh) --------------------------


def fsdp_mesh() -> Mesh:
  return Mesh(np.array(jax.devices()[:N_DEV]).reshape(4, 2), ("data", "model"))


FSDP_SPECS = {"w1": P("data", "model"), "b1": P("model"), "w2": P("model", "data"), "b2": P()}


def test_state_shardings_leaf_by_leaf_for_nested_states() -> None:
  mesh = fsdp_mesh()
  params = jax.tree.map(
      lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), make_params(), FSDP_SPECS)
  opt = optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2),
  )
  tx = oa.accumulate(4, opt, accumulator_dtype=jnp.bfloat16)
  shardings = state_shardings(tx, params)
  state = jax.jit(tx.init, out_shardings=shardings)(params)
  replicated = NamedSharding(mesh, P())
  adam_state = state.inner_opt_state[1].inner_state[0]
  for tree, tree_shardings in (
      (state.acc_grads, shardings.acc_grads),
      (adam_state.mu, shardings.inner_opt_state[1].inner_state[0].mu),
      (adam_state.nu, shardings.inner_opt_state[1].inner_state[0].nu),
  ):
    for name in params:
      expected = NamedSharding(mesh, FSDP_SPECS[name])
      assert tree_shardings[name] == params[name].sharding
      assert tree[name].sharding.is_equivalent_to(expected, tree[name].ndim), name
  assert state.acc_grads["w1"].dtype == jnp.bfloat16
  assert state.acc_weight == ()  # kept only by reduction="weighted"
  for leaf in (state.mini_step, state.gradient_step, adam_state.count,
               state.inner_opt_state[1].hyperparams["learning_rate"]):
    assert leaf.sharding.is_equivalent_to(replicated, leaf.ndim)
  # Eager init on sharded params keeps the layout too.
  eager = tx.init(params)
  for name in params:
    assert eager.acc_grads[name].sharding.is_equivalent_to(
        params[name].sharding, params[name].ndim), name
  # Abstract params (ShapeDtypeStruct with a sharding) work without any array.
  abstract = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), params)
  assert jax.tree.structure(state_shardings(tx, abstract)) == jax.tree.structure(shardings)


def test_state_shardings_errors() -> None:
  tx = oa.accumulate(2, optax.sgd(0.1))
  with pytest.raises(TypeError, match="sharding"):
    state_shardings(tx, {"w": np.zeros(3)})
  params = {"w": jnp.zeros(3)}
  with pytest.raises(ValueError, match="structure of `params`"):
    state_shardings(tx, params, [params["w"].sharding])


# Optimizers that nest, mask or partition their params-shaped state. The spec
# each state leaf should have comes from its key path, a rule independent of
# `state_shardings`' own search: a leaf keyed by a param name under a moment
# field (`acc_grads`, `mu`, `nu`, `trace`) has that param's spec; every other
# leaf (counters, `hyperparams['b1']`, ...) is replicated.
MASK = {"w1": True, "b1": False, "w2": True, "b2": False}
LABELS = {"w1": "adam", "b1": "momentum", "w2": "adam", "b2": "frozen"}
MOMENT_FIELDS = ("acc_grads", "mu", "nu", "trace")


def nested_optimizer(name: str) -> optax.GradientTransformation:
  if name == "masked":
    return optax.masked(optax.adam(1e-2), MASK)
  if name == "masked_fn":
    return optax.masked(optax.adam(1e-2), lambda p: jax.tree.map(lambda a: a.ndim > 1, p))
  if name == "multi_transform":
    return optax.multi_transform(
        {"adam": optax.adam(1e-2), "momentum": optax.sgd(0.1, momentum=0.9),
         "frozen": optax.set_to_zero()}, LABELS)
  assert name == "chain_inject"
  return optax.chain(
      optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2))


# Number of params-shaped leaves: the buffer's 4, plus the moments kept.
NESTED_MOMENT_LEAVES = {"masked": 8, "masked_fn": 8, "multi_transform": 9, "chain_inject": 12}


def param_of(path: Any, names: Any) -> str | None:
  """The param a state leaf belongs to, by its key path (None: not params-shaped)."""
  fields = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]
  last = path[-1] if path else None
  if (fields and fields[-1] in MOMENT_FIELDS and isinstance(last, jax.tree_util.DictKey)
      and last.key in names):
    return last.key
  return None


def assert_trees_equal_numbers(actual: Any, expected: Any) -> None:
  """Leaf-by-leaf closeness of two states (integer and bool leaves too)."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64),
                               rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", sorted(NESTED_MOMENT_LEAVES))
def test_state_shardings_follow_each_param_through_masks_and_partitions(name: str) -> None:
  k, windows, batch = 2, 2, 16
  mesh = fsdp_mesh()
  host_params = make_params(seed=11)
  params = jax.tree.map(
      lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), host_params, FSDP_SPECS)
  tx = oa.accumulate(k, nested_optimizer(name))
  shardings = state_shardings(tx, params)

  # Leaf by leaf, before anything runs: the sharding tree lines up with the state.
  flat_shardings = jax.tree_util.tree_flatten_with_path(shardings)[0]
  flat_state = jax.tree_util.tree_flatten_with_path(jax.eval_shape(tx.init, host_params))[0]
  assert [p for p, _ in flat_shardings] == [p for p, _ in flat_state]
  owned = 0
  for (path, sharding), (_, leaf) in zip(flat_shardings, flat_state, strict=True):
    owner = param_of(path, FSDP_SPECS)
    owned += owner is not None
    expected = NamedSharding(mesh, FSDP_SPECS[owner] if owner else P())
    assert sharding.is_equivalent_to(expected, leaf.ndim), jax.tree_util.keystr(path)
  assert owned == NESTED_MOMENT_LEAVES[name]

  # jit(init) lays the state out so.
  state = jax.jit(tx.init, out_shardings=shardings)(params)
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    owner = param_of(path, FSDP_SPECS)
    expected = NamedSharding(mesh, FSDP_SPECS[owner] if owner else P())
    assert leaf.sharding.is_equivalent_to(expected, leaf.ndim), jax.tree_util.keystr(path)

  # Training under jit with these shardings equals the single-device run.
  def step(p: Any, s: Any, xb: jax.Array, yb: jax.Array) -> tuple[Any, Any]:
    updates, s = tx.update(jax.grad(loss)(p, xb, yb), s, p)
    return optax.apply_updates(p, updates), s

  param_shardings = jax.tree.map(lambda a: a.sharding, params)
  batch_sharding = NamedSharding(mesh, P("data"))
  sharded_step = jax.jit(
      step, in_shardings=(param_shardings, shardings, batch_sharding, batch_sharding),
      out_shardings=(param_shardings, shardings))
  single_step = jax.jit(step)
  x, y = make_data(windows, k, batch, seed=12)
  p, ref_p, ref_state = params, host_params, tx.init(host_params)
  for w in range(windows):
    for i in range(k):
      p, state = sharded_step(p, state, x[w, i], y[w, i])
      ref_p, ref_state = single_step(ref_p, ref_state, x[w, i], y[w, i])
  assert_trees_close(p, ref_p)
  assert_trees_equal_numbers(state, ref_state)
  assert not np.allclose(p["w1"], host_params["w1"])  # the optimizer did move the params


def test_state_shardings_when_init_rejects_the_placeholder() -> None:
  """optax.lbfgs reads the params' leaves in init: matched by tree structure instead."""
  mesh = fsdp_mesh()
  params = jax.tree.map(
      lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), make_params(), FSDP_SPECS)
  tx = oa.accumulate(2, optax.lbfgs(memory_size=3))
  state = jax.jit(tx.init, out_shardings=state_shardings(tx, params))(params)
  lbfgs_state = state.inner_opt_state[0]
  for name, spec in FSDP_SPECS.items():
    for tree in (state.acc_grads, lbfgs_state.params, lbfgs_state.updates):
      assert tree[name].sharding.is_equivalent_to(NamedSharding(mesh, spec), tree[name].ndim)
    # The memory stacks 3 copies of each param: the param's spec after an unsharded axis.
    memory = lbfgs_state.diff_params_memory[name]
    assert memory.shape == (3, *params[name].shape)
    assert memory.sharding.is_equivalent_to(NamedSharding(mesh, P(None, *spec)), memory.ndim)
  assert lbfgs_state.count.sharding.is_equivalent_to(NamedSharding(mesh, P()), 0)


def test_state_shardings_replicates_leaves_shaped_unlike_their_param() -> None:
  """adafactor keeps per-param state of other shapes (factored rows/columns, (1,) dummies)."""
  mesh = fsdp_mesh()
  params = jax.tree.map(
      lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), make_params(), FSDP_SPECS)
  tx = oa.accumulate(2, optax.adafactor(1e-2))
  state = jax.jit(tx.init, out_shardings=state_shardings(tx, params))(params)
  factored = state.inner_opt_state[0]
  for name, spec in FSDP_SPECS.items():
    assert factored.v[name].sharding.is_equivalent_to(NamedSharding(mesh, spec), params[name].ndim)
    assert factored.v_row[name].shape != params[name].shape
    assert factored.v_row[name].sharding.is_equivalent_to(NamedSharding(mesh, P()), 1)


def test_jit_fsdp_buffer_keeps_param_sharding_and_matches_large_batch() -> None:
  k, windows, batch = 3, 2, 16
  mesh = fsdp_mesh()
  host_params = make_params(seed=5)
  params = jax.tree.map(
      lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), host_params, FSDP_SPECS)
  tx = oa.accumulate(k, inner_opt())
  shardings = state_shardings(tx, params)
  state = jax.jit(tx.init, out_shardings=shardings)(params)
  batch_sharding = NamedSharding(mesh, P("data"))

  @jax.jit
  def step(p: Any, s: Any, xb: jax.Array, yb: jax.Array) -> tuple[Any, Any]:
    updates, s = tx.update(jax.grad(loss)(p, xb, yb), s, p)
    return optax.apply_updates(p, updates), s

  x, y = make_data(windows, k, batch, seed=6)
  p = params
  for w in range(windows):
    for i in range(k):
      p, state = step(p, state, jax.device_put(x[w, i], batch_sharding),
                      jax.device_put(y[w, i], batch_sharding))
      for name in params:  # leaf by leaf, after every step
        nd = params[name].ndim
        assert state.acc_grads[name].sharding.is_equivalent_to(params[name].sharding, nd), name
        assert state.inner_opt_state[0].trace[name].sharding.is_equivalent_to(
            params[name].sharding, nd), name
        assert p[name].sharding.is_equivalent_to(params[name].sharding, nd), name
  assert_trees_close(p, large_batch_reference(host_params, inner_opt(), x, y))


def test_fsdp_example_trains() -> None:
  fsdp = _load_example("fsdp")
  result = fsdp.main(["--windows", "3", "--k", "4", "--quiet"])
  assert result["max_abs_diff_vs_large_batch"] < 1e-5
  assert result["final_loss"] < result["initial_loss"]


def _load_example(name: str) -> Any:
  from pathlib import Path

  path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"optax_accum_example_{name}", path)
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# --- microbatched under data parallelism -------------------------------------------------


def _microbatching() -> Any:
  return pytest.importorskip(
      "optax_accum.microbatching", reason="optax_accum/microbatching.py (issue 4) not present yet")


def _batch_loss(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
  return loss(params, batch[0], batch[1])


def _check_microbatched_step(
    compiled: Any, run: Any, params: Any, x: np.ndarray, y: np.ndarray
) -> None:
  """One all-reduce of the gradients, after the micro-batch loop; full-batch numbers."""
  reduces = _all_reduces(compiled)
  assert reduces, "expected one gradient all-reduce after the loop"
  assert all(("while", "body") not in c.context for c in reduces), reduces
  # Once per step: the gradients (+ the loss) are all-reduced exactly once.
  assert sum(c.bytes for c in reduces) == _param_bytes(params) + 4, reduces
  value, grads = run()
  ref_value, ref_grads = jax.value_and_grad(_batch_loss)(params, (x, y))
  np.testing.assert_allclose(float(value), float(ref_value), rtol=2e-5)
  assert_trees_close(grads, ref_grads)


def test_microbatched_shard_map_reduces_once_after_the_loop() -> None:
  mesh = data_mesh()
  params = make_params()
  x, y = (a[0, 0] for a in make_data(1, 1, N_DEV * 8, seed=7))
  grad_fn = _microbatching().microbatched(
      jax.value_and_grad(_batch_loss), 4, axis_name="data")
  step = jax.jit(jax.shard_map(
      grad_fn, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
  compiled = step.lower(params, (x, y)).compile()
  _check_microbatched_step(compiled, lambda: step(params, (x, y)), params, x, y)


def test_microbatched_pmap_reduces_once_after_the_loop() -> None:
  params = make_params()
  x, y = (a[0, 0] for a in make_data(1, 1, N_DEV * 8, seed=8))
  grad_fn = _microbatching().microbatched(
      jax.value_and_grad(_batch_loss), 4, axis_name="data")
  step = jax.pmap(grad_fn, axis_name="data", in_axes=(None, 0))
  batch = (x.reshape(N_DEV, 8, D_IN), y.reshape(N_DEV, 8, D_OUT))
  compiled = step.lower(params, batch).compile()

  def run() -> Any:
    value, grads = step(params, batch)
    for d in range(1, N_DEV):  # replicated after the one reduction
      assert_trees_close(jax.tree.map(lambda a, d=d: a[d], grads),
                         jax.tree.map(lambda a: a[0], grads), rtol=0, atol=0)
    return value[0], jax.tree.map(lambda a: a[0], grads)

  _check_microbatched_step(compiled, run, params, x, y)


@_deprecated_options
def test_microbatched_jit_strided_split_does_not_reshard_the_batch() -> None:
  """Under plain jit a batch-sharded input stays put with the strided split."""
  mesh = data_mesh()
  params = make_params()
  x, y = (a[0, 0] for a in make_data(1, 1, N_DEV * 8, seed=9))
  batch_sharding = NamedSharding(mesh, P("data"))
  batch = (jax.device_put(x, batch_sharding), jax.device_put(y, batch_sharding))
  moves = ("all-gather", "all-gather-start", "all-to-all", "collective-permute",
           "collective-permute-start")
  for split, expect_moves in (("strided", False), ("contiguous", True)):
    fn = jax.jit(_microbatching().microbatched(
        jax.value_and_grad(_batch_loss), 4, split=split))
    ops = [c.op for c in hlo_collectives(fn.lower(params, batch).compile())]
    assert any(op in moves for op in ops) == expect_moves, (split, ops)
    value, grads = fn(params, batch)
    ref_value, ref_grads = jax.value_and_grad(_batch_loss)(params, (x, y))
    np.testing.assert_allclose(float(value), float(ref_value), rtol=2e-5)
    assert_trees_close(grads, ref_grads)
