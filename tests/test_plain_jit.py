"""Data parallelism under plain ``jax.jit`` with Explicit mesh axes (no shard_map).

The params are placed on an ``AxisType.Explicit`` mesh entered with
``jax.set_mesh``; the batch is sharded over ``"data"``. Gradients are taken
with ``local_value_and_grad(loss, "data")`` from the unmodified model, so they
come back unreduced (each device's share), and ``accumulate(k, opt,
axis_name="data")`` reduces the window once, when it closes. On the 2-D
FSDP + tensor-parallel mesh the model is written for explicit sharding and
differentiated with respect to ``defer_reduction(params, "data")``.

Every run is compared with an independent single-device reference: the inner
optimizer applied once per window to the gradient of the whole window's data
as one large batch. SGD with momentum is used because it is scale-sensitive:
a gradient summed instead of averaged over the devices (or reduced twice)
changes the result, where Adam would hide it. The compiled-program checks read
the HLO with :func:`optax_accum.debug.hlo_collectives` and pin XLA:CPU's
choices. ``tests/conftest.py`` forces the 8 host devices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum as oa
from optax_accum.debug import Collective, hlo_collectives
from optax_accum.sharding import (
    broadcast_like,
    defer_reduction,
    local_value_and_grad,
    state_shardings,
)

N_DEV = 8
pytestmark = pytest.mark.skipif(
    jax.device_count() < N_DEV,
    reason="needs 8 devices: run through pytest so tests/conftest.py sets XLA_FLAGS",
)
cpu_only = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="pins XLA:CPU's lowering of the collectives")

D_IN, D_HID, D_OUT = 8, 16, 8
BATCH = 16  # examples per micro-step, over all devices
LR, MOMENTUM = 0.3, 0.9
REDUCTIONS = ("all-reduce", "all-reduce-start", "reduce-scatter")
EMITTING = (("conditional", 1),)  # the true branch of accumulate's lax.cond

REPLICATED = {"w1": P(), "b1": P(), "w2": P(), "b2": P()}
# FSDP over "data" and tensor parallel over "model"; b2 stays replicated.
FSDP = {"w1": P("data", "model"), "b1": P("model"), "w2": P("model", "data"), "b2": P()}


def data_mesh() -> Mesh:
  return jax.make_mesh((N_DEV,), ("data",), axis_types=(AxisType.Explicit,))


def fsdp_mesh() -> Mesh:
  return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def inner_opt() -> optax.GradientTransformation:
  return optax.sgd(LR, momentum=MOMENTUM)


def make_params(seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {
      "w1": (rng.normal(size=(D_IN, D_HID)) / np.sqrt(D_IN)).astype(np.float32),
      "b1": (0.1 * rng.normal(size=D_HID)).astype(np.float32),
      "w2": (rng.normal(size=(D_HID, D_OUT)) / np.sqrt(D_HID)).astype(np.float32),
      "b2": (0.1 * rng.normal(size=D_OUT)).astype(np.float32),
  }


def make_data(micro_batches: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``(micro_batches, BATCH, ...)`` inputs, targets and a mask of real examples.

  Micro-batch 2, if any, is all padding (weight 0); the others keep 4 to 16
  real examples, scattered through the micro-batch.
  """
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(micro_batches, BATCH, D_IN)).astype(np.float32)
  y = rng.normal(size=(micro_batches, BATCH, D_OUT)).astype(np.float32)
  real = rng.integers(4, BATCH + 1, size=micro_batches)
  if micro_batches > 2:
    real[2] = 0
  mask = (np.arange(BATCH)[None, :] < real[:, None]).astype(np.float32)
  return x, y, rng.permuted(mask, axis=1)


def per_example_loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
  """The model on one device, for the reference."""
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return jnp.sum((h @ params["w2"] + params["b2"] - y) ** 2, axis=-1)



def sharded_per_example_loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
  """The model written for explicit sharding, for ``defer_reduction`` (reduced params)."""
  z = x @ params["w1"]
  h = jnp.tanh(z + broadcast_like(params["b1"], z))
  # On the FSDP mesh this contracts over "model": an all-reduce of activations.
  o = jnp.einsum("bh,ho->bo", h, params["w2"], out_sharding=P("data", None))
  return jnp.sum((o + broadcast_like(params["b2"], o) - y) ** 2, axis=-1)


