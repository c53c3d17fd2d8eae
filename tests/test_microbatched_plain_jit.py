"""`microbatched` under plain `jax.jit` with the batch sharded over mesh axes.

Every result is checked against the full-batch `jax.value_and_grad` call on
one device. The compiled programs are checked with `hlo_collectives`: the
gradient reduction runs once, after the micro-batch loop, where the naive
program (plain jit of an in-step loop) runs it inside the loop.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import optax_accum as oa
from optax_accum import gradient_noise
from optax_accum.debug import hlo_collectives
from optax_accum.microbatching import microbatched

RTOL, ATOL = 2e-5, 1e-6
D_IN, HIDDEN = 16, 64
LOOP = ("while", "body")

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8, reason="needs 8 devices (tests/conftest.py forces 8 host CPU devices)")


def make_params(seed=0):
  rng = np.random.default_rng(seed)
  return {"w1": (rng.normal(size=(D_IN, HIDDEN)) / 4).astype(np.float32),
          "b1": rng.normal(size=HIDDEN).astype(np.float32),
          "w2": (rng.normal(size=HIDDEN) / 8).astype(np.float32)}


def make_batch(n=64, seed=1):
  rng = np.random.default_rng(seed)
  return {"x": rng.normal(size=(n, D_IN)).astype(np.float32),
          "y": rng.normal(size=n).astype(np.float32)}


def per_example(params, batch):
  # The bias add is elementwise between a param and data-sharded activations.
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  return (h @ params["w2"] - batch["y"]) ** 2


def mean_loss(params, batch):
  return jnp.mean(per_example(params, batch))


def assert_close(actual, expected):
  a_leaves, a_def = jax.tree.flatten(actual)
  e_leaves, e_def = jax.tree.flatten(expected)
  assert a_def == e_def
  for a, e in zip(a_leaves, e_leaves, strict=True):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64),
                               rtol=RTOL, atol=ATOL)


def explicit_mesh(shape=(8,), names=("data",)):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))


def collectives(f, *args):
  return hlo_collectives(jax.jit(f).lower(*args).compile())


def grad_bytes(params):
  return sum(math.prod(np.shape(p)) * 4 for p in jax.tree.leaves(params))


def naive_in_step_loop(k):
  """What plain jit does without microbatched's placement: a scan of value_and_grad."""
  def fn(params, batch):
    mbs = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1),
                       batch)
    def body(acc, mb):
      return jax.tree.map(jnp.add, acc, jax.grad(mean_loss)(params, mb)), None
    return lax.scan(body, jax.tree.map(jnp.zeros_like, params), mbs)[0]
  return fn


# ------------------------------------------------------- Explicit axes, 1-D
@pytest.mark.parametrize("k", [1, 4])
def test_replicated_params_equal_full_batch_with_one_all_reduce_after_the_loop(k):
  params, batch = make_params(), make_batch()
  ref = jax.value_and_grad(mean_loss)(params, batch)
  with jax.set_mesh(explicit_mesh()):
    p, b = jax.device_put(params, P()), jax.device_put(batch, P("data"))
    fn = microbatched(jax.value_and_grad(mean_loss), k)
    loss, grads = jax.jit(fn)(p, b)
    assert_close((loss, grads), ref)
    assert all(jax.typeof(g).sharding.spec == jax.typeof(q).sharding.spec
               for g, q in zip(jax.tree.leaves(grads), jax.tree.leaves(p), strict=True))
    ops = collectives(fn, p, b)
  assert [c.op for c in ops] == ["all-reduce"], ops  # grads and loss, combined
  assert ops[0].context == () and ops[0].bytes >= grad_bytes(params)


def test_the_naive_program_all_reduces_inside_the_loop():
  params, batch = make_params(), make_batch()
  with jax.set_mesh(explicit_mesh()):
    p, b = jax.device_put(params, P()), jax.device_put(batch, P("data"))
    ops = collectives(naive_in_step_loop(4), p, b)
  inside = [c for c in ops if LOOP in c.context and c.op == "all-reduce"]
  assert sum(c.bytes for c in inside) >= grad_bytes(params), ops