def batch_loss(
    per_example: Callable[..., jax.Array], params: Any, x: jax.Array, y: jax.Array,
    mask: jax.Array, weighted: bool,
) -> jax.Array:
  """The micro-batch's mean loss; over its real examples when ``weighted``."""
  losses = per_example(params, x, y)
  if not weighted:
    return jnp.mean(losses)
  return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def large_batch_reference(
    params: dict[str, np.ndarray], windows: Sequence[Sequence[int]],
    data: tuple[np.ndarray, np.ndarray, np.ndarray], reduction: str,
) -> dict[str, jax.Array]:
  """SGD+momentum once per window on the whole window's data, on one device.

  ``"mean"``: the gradient of the mean loss over the window's examples;
  ``"sum"``: that times the window's number of micro-batches; ``"weighted"``:
  the gradient of the mean over the window's real examples.
  """
  x, y, mask = data
  p = jax.tree.map(jnp.asarray, params)
  opt = inner_opt()
  state = opt.init(p)
  for idx in windows:
    xs, ys, ms = (a[list(idx)].reshape(-1, a.shape[-1]) if a.ndim == 3
                  else a[list(idx)].reshape(-1) for a in (x, y, mask))
    grads = jax.grad(batch_loss, argnums=1)(
        per_example_loss, p, xs, ys, ms, reduction == "weighted")
    if reduction == "sum":
      grads = optax.tree.scale(len(idx), grads)
    updates, state = opt.update(grads, state, p)
    p = optax.apply_updates(p, updates)
  return p


def make_step(
    tx: optax.GradientTransformation, *, apply: bool, grads_by: str = "local",
    weighted: bool = False, model: Callable[..., jax.Array] = per_example_loss,
) -> Callable[..., Any]:
  """The jitted train step: one micro-batch in, ``(params, state)`` out.

  ``grads_by``: ``"local"`` (``local_value_and_grad``, unreduced), ``"plain"``
  (``jax.grad``, reduced by XLA on every call) or ``"deferred"``
  (``defer_reduction`` with the model written for explicit sharding).
  """
  loss = lambda p, x, y, mask: batch_loss(model, p, x, y, mask, weighted)
  local = local_value_and_grad(loss, "data", batch_argnums=(1, 2, 3))
  # Token-weighted: each device's share is its masked sum over the global count.
  share = lambda p, x, y, mask, count: jnp.sum(model(p, x, y) * mask) / jnp.maximum(count, 1.0)
  local_weighted = local_value_and_grad(share, "data", batch_argnums=(1, 2, 3), combine="sum")

  def step(params: Any, state: Any, x: jax.Array, y: jax.Array, mask: jax.Array,
           emit_now: jax.Array) -> tuple[Any, Any]:
    if grads_by == "local" and weighted:
      _, grads = local_weighted(params, x, y, mask, jnp.sum(mask))
    elif grads_by == "local":
      _, grads = local(params, x, y, mask)
    elif grads_by == "deferred":
      grads = jax.grad(batch_loss, argnums=1)(
          sharded_per_example_loss, defer_reduction(params, "data"), x, y, mask, weighted)
    else:
      grads = jax.grad(loss)(params, x, y, mask)
    kwargs: dict[str, Any] = {"emit_now": emit_now}
    if weighted:
      kwargs["weight"] = jnp.sum(mask)  # real examples: a global scalar under jit
    if apply:
      return oa.update_and_apply(tx, grads, state, params, **kwargs)
    updates, state = tx.update(grads, state, params, **kwargs)
    return optax.apply_updates(params, updates), state

  return jax.jit(step)


def place_params(specs: dict[str, P]) -> dict[str, jax.Array]:
  """The initial params on the current mesh."""
  return {name: jax.device_put(v, specs[name]) for name, v in make_params().items()}


def train(
    mesh: Mesh, specs: dict[str, P], tx: optax.GradientTransformation,
    data: tuple[np.ndarray, np.ndarray, np.ndarray], emit_now: Sequence[bool], *,
    apply: bool, weighted: bool = False, **step_options: Any,
) -> tuple[Any, Any, list[bool]]:
  """``(params, state, emitted per micro-batch)`` after one step per micro-batch."""
  x, y, mask = data
  with jax.set_mesh(mesh):
    params = place_params(specs)
    state = tx.init(params)
    step = make_step(tx, apply=apply, weighted=weighted, **step_options)
    emitted = []
    for i, now in enumerate(emit_now):
      batch = [jax.device_put(a[i], P("data")) for a in (x, y, mask)]
      params, state = step(params, state, *batch, jnp.asarray(now))
      emitted.append(bool(state.emitted))
    return params, state, emitted


def assert_trees_close(actual: Any, expected: Any, rtol: float = 2e-5, atol: float = 2e-6) -> None:
  jax.tree.map(
      lambda a, e: np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol),
      actual, expected)


def layout(x: jax.Array) -> tuple[Any, ...]:
  """``x``'s partitions, one entry per dim, and its unreduced axes."""
  spec = jax.typeof(x).sharding.spec
  return (*spec.partitions, *(None,) * (x.ndim - len(spec.partitions))), spec.unreduced


def param_layout(spec: P, ndim: int) -> tuple[Any, ...]:
  return (*spec, *(None,) * (ndim - len(spec))), frozenset()


def buffer_layout(spec: P, ndim: int) -> tuple[Any, ...]:
  """One copy per device of a param laid out as ``spec``: a leading dim over "data"."""
  partitions, _ = param_layout(spec, ndim)
  return ("data", *(None if entry == "data" else entry for entry in partitions)), frozenset()


def window_ends(windows: Sequence[Sequence[int]]) -> list[bool]:
  return [i == len(w) - 1 for w in windows for i in range(len(w))]


# --- (a) replicated params, 1-D mesh -------------------------------------------------------


@pytest.mark.parametrize("apply", [False, True], ids=["update", "update_and_apply"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "weighted"])
def test_replicated_matches_large_batch(reduction: str, apply: bool) -> None:
  k, windows = 4, 3
  data = make_data(k * windows)
  tx = oa.accumulate(k, inner_opt(), reduction=reduction, axis_name="data")
  params, state, emitted = train(data_mesh(), REPLICATED, tx, data, [False] * (k * windows),
                                 apply=apply, weighted=reduction == "weighted")
  plan = [range(w * k, (w + 1) * k) for w in range(windows)]
  assert emitted == window_ends(plan)
  assert int(state.gradient_step) == windows
  for name, p in params.items():  # params come back replicated; the buffer: a copy per device
    assert layout(p) == param_layout(P(), p.ndim), name
    assert layout(state.acc_grads[name]) == buffer_layout(P(), p.ndim), name
  expected = large_batch_reference(make_params(), plan, data, reduction)
  # "sum" takes k times larger steps: params of size ~4, float32 rounding ~4e-6.
  assert_trees_close(params, expected, atol=1e-5 if reduction == "sum" else 2e-6)
  assert not np.allclose(params["w1"], make_params()["w1"])  # it did train


def test_replicated_k_schedule_matches_large_batch() -> None:
  """Windows of 2, then 3 micro-batches, from a schedule evaluated under jit."""
  plan = [range(0, 2), range(2, 5), range(5, 8)]
  data = make_data(8)
  tx = oa.accumulate(lambda step: jnp.where(step < 1, 2, 3), inner_opt(), axis_name="data")
  params, state, emitted = train(data_mesh(), REPLICATED, tx, data, [False] * 8, apply=True)
  assert emitted == window_ends(plan)
  assert int(state.gradient_step) == 3
  assert_trees_close(params, large_batch_reference(make_params(), plan, data, "mean"))