def test_weighted_is_normalised_globally():
  params = make_params()
  rng = np.random.default_rng(5)
  batch = {**make_batch(), "mask": (rng.random(64) < 0.3).astype(np.float32)}
  batch["mask"][:8] = 0.0  # device 0 holds only padding
  def loss_sum(p, b):
    return jnp.sum(per_example(p, b) * b["mask"]), jnp.sum(b["mask"])
  def ref_loss(p, b):
    num, den = loss_sum(p, b)
    return num / den
  ref = jax.value_and_grad(ref_loss)(params, batch)
  with jax.set_mesh(explicit_mesh()):
    p, b = jax.device_put(params, P()), jax.device_put(batch, P("data"))
    fn = microbatched(jax.value_and_grad(loss_sum, has_aux=True), 2, normalize="weighted")
    assert_close(jax.jit(fn)(p, b), ref)


@pytest.mark.parametrize("w1_spec", [P("data"), P(None, "data")], ids=str)
def test_fsdp_params_are_gathered_before_and_reduce_scattered_after(w1_spec):
  """FSDP over the data axis, on w1's first dim or its second (each gradient is
  reduce-scattered onto the dim its param is sharded on)."""
  params, batch = make_params(), make_batch()
  ref = jax.value_and_grad(mean_loss)(params, batch)
  specs = {"w1": w1_spec, "b1": P("data"), "w2": P()}
  with jax.set_mesh(explicit_mesh()):
    p = {n: jax.device_put(v, specs[n]) for n, v in params.items()}
    b = jax.device_put(batch, P("data"))
    fn = microbatched(jax.value_and_grad(mean_loss), 4)
    loss, grads = jax.jit(fn)(p, b)
    assert_close((loss, grads), ref)
    assert {n: jax.typeof(g).sharding.spec for n, g in grads.items()} == {
        n: jax.typeof(q).sharding.spec for n, q in p.items()}
    ops = collectives(fn, p, b)
  assert not [c for c in ops if LOOP in c.context], ops
  assert sorted(c.op for c in ops) == ["all-gather", "all-gather", "all-reduce",
                                       "reduce-scatter", "reduce-scatter"], ops
  scattered = sum(c.bytes for c in ops if c.op == "reduce-scatter")
  assert scattered == (D_IN * HIDDEN + HIDDEN) * 4 // 8  # each device keeps its slice