def test_replicated_emit_now_matches_large_batch() -> None:
  """``emit_now`` closes a short window; the mean divides by its own length."""
  k = 4
  plan = [range(0, 2), range(2, 6), range(6, 7)]
  data = make_data(7)
  tx = oa.accumulate(k, inner_opt(), axis_name="data")
  emit_now = [i in (1, 6) for i in range(7)]
  params, state, emitted = train(data_mesh(), REPLICATED, tx, data, emit_now, apply=False)
  assert emitted == window_ends(plan)
  assert int(state.gradient_step) == 3
  assert_trees_close(params, large_batch_reference(make_params(), plan, data, "mean"))


def test_replicated_padding_window_is_not_a_step() -> None:
  """A window of weight 0 (only padding) takes no optimizer step and moves no counter."""
  x, y, mask = make_data(6)
  mask[:2] = 0.0  # the first window is all padding
  tx = oa.accumulate(2, inner_opt(), reduction="weighted", axis_name="data")
  params, state, emitted = train(data_mesh(), REPLICATED, tx, (x, y, mask), [False] * 6,
                                 apply=True, weighted=True)
  assert emitted == [False, False, False, True, False, True]
  assert int(state.gradient_step) == 2
  expected = large_batch_reference(make_params(), [range(2, 4), range(4, 6)], (x, y, mask),
                                   "weighted")
  assert_trees_close(params, expected)


# --- (b) FSDP on a 2-D mesh ----------------------------------------------------------------


@pytest.mark.parametrize("apply", [False, True], ids=["update", "update_and_apply"])
def test_fsdp_matches_large_batch_and_keeps_shardings(apply: bool) -> None:
  k, windows = 4, 2
  data = make_data(k * windows)
  tx = oa.accumulate(k, inner_opt(), axis_name="data")
  params, state, emitted = train(fsdp_mesh(), FSDP, tx, data, [False] * (k * windows),
                                 apply=apply, grads_by="deferred")
  plan = [range(w * k, (w + 1) * k) for w in range(windows)]
  assert emitted == window_ends(plan)
  trace = state.inner_opt_state[0].trace
  for name, spec in FSDP.items():
    ndim = params[name].ndim
    assert layout(params[name]) == param_layout(spec, ndim), name
    assert layout(trace[name]) == param_layout(spec, ndim), name  # momentum laid out like it
    assert layout(state.acc_grads[name]) == buffer_layout(spec, ndim), name
  assert_trees_close(params, large_batch_reference(make_params(), plan, data, "mean"))


def test_init_under_the_mesh_lays_the_state_out_like_the_params() -> None:
  """``tx.init`` alone (eager or jitted) gives an unreduced buffer and sharded momentum."""
  tx = oa.accumulate(4, inner_opt(), axis_name="data")
  with jax.set_mesh(fsdp_mesh()):
    params = place_params(FSDP)
    for state in (tx.init(params), jax.jit(tx.init)(params)):
      for name, spec in FSDP.items():
        trace = state.inner_opt_state[0].trace[name]
        assert layout(trace) == param_layout(spec, trace.ndim), name
        assert layout(state.acc_grads[name]) == buffer_layout(spec, trace.ndim), name


def test_state_shardings_keeps_the_buffer_unreduced() -> None:
  k = 2
  data = make_data(k)
  tx = oa.accumulate(k, inner_opt(), axis_name="data")
  with jax.set_mesh(fsdp_mesh()):
    params = place_params(FSDP)
    state = jax.jit(tx.init, out_shardings=state_shardings(tx, params))(params)
    step = make_step(tx, apply=True, grads_by="deferred")
    for i in range(k):
      batch = [jax.device_put(a[i], P("data")) for a in data]
      params, state = step(params, state, *batch, jnp.asarray(False))
  assert_trees_close(params, large_batch_reference(make_params(), [range(k)], data, "mean"))


# --- (c) the compiled program: one reduction per window ------------------------------------


def reductions(compiled: Any) -> tuple[list[Collective], list[Collective]]:
  """``(outside, emitting)``: reductions outside / inside accumulate's emitting branch."""
  outside, emitting = [], []
  for c in hlo_collectives(compiled):
    if c.op in REDUCTIONS:
      (emitting if c.context[:1] == EMITTING else outside).append(c)
  return outside, emitting