# -------------------------------------------------- Explicit axes, 2-D mesh
@pytest.mark.parametrize("w1_spec", [P("data", "model"), P(None, "model")], ids=str)
def test_2d_mesh_reduces_the_gradients_once_after_the_loop(w1_spec):
  params, batch = make_params(), make_batch(16)  # 2 rows per device and micro-batch
  ref = jax.value_and_grad(mean_loss)(params, batch)
  specs = {"w1": w1_spec, "b1": P("model"), "w2": P()}
  with jax.set_mesh(explicit_mesh((4, 2), ("data", "model"))):
    p = {n: jax.device_put(v, specs[n]) for n, v in params.items()}
    b = jax.device_put(batch, P("data"))
    fn = microbatched(jax.value_and_grad(mean_loss), 2)
    loss, grads = jax.jit(fn)(p, b)
    assert_close((loss, grads), ref)
    assert {n: jax.typeof(g).sharding.spec for n, g in grads.items()} == {
        n: jax.typeof(q).sharding.spec for n, q in p.items()}
    ops = collectives(fn, p, b)
    naive = collectives(naive_in_step_loop(2), p, b)
  # Gradient-sized: the local slice of w1's gradient (model-sharded). Inside the
  # loop only the tensor-parallel activations move (2 rows x HIDDEN floats).
  local_w1 = D_IN * HIDDEN * 4 // 2
  assert not [c for c in ops if LOOP in c.context and c.bytes >= local_w1 // 2], ops
  after = [c for c in ops if c.context == () and c.op in ("all-reduce", "reduce-scatter")]
  assert len(after) == 1 and after[0].bytes >= local_w1, ops
  assert [c for c in naive if LOOP in c.context and c.bytes >= local_w1], naive


# ------------------------------------------------------------- Auto axes
def test_auto_axes_need_axis_name_for_one_reduction_after_the_loop():
  params, batch = make_params(), make_batch()
  ref = jax.value_and_grad(mean_loss)(params, batch)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  with jax.set_mesh(mesh):
    p, b = jax.device_put(params, P()), jax.device_put(batch, P("data"))
    plain = microbatched(jax.value_and_grad(mean_loss), 4)
    named = microbatched(jax.value_and_grad(mean_loss), 4, axis_name="data")
    for fn in (plain, named):
      assert_close(jax.jit(fn)(p, b), ref)
    before, after = collectives(plain, p, b), collectives(named, p, b)
  # Without the name the types hide the split: one all-reduce per micro-batch.
  assert [c.op for c in before if LOOP in c.context] == ["all-reduce"], before
  assert [(c.op, c.context) for c in after] == [("all-reduce", ())], after


# ----------------------------------------------------- aux and noise stats
def test_aux_rules_under_plain_jit():
  params, batch = make_params(), make_batch()
  def loss(p, b):
    per = per_example(p, b)
    return jnp.mean(per), {"per_example": per, "mean": jnp.mean(per), "max": jnp.max(per),
                           "stacked": per}
  fn = jax.value_and_grad(loss, has_aux=True)
  (ref_loss, ref_aux), ref_grads = fn(params, batch)
  # "stack": row i holds micro-batch i's rows of every device, device by device; each
  # device's micro-batch i is its rows i, i + 4 (strided, k = 4, 8 rows per device).
  stacked = np.asarray(ref_aux["stacked"]).reshape(8, 2, 4)  # [device, row, micro-batch]
  ref_aux["stacked"] = stacked.transpose(2, 0, 1).reshape(4, 16)
  rules = {"per_example": "concat", "mean": "mean", "max": "max", "stacked": "stack"}
  with jax.set_mesh(explicit_mesh()):
    p, b = jax.device_put(params, P()), jax.device_put(batch, P("data"))
    (loss_val, aux), g = jax.jit(microbatched(fn, 4, has_aux=True, aux_rules=rules))(p, b)
    assert_close((loss_val, aux, g), (ref_loss, ref_aux, ref_grads))  # concat: batch order
    with pytest.raises(ValueError, match=r"aux_rules='last' at aux\['mean'\].*own shard_map"):
      jax.jit(microbatched(fn, 4, has_aux=True, aux_rules={**rules, "mean": "last"}))(p, b)


def test_noise_stats_span_every_device_micro_batch_in_the_one_reduction():
  params, batch = make_params(), make_batch()
  with jax.set_mesh(explicit_mesh()):
    p, b = jax.device_put(params, P()), jax.device_put(batch, P("data"))
    fn = microbatched(jax.value_and_grad(mean_loss), 2, return_noise_stats=True)
    out, stats = jax.jit(fn)(p, b)
    ops = collectives(fn, p, b)
  assert_close(out, jax.value_and_grad(mean_loss)(params, batch))
  assert [(c.op, c.context) for c in ops] == [("all-reduce", ())], ops
  assert int(stats.window_count) == 16  # 8 devices x 2 micro-batches of 4 rows
  tx = oa.accumulate(16, None, reduction="mean", track_noise_scale=0.9)
  state, update = tx.init(params), jax.jit(tx.update)
  for dev in range(8):
    rows = jax.tree.map(lambda x, dev=dev: x[8 * dev:8 * dev + 8], batch)
    for i in range(2):  # microbatched's strided split of the device's rows
      mb = jax.tree.map(lambda x, i=i: x[i::2], rows)
      _, state = update(jax.grad(mean_loss)(params, mb), state, params)
  mine = gradient_noise.fold(gradient_noise.init(), stats, decay=0.9)
  np.testing.assert_allclose((mine.signal, mine.noise),
                             (state.noise_stats.signal, state.noise_stats.noise), rtol=1e-4)


# ------------------------------------------------------------ bad inputs
def test_batch_leaves_split_differently_raise():
  params, batch = make_params(), make_batch()
  with jax.set_mesh(explicit_mesh()):
    p = jax.device_put(params, P())
    b = {"x": jax.device_put(batch["x"], P("data")), "y": jax.device_put(batch["y"], P())}
    with pytest.raises(ValueError, match=r"split differently.*\['x'\].*\['y'\].*device_put"):
      jax.jit(microbatched(jax.value_and_grad(mean_loss), 4))(p, b)


# A batch that does not divide on each device: tests/test_batch_rules.py, for both wrappers.


def test_mixed_axis_kinds_with_a_hidden_batch_split_raise():
  params, batch = make_params(), make_batch()
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Explicit))
  with jax.set_mesh(mesh):
    p = {n: jax.device_put(v, P(None, "model") if n == "w1" else P()) for n, v in params.items()}
    b = jax.device_put(batch, jax.sharding.NamedSharding(mesh, P("data")))
    fn = microbatched(jax.value_and_grad(mean_loss), 4)
    with pytest.raises(ValueError, match=r"mixes Auto axes \('data',\).*axis_name='data'"):
      jax.jit(fn)(p, b)
    with pytest.raises(ValueError, match=r"kinds \['Auto', 'Explicit'\]"):
      jax.jit(microbatched(jax.value_and_grad(mean_loss), 4, axis_name=("data", "model")))(p, b)
    # The fix the message names: the data axis named.
    named = microbatched(jax.value_and_grad(mean_loss), 4, axis_name="data")
    assert_close(jax.jit(named)(p, b), jax.value_and_grad(mean_loss)(params, batch))


def test_axis_name_other_than_the_batch_split_raises():
  params, batch = make_params(), make_batch()
  with jax.set_mesh(explicit_mesh((4, 2), ("data", "model"))):
    p, b = jax.device_put(params, P()), jax.device_put(batch, P("data"))
    fn = microbatched(jax.value_and_grad(mean_loss), 2, axis_name="model")
    with pytest.raises(ValueError, match=r"sharded over \('data',\).*Name the axes"):
      jax.jit(fn)(p, b)


# ------------------------------------------- mesh idioms of the loss and the caller
def own_shard_map_loss(params, batch):
  """A mean loss that runs its own ``shard_map`` over the data axis (a per-device kernel)."""
  def per_device(p, b):
    return lax.psum(jnp.sum(per_example(p, b)), "data")
  total = jax.shard_map(per_device, in_specs=(P(), P("data")), out_specs=P())(params, batch)
  return total / batch["y"].shape[0]


@pytest.mark.parametrize("k", [1, 4])
def test_a_loss_with_its_own_shard_map_gets_whole_micro_batches(k):
  """Each micro-batch holds every device's rows, as the loss's ``shard_map`` expects."""
  params, batch = make_params(), make_batch()
  ref = jax.value_and_grad(mean_loss)(params, batch)
  with jax.set_mesh(explicit_mesh()):
    p, b = jax.device_put(params, P()), jax.device_put(batch, P("data"))
    assert_close(jax.jit(jax.value_and_grad(own_shard_map_loss))(p, b), ref)  # the idiom
    assert_close(jax.jit(microbatched(jax.value_and_grad(own_shard_map_loss), k))(p, b), ref)


@pytest.mark.parametrize("placed", ["on no mesh", "on an Auto mesh, none set"])
def test_an_axis_name_bound_nowhere_raises_naming_the_fix(placed):
  """Under jit without `jax.set_mesh`, `axis_name` names no axis in scope (it was JAX's
  NameError from inside the package); under `jax.set_mesh` the same call is the full batch's."""
  params, batch = make_params(), make_batch()
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  if placed != "on no mesh":  # the pjit idiom: NamedSharding, no jax.set_mesh
    batch = jax.device_put(batch, jax.sharding.NamedSharding(mesh, P("data")))
  fn = microbatched(jax.value_and_grad(mean_loss), 4, axis_name="data")
  with pytest.raises(ValueError,
                     match=r"axis_name='data'.*bound nowhere.*microbatched.*jax\.set_mesh"):
    jax.jit(fn)(params, batch)
  with jax.set_mesh(mesh):
    assert_close(jax.jit(fn)(params, batch), jax.value_and_grad(mean_loss)(params, batch))