def compile_step(
    mesh: Mesh, specs: dict[str, P], tx: optax.GradientTransformation, **step_options: Any,
) -> Any:
  data = make_data(1)
  with jax.set_mesh(mesh):
    params = place_params(specs)
    step = make_step(tx, apply=True, **step_options)
    batch = [jax.device_put(a[0], P("data")) for a in data]
    return step.lower(params, tx.init(params), *batch, jnp.asarray(False)).compile()


def local_buffer_bytes(mesh: Mesh, specs: dict[str, P]) -> int:
  """Bytes of one device's unreduced buffer: each param, all-gathered over "data"."""
  total = 0
  for name, value in make_params().items():
    shards = 1
    for entry in specs[name]:
      for axis in (entry if isinstance(entry, tuple) else (entry,)):
        shards *= mesh.shape[axis] if axis not in (None, "data") else 1
    total += value.nbytes // shards
  return total


@cpu_only
def test_replicated_hlo_one_all_reduce_per_window() -> None:
  mesh, k = data_mesh(), 8
  grad_bytes = sum(v.nbytes for v in make_params().values())
  ours = compile_step(mesh, REPLICATED, oa.accumulate(k, inner_opt(), axis_name="data"))
  outside, emitting = reductions(ours)
  assert outside == []  # mid-steps move no gradient bytes
  assert 1 <= len(emitting) <= len(REPLICATED)  # one per leaf, or combined by XLA
  assert sum(c.bytes for c in emitting) == grad_bytes

  naive = compile_step(mesh, REPLICATED, oa.accumulate(k, inner_opt()), grads_by="plain")
  outside, emitting = reductions(naive)
  assert emitting == []
  assert sum(c.bytes for c in outside) == grad_bytes  # on every call: k times per window


@cpu_only
def test_fsdp_hlo_one_reduction_per_window() -> None:
  mesh, k = fsdp_mesh(), 8
  ours = compile_step(mesh, FSDP, oa.accumulate(k, inner_opt(), axis_name="data"),
                      grads_by="deferred")
  outside, emitting = reductions(ours)
  # Outside the emitting branch: exactly the gradient computation's own
  # reductions (the activations' all-reduce over "model"), none over "data".
  data = make_data(1)
  with jax.set_mesh(mesh):
    params = place_params(FSDP)
    batch = [jax.device_put(a[0], P("data")) for a in data]
    grads_only = jax.jit(lambda p, x, y, m: jax.grad(batch_loss, argnums=1)(
        sharded_per_example_loss, defer_reduction(p, "data"), x, y, m, False))
    baseline, _ = reductions(grads_only.lower(params, *batch).compile())
  activations = BATCH // mesh.shape["data"] * D_OUT * 4
  assert [(c.op, c.bytes) for c in baseline] == [("all-reduce", activations)]
  assert [(c.op, c.bytes) for c in outside] == [(c.op, c.bytes) for c in baseline]
  # The emitting branch reduces each device's buffer once: a reduce-scatter to
  # the params' "data" sharding, which XLA:CPU lowers to an all-reduce (then a
  # slice), combined over the leaves.
  assert 1 <= len(emitting) <= len(FSDP)
  assert {c.op for c in emitting} <= {"all-reduce", "reduce-scatter"}
  assert sum(c.bytes for c in emitting) == local_buffer_bytes(mesh, FSDP)

  naive = compile_step(mesh, FSDP, oa.accumulate(k, inner_opt()), grads_by="plain",
                       model=sharded_per_example_loss)
  outside, emitting = reductions(naive)
  assert emitting == []
  # The gradients are reduced on every call, on top of the activations.
  assert sum(c.bytes for c in outside) == activations + local_buffer_bytes(mesh, FSDP)


# --- (d) wrong inputs: a clear error naming the fix ----------------------------------------


def _one_step(mesh: Mesh, tx: optax.GradientTransformation, **step_options: Any) -> None:
  data = make_data(1)
  with jax.set_mesh(mesh):
    params = place_params(REPLICATED)
    step = make_step(tx, apply=True, **step_options)
    step(params, tx.init(params), *[jax.device_put(a[0], P("data")) for a in data],
         jnp.asarray(False))


def test_reduced_gradients_with_axis_name_raise() -> None:
  tx = oa.accumulate(2, inner_opt(), axis_name="data")
  with pytest.raises(ValueError,
                     match=r"already reduced over `axis_name='data'`.*local_value_and_grad"):
    _one_step(data_mesh(), tx, grads_by="plain")


def test_per_device_gradients_without_axis_name_raise() -> None:
  tx = oa.accumulate(2, inner_opt())
  with pytest.raises(ValueError, match=r"one copy per device.*local_value_and_grad.*"
                     r"axis_name='data'"):
    _one_step(data_mesh(), tx)
  with pytest.raises(ValueError, match=r"unreduced over \['data'\].*without `axis_name`"
                     r".*axis_name='data'"):
    _one_step(data_mesh(), tx, grads_by="deferred", model=sharded_per_example_loss)


def test_axis_name_on_an_auto_axis_raises() -> None:
  mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(AxisType.Auto,))
  tx = oa.accumulate(2, inner_opt(), axis_name="data")
  with jax.set_mesh(mesh):
    params = jax.device_put(make_params(), P())
    with pytest.raises(ValueError, match=r"kinds \['Auto'\].*Use Explicit axes"):
      tx.init(params)
    x = jax.device_put(make_data(1)[0][0], P("data"))
    grad_fn = local_value_and_grad(lambda p, x: jnp.mean(x @ p["w1"]), "data")
    with pytest.raises(ValueError, match=r"Explicit axes.*kinds \['Auto'\]"):
      grad_fn(params, x)


def test_axis_name_mixing_axis_types_raises() -> None:
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto))
  tx = oa.accumulate(2, inner_opt(), axis_name=("data", "model"))
  with jax.set_mesh(mesh):
    params = jax.device_put(make_params(), P())
    with pytest.raises(ValueError, match=r"kinds \['Auto', 'Explicit'\].*not a mix"):
      tx.init(params)


def test_no_set_mesh_trains_like_the_large_batch() -> None:
  """The pjit idiom: arrays placed with NamedSharding, no ``jax.set_mesh`` anywhere."""
  k = 2
  data = make_data(2 * k)
  mesh = data_mesh()
  tx = oa.accumulate(k, inner_opt(), axis_name="data")
  params = {name: jax.device_put(v, NamedSharding(mesh, P())) for name, v in make_params().items()}
  state = tx.init(params)  # the mesh is read from the params' shardings
  assert layout(state.acc_grads["w1"]) == buffer_layout(P(), 2)
  step = make_step(tx, apply=False)
  for i in range(2 * k):
    batch = [jax.device_put(a[i], NamedSharding(mesh, P("data"))) for a in data]
    params, state = step(params, state, *batch, jnp.asarray(False))
  assert int(state.gradient_step) == 2
  plan = [range(0, k), range(k, 2 * k)]
  assert_trees_close(params, large_batch_reference(make_params(), plan, data, "mean"))


def test_axis_name_missing_from_the_mesh_raises_where_it_is_used() -> None:
  """``init`` does not need the axis (``pmap(tx.init)`` names none); ``update`` checks it."""
  tx = oa.accumulate(2, inner_opt(), axis_name="batch")
  with jax.set_mesh(data_mesh()):
    params = place_params(REPLICATED)
    state = tx.init(params)
    grads = jax.tree.map(jnp.zeros_like, params)
    with pytest.raises(ValueError, match=r"`axis_name='batch'` is not an axis of the current mesh"):
      tx.update(grads, state, params)


# FSDP over the data axis alone: local_value_and_grad all-gathers the params
# for the forward pass and the emitting step reduce-scatters the window.
FSDP_DATA = {"w1": P("data"), "b1": P("data"), "w2": P(None, "data"), "b2": P()}


@pytest.mark.parametrize("reduction", ["mean", "weighted"])
def test_local_grads_fsdp_over_data_matches_large_batch(reduction: str) -> None:
  k, windows = 2, 2
  data = make_data(k * windows)
  tx = oa.accumulate(k, inner_opt(), reduction=reduction, axis_name="data")
  params, state, _ = train(data_mesh(), FSDP_DATA, tx, data, [False] * (k * windows),
                           apply=False, weighted=reduction == "weighted")
  for name, spec in FSDP_DATA.items():
    assert layout(params[name]) == param_layout(spec, params[name].ndim), name
    assert layout(state.acc_grads[name]) == buffer_layout(spec, params[name].ndim), name
  plan = [range(w * k, (w + 1) * k) for w in range(windows)]
  assert_trees_close(params, large_batch_reference(make_params(), plan, data, reduction))


@cpu_only
def test_local_grads_fsdp_over_data_reduces_once_at_emit() -> None:
  compiled = compile_step(data_mesh(), FSDP_DATA,
                          oa.accumulate(8, inner_opt(), axis_name="data"))
  outside, emitting = reductions(compiled)
  assert outside == []  # the forward's all-gathers are not reductions
  assert sum(c.bytes for c in emitting) == sum(v.nbytes for v in make_params().values())


def test_local_grads_reject_a_tensor_parallel_layout() -> None:
  with jax.set_mesh(fsdp_mesh()):
    params = place_params(FSDP)
    x = jax.device_put(make_data(1)[0][0], P("data"))
    grad_fn = local_value_and_grad(lambda p, x: jnp.mean(x @ p["w1"]), "data")
    with pytest.raises(ValueError, match=r"argument 0\['b1'\] of `fn` is sharded over the"
                       r" mesh axes \['model'\].*defer_reduction"):
      grad_fn(params, x)


def test_local_grads_aux_is_the_mean_of_the_devices_values() -> None:
  """With ``has_aux``: the global loss and the aux (a per-device mean of the rows, and
  that mean's maximum over features) as the mean over the devices, and the sum of the
  per-device gradient copies is the whole batch's gradient."""
  x, y, _ = make_data(1)
  x, y = x[0], y[0]

  def loss(p: Any, x: jax.Array, y: jax.Array) -> tuple[jax.Array, Any]:
    x_mean = jnp.mean(x, 0)
    return jnp.mean(per_example_loss(p, x, y)), {"x_mean": x_mean, "peak": jnp.max(x_mean)}

  with jax.set_mesh(data_mesh()):
    params = place_params(REPLICATED)
    grad_fn = local_value_and_grad(loss, "data", batch_argnums=(1, 2), has_aux=True)
    (value, aux), grads = jax.jit(grad_fn)(params, jax.device_put(x, P("data")),
                                           jax.device_put(y, P("data")))
  (ref_value, _), ref_grads = jax.value_and_grad(loss, has_aux=True)(make_params(), x, y)
  per_device = np.asarray(x).reshape(N_DEV, -1, x.shape[-1]).mean(1)  # [devices, features]
  np.testing.assert_allclose(value, ref_value, rtol=2e-5)
  np.testing.assert_allclose(aux["x_mean"], np.asarray(x).mean(0), rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(aux["peak"], per_device.max(1).mean(), rtol=2e-5)
  assert not np.isclose(per_device.max(1).mean(), per_device.max(1).max())  # mean, not max
  assert_trees_close(jax.tree.map(lambda g: jnp.sum(g, 0), grads), ref_grads)


def test_local_grads_name_bad_batch_argnums() -> None:
  loss = lambda p, x: jnp.mean(x @ p["w1"])
  with pytest.raises(TypeError, match=r"`batch_argnums` must be an int or a sequence of ints"):
    local_value_and_grad(loss, "data", batch_argnums="1")
  with pytest.raises(ValueError, match=r"`batch_argnums` is empty"):
    local_value_and_grad(loss, "data", batch_argnums=())
  with jax.set_mesh(data_mesh()):
    params = place_params(REPLICATED)
    x = jax.device_put(make_data(1)[0][0], P("data"))
    with pytest.raises(ValueError, match=r"names position 0, the params"):
      local_value_and_grad(loss, "data", batch_argnums=0)(params, x)
    with pytest.raises(ValueError, match=r"`batch_argnums` contains 2, but .* 2 positional"):
      local_value_and_grad(loss, "data", batch_argnums=2)(params, x)
    _, grads = local_value_and_grad(loss, "data", batch_argnums=-1)(params, x)
    assert layout(grads["w1"]) == buffer_layout(P(), 2)


# --- (e) skip_nonfinite and the noise estimate, as under shard_map -------------------------


def test_skip_nonfinite_drops_the_micro_batch_on_every_device() -> None:
  """A NaN in one device's rows drops that micro-batch everywhere: it does not count, the
  windows close on the others, and the result is the large batch without it."""
  k = 4
  x, y, mask = make_data(9)
  x[2, 0, 0] = np.nan  # row 0 of micro-batch 2: device 0's rows only
  tx = oa.accumulate(k, inner_opt(), axis_name="data", skip_nonfinite=True)
  params, state, emitted = train(data_mesh(), REPLICATED, tx, (x, y, mask), [False] * 9,
                                 apply=True)
  plan = [[0, 1, 3, 4], [5, 6, 7, 8]]
  assert int(state.num_skipped) == 1 and int(state.gradient_step) == 2
  assert emitted == [False, False, False, False, True, False, False, False, True]
  assert_trees_close(params, large_batch_reference(make_params(), plan, (x, y, mask), "mean"))


def shard_map_noise_state(data: tuple[np.ndarray, ...], k: int, steps: int) -> Any:
  """The noise estimate of ``per_device_state`` under shard_map on the same data."""
  from functools import partial

  from optax_accum.sharding import per_device_state, shard_map_specs

  mesh = data_mesh()
  tx = per_device_state(oa.accumulate(k, inner_opt(), axis_name="data",
                                      track_noise_scale=0.5), "data")
  params = jax.device_put(make_params(), NamedSharding(mesh, P()))
  specs = shard_map_specs(tx, params, "data")

  @jax.jit
  @partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
           out_specs=(P(), specs))
  def step(p: Any, s: Any, xb: jax.Array, yb: jax.Array) -> Any:
    local = jax.lax.pcast(p, "data", to="varying")
    grads = jax.grad(lambda q: jnp.mean(per_example_loss(q, xb, yb)))(local)
    return oa.update_and_apply(tx, grads, s, p)

  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
  rows = NamedSharding(mesh, P("data"))
  for i in range(steps):
    params, state = step(params, state, *(jax.device_put(a[i], rows) for a in data[:2]))
  return state.noise_stats


def test_noise_scale_equals_the_shard_map_estimate() -> None:
  """Its unit is one device's micro-batch on both paths: the same estimate."""
  k, windows = 4, 3
  data = make_data(k * windows)
  tx = oa.accumulate(k, inner_opt(), axis_name="data", track_noise_scale=0.5)
  _, state, _ = train(data_mesh(), REPLICATED, tx, data, [False] * (k * windows), apply=True)
  ours, theirs = state.noise_stats, shard_map_noise_state(data, k, k * windows)
  assert int(ours.num_windows) == int(theirs.num_windows) == windows
  for field in ("signal", "noise"):
    np.testing.assert_allclose(getattr(ours, field), getattr(theirs, field), rtol=1e-4,
                               err_msg=field)
  assert np.isfinite(float(oa.noise_scale(state))) or int(ours.num_windows) < 10


@cpu_only
@pytest.mark.parametrize("option", ["skip_nonfinite", "track_noise_scale"])
def test_skip_and_noise_add_no_gradient_communication(option: str) -> None:
  """Mid-steps: one scalar reduction (the devices agree on a skip), or none (the noise
  estimate's sums stay per device); the window: one reduction, as without them."""
  tx = oa.accumulate(8, inner_opt(), axis_name="data", **{option: True})
  outside, emitting = reductions(compile_step(data_mesh(), REPLICATED, tx))
  if option == "skip_nonfinite":
    assert len(outside) == 1 and outside[0].bytes <= 4, outside
  else:
    assert outside == []
  grad_bytes = sum(v.nbytes for v in make_params().values())
  assert grad_bytes <= sum(c.bytes for c in emitting) <= grad_bytes + 64
