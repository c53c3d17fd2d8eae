"""Tests of :mod:`optax_accum.offload`: the inner optimizer's state in host memory.

Every run is compared bit for bit with the same run on the device (the inner optimizer
without ``host_state``; a leaf streamed a layer at a time on XLA:CPU: ``BY_ROWS``), and
after every step every leaf of the inner state must be in ``pinned_host`` and typed
there. On XLA:CPU host and device memory are one, so what moves is checked where JAX
decides it: in the step's jaxpr (each piece's ``device_put`` from host memory, the barrier
that orders the pieces)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum as oa
from optax_accum.sharding import local_value_and_grad, reshard_state, state_shardings

HOST = "pinned_host"
PARAMS = {"w": np.linspace(-1.0, 1.0, 24, dtype=np.float32).reshape(8, 3),
          "b": np.full(3, 0.1, np.float32)}


def adam() -> optax.GradientTransformation:
  return optax.adam(3e-2)


def adamw_clipped(host: Callable[[Any], Any] = lambda opt: opt) -> optax.GradientTransformation:
  """Clipping, then adamw with a schedule; ``host`` wraps the adamw alone."""
  schedule = optax.linear_schedule(3e-2, 1e-3, transition_steps=3)
  return optax.chain(optax.clip_by_global_norm(0.5),
                     host(optax.adamw(schedule, weight_decay=0.1)))


def makes_arrays() -> optax.GradientTransformation:
  """Optimizers whose update creates arrays (``zeros_like``, ``where``): clipping, Lamb."""
  return optax.chain(optax.clip_by_global_norm(0.5), optax.inject_hyperparams(optax.lamb)(3e-2))


OPTIMIZERS = {"adam": adam, "adamw_clipped": adamw_clipped, "makes_arrays": makes_arrays}


def loss(params: Any, x: jax.Array) -> jax.Array:
  return jnp.mean(jnp.tanh(x @ params["w"] + params["b"]) ** 2)


def batch(i: int, rows: int = 8) -> jax.Array:
  return jnp.asarray(np.sin(np.arange(rows * 8, dtype=np.float32).reshape(rows, 8) * (i + 1)))


def inner_of(state: Any) -> Any:
  """The inner optimizer's state: of ``host_state`` if the run has one."""
  inner = state.inner_opt_state if isinstance(state, oa.AccumulateState) else state
  return inner.inner_state if isinstance(inner, oa.offload.HostState) else inner


def assert_on_host(state: Any) -> None:
  """Every leaf of the inner state placed in ``pinned_host`` and typed there (a step
  returns a leaf typed on the device to the device)."""
  kinds = {(x.sharding.memory_kind, str(jax.typeof(x).memory_space))
           for x in jax.tree.leaves(inner_of(state))}
  assert kinds == {(HOST, "MemorySpace.Host")}, kinds


# The update is the device's own arithmetic, streamed: bit for bit on every backend. Where a
# leaf of stacked layers streams a layer at a time (a `lax.scan`), XLA:CPU (jaxlib 0.10.2 to
# 0.12) rounds a division by a number the loop's iterations share (Adam's bias correction) as
# a multiplication by its reciprocal or not, apart from the whole leaf's: within 4 float32 ulps
# of the leaf's scale there (`.tpu/matrix.py`'s runs: 1 ulp). A TPU v5e computes them alike:
# bit for bit (tests/results/tpu.md).
BY_ROWS = 4 * float(np.finfo(np.float32).eps) if jax.default_backend() == "cpu" else None


def by_rows(params: Any) -> float | None:
  """``BY_ROWS``; on an accelerator 2 bfloat16 ulps where a leaf is bfloat16 (a TPU v5e's
  bfloat16 leaf streamed by layers differed from the device run: tests/results/tpu.md)."""
  low = any(np.asarray(x).dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
  return 2 * float(jnp.finfo(jnp.bfloat16).eps) if low and BY_ROWS is None else BY_ROWS


def assert_bitwise(a: Any, b: Any, within: float | None = None) -> None:
  """Bit for bit; floats within ``within`` of each leaf's largest entry where it is given."""
  a, b = jax.device_get((a, b))
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert np.asarray(x).dtype == np.asarray(y).dtype, (x, y)
    if within is not None and jnp.issubdtype(np.asarray(x).dtype, jnp.floating) and np.size(x):
      scale = float(np.max(np.abs(np.asarray(y, np.float64))))
      np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=0,
                                 atol=within * scale)
    else:
      assert np.array_equal(x, y), (x, y)


def fresh(tree: Any) -> Any:
  return jax.tree.map(jnp.array, tree)


def across_steps(k: int, make: Callable[[], Any], host: bool) -> tuple[Any, Callable]:
  tx = oa.accumulate(k, oa.host_state(make()) if host else make())
  return tx, lambda p, s, x: oa.update_and_apply(tx, jax.grad(loss)(p, x), s, p)


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.catches("host_state_on_device")
def test_across_steps_equals_the_device_run_bit_for_bit(k: int, opt: str) -> None:
  """``jax.jit``, params and state donated, over two windows and one micro-batch more."""
  _, on_device = across_steps(k, OPTIMIZERS[opt], host=False)
  tx, on_host = across_steps(k, OPTIMIZERS[opt], host=True)
  steps = {"one program": jax.jit(on_host, donate_argnums=(0, 1))}
  runs = {name: (fresh(PARAMS), tx.init(fresh(PARAMS))) for name in steps}
  ref_tx = oa.accumulate(k, OPTIMIZERS[opt]())
  ref = (fresh(PARAMS), ref_tx.init(fresh(PARAMS)))
  for i in range(2 * k + 1):
    ref = jax.jit(on_device)(*ref, batch(i))
    for name, step in steps.items():
      runs[name] = step(*runs[name], batch(i))
      assert_on_host(runs[name][1])
      params, state = runs[name]
      assert_bitwise((params, inner_of(state), state.gradient_step),
                     (ref[0], inner_of(ref[1]), ref[1].gradient_step))
  assert int(ref[1].gradient_step) == 2 + (k == 1)


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.catches("host_state_on_device")
def test_in_step_equals_the_device_run_bit_for_bit(k: int, opt: str) -> None:
  """``microbatched`` for the gradients, then the optimizer in the same step; with
  clipping, ``optax.chain(clip, host_state(adamw))`` (the state of the chain's leaves the
  same, in the same order: ``HostState`` adds none)."""
  def make_step(tx: Any) -> Callable:
    def step(p: Any, s: Any, x: jax.Array) -> tuple[Any, Any]:
      _, grads = oa.microbatched(jax.value_and_grad(loss), k)(p, x)
      updates, s = tx.update(grads, s, p)
      return optax.apply_updates(p, updates), s
    return jax.jit(step, donate_argnums=(0, 1))

  ref_tx = OPTIMIZERS[opt]()
  tx = adamw_clipped(oa.host_state) if opt == "adamw_clipped" else oa.host_state(
      OPTIMIZERS[opt]())
  ref, run = (fresh(PARAMS), ref_tx.init(fresh(PARAMS))), (fresh(PARAMS), tx.init(fresh(PARAMS)))
  ref_step, step = make_step(ref_tx), make_step(tx)
  for i in range(3):
    ref, run = ref_step(*ref, batch(i, 16)), step(*run, batch(i, 16))
    assert_on_host(run[1])
    assert_bitwise(jax.tree.leaves(run), jax.tree.leaves(ref))


def eqns(jaxpr: Any, name: str) -> list[Any]:
  """Each equation of primitive ``name`` in ``jaxpr``, nested ones included."""
  found = [e for e in jaxpr.eqns if e.primitive.name == name]
  for e in jaxpr.eqns:
    for sub in jax.extend.core.jaxprs_in_params(e.params):
      found += eqns(sub, name)
  return found


def brought_in(jaxpr: Any) -> list[int]:
  """The bytes of each value ``jaxpr`` moves from host memory to the device."""
  return [v.aval.size * v.aval.dtype.itemsize for e in eqns(jaxpr, "device_put")
          if e.params["devices"] == (jax.memory.Space.Device,) for v in e.invars
          if v.aval.memory_space == jax.memory.Space.Host]


LEAVES = {f"w{i}": np.linspace(-1.0, 1.0, 64, dtype=np.float32).reshape(8, 8) * (i + 1)
          for i in range(6)}
STACKED = {"layers": np.sin(np.arange(6 * 8 * 8, dtype=np.float32)).reshape(6, 8, 8),
           "b": np.full(8, 0.1, np.float32)}


def one_device() -> Any:
  """A one-device Explicit mesh: a leaf on it streams by rows whatever the device count."""
  return jax.make_mesh((1,), ("d",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])


def streamed_run(make: Callable[[], Any], params: Any, steps: int = 3) -> tuple[Any, Any]:
  """``steps`` of ``tx.update`` + ``optax.apply_updates`` (jitted), with ``host_state`` and
  without: both runs' params and inner states."""
  runs = []
  for tx in (oa.host_state(make()), make()):
    p, s = fresh(params), tx.init(fresh(params))
    step = jax.jit(lambda p, s, g, tx=tx: (lambda u, s: (optax.apply_updates(p, u), s))(
        *tx.update(g, s, p)))
    for i in range(steps):
      p, s = step(p, s, jax.tree.map(lambda x, i=i: jnp.sin(x * (i + 2)) * 0.1, p))
    runs.append((p, s))
  assert_on_host(runs[0][1])
  return (runs[0][0], inner_of(runs[0][1])), runs[1]


@pytest.mark.catches("host_state_moves_the_state_in", "host_state_on_device")
def test_the_state_streams_through_the_device_a_piece_at_a_time() -> None:
  """Six leaves, pieces of at most an eighth of the state (a leaf each): inside
  ``accumulate`` each piece's state comes to the device after the last piece's new state is
  back in host memory (one ``optimization_barrier`` a piece), never more than a piece at
  once; bit for bit."""
  tx = oa.accumulate(2, oa.host_state(adam()))
  step = lambda p, s, g: oa.update_and_apply(tx, g, s, p)
  jaxpr = jax.make_jaxpr(step)(fresh(LEAVES), tx.init(fresh(LEAVES)), fresh(LEAVES)).jaxpr
  assert not eqns(jaxpr, "compute_on")
  moved = brought_in(jaxpr)
  assert sorted(moved) == sorted([4] + [64 * 4] * 12), moved  # adam's count, mu and nu
  barriers = [e for e in eqns(jaxpr, "optimization_barrier")
              if any(v.aval.memory_space == jax.memory.Space.Host for v in e.invars)]
  assert len(barriers) == 6  # each piece's state in after the last piece's is out
  run, ref = (fresh(LEAVES), tx.init(fresh(LEAVES))), (fresh(LEAVES), oa.accumulate(
      2, adam()).init(fresh(LEAVES)))
  ref_step = jax.jit(lambda p, s, g: oa.update_and_apply(oa.accumulate(2, adam()), g, s, p))
  for i in range(4):
    g = jax.tree.map(lambda x, i=i: x * (i + 1.0), fresh(LEAVES))
    run = jax.jit(step)(*run, g)
    ref = ref_step(*ref, g)
    assert_on_host(run[1])
    assert_bitwise((run[0], inner_of(run[1])), (ref[0], inner_of(ref[1])))


@pytest.mark.catches("host_state_moves_the_state_in")
def test_a_leaf_of_stacked_layers_streams_a_layer_at_a_time(
    monkeypatch: pytest.MonkeyPatch) -> None:
  """A (6, 8, 8) leaf whose state is over a piece: a ``lax.scan`` over its layers brings one
  layer's state in and sends it back, the updates written in place; bit for bit."""
  monkeypatch.setattr(oa.offload, "PIECE_BYTES", 1024)
  with jax.set_mesh(one_device()):
    params = jax.device_put(fresh(STACKED), NamedSharding(one_device(), P()))
    tx = oa.host_state(adam())
    jaxpr = jax.make_jaxpr(tx.update)(params, tx.init(params), params).jaxpr
    scans = eqns(jaxpr, "scan")
    assert len(scans) == 1, jaxpr
    assert sorted(brought_in(scans[0].params["jaxpr"].jaxpr)) == [8 * 8 * 4] * 2  # a layer's
    for make in (adam, lambda: optax.lion(1e-3), lambda: optax.sgd(1e-2, momentum=0.9)):
      assert_bitwise(*streamed_run(make, params), within=BY_ROWS)


def separable_optimizers() -> dict[str, Callable[[], Any]]:
  return {
      "adamw, a callable mask": lambda: optax.adamw(
          1e-2, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
      "rmsprop": lambda: optax.rmsprop(1e-2),
      "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
      "lamb (a norm over each leaf)": lambda: optax.lamb(1e-2),
      "clipping inside (a norm of the gradients)": lambda: optax.chain(
          optax.clip_by_global_norm(0.05), optax.adam(1e-2)),
      "adam, then clipping (a norm of the state's updates: two passes)": lambda: optax.chain(
          optax.adam(1e-2), optax.clip_by_global_norm(1e-3)),
      "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
      "masked by a tree": lambda: optax.masked(optax.adam(1e-2), {"layers": True, "b": False}),
  }


@pytest.mark.parametrize("name", sorted(separable_optimizers()))
@pytest.mark.parametrize("tree", ["stacked", "one array", "bf16, scalar, empty"])
def test_every_optimizer_streams_bit_for_bit(name: str, tree: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
  """Pieces of one leaf each (leaves of stacked layers by layers where the update computes
  each from its own): the same run as the state on the device, bit for bit (``BY_ROWS``)."""
  monkeypatch.setattr(oa.offload, "PIECE_BYTES", 1024)
  params = {"stacked": STACKED, "one array": STACKED["layers"],
            "bf16, scalar, empty": {"layers": STACKED["layers"].astype(jnp.bfloat16),
                                    "b": np.float32(2.0), "e": np.zeros((0, 3), np.float32)}}[tree]
  make = separable_optimizers()[name]
  if tree != "stacked" and name == "masked by a tree":
    make = lambda: optax.masked(optax.adam(1e-2), jax.tree.map(lambda x: np.ndim(x) > 1, params))
  with jax.set_mesh(one_device()):
    assert_bitwise(*streamed_run(make, jax.device_put(fresh(params), NamedSharding(
        one_device(), P()))), within=by_rows(params))


def test_a_value_of_the_state_of_every_leaf_streams_it_twice() -> None:
  """``chain(adam, clip_by_global_norm)`` inside: the norm of adam's updates reads every
  leaf's state, so the state comes in twice (the norm, then the update), out once."""
  tx = oa.host_state(optax.chain(optax.adam(1e-2), optax.clip_by_global_norm(1e-3)))
  jaxpr = jax.make_jaxpr(tx.update)(fresh(PARAMS), tx.init(fresh(PARAMS)), fresh(PARAMS)).jaxpr
  state = [x.size * 4 for x in jax.tree.leaves(PARAMS)] * 2  # mu and nu
  assert sorted(brought_in(jaxpr)) == sorted([4] + state * 2)


def test_the_gradient_of_the_update() -> None:
  """``jax.grad`` through ``host_state``'s update (momentum, its state a step in): the
  state on the device's, bit for bit."""
  grads, g = {}, jax.tree.map(lambda x: jnp.sin(x) * 0.1, fresh(PARAMS))
  for host in (True, False):
    tx = optax.sgd(3e-2, momentum=0.9)
    tx = oa.host_state(tx) if host else tx
    state = jax.jit(tx.update)(g, tx.init(fresh(PARAMS)), fresh(PARAMS))[1]
    loss = lambda g, tx=tx, state=state: sum(jnp.sum(jnp.sin(u)) for u in jax.tree.leaves(
        tx.update(g, state, fresh(PARAMS))[0]))
    grads[host] = jax.jit(jax.grad(loss))(g)
  assert_bitwise(grads[True], grads[False])
  assert min(float(jnp.min(jnp.abs(x))) for x in jax.tree.leaves(grads[True])) > 1e-3


def test_misused_entry_points_name_the_fix() -> None:
  """The factory for the optimizer; ``optax.MultiSteps`` around it (its conditional mixes the
  state's memory kinds): the package's own errors."""
  for inner in (optax.adam, None):
    with pytest.raises(TypeError, match=r"host_state\(optax.adam\(1e-3\)\)"):
      oa.host_state(inner)
  tx = optax.MultiSteps(oa.host_state(adam()), 2)
  with pytest.raises(TypeError, match=r"optax_accum\.MultiSteps"):
    jax.jit(tx.update)(fresh(PARAMS), tx.init(fresh(PARAMS)), fresh(PARAMS))
  tx = oa.MultiSteps(oa.host_state(adam()), 2)  # the fix it names
  state = jax.jit(tx.update)(fresh(PARAMS), tx.init(fresh(PARAMS)), fresh(PARAMS))[1]
  assert {x.sharding.memory_kind for x in jax.tree.leaves(state.inner_opt_state)} == {HOST}


def test_a_function_valued_extra_argument() -> None:
  """An extra argument that is a function (a loss, as ``sophia(obj_fn=)`` takes) is closed
  over, the arrays streamed: the same updates as on the device."""
  def scaled(inner: Any) -> optax.GradientTransformationExtraArgs:
    def update(g: Any, s: Any, p: Any = None, *, obj_fn: Any, scale: jax.Array) -> Any:
      u, s = inner.update(g, s, p)
      return jax.tree.map(lambda x: x * obj_fn(scale), u), s
    return optax.GradientTransformationExtraArgs(inner.init, update)

  outs = []
  for tx in (oa.host_state(scaled(adam())), scaled(adam())):
    update = lambda g, s, p, tx=tx: tx.update(g, s, p, obj_fn=jnp.exp, scale=jnp.float32(0.5))
    outs.append(jax.jit(update)(fresh(PARAMS), tx.init(fresh(PARAMS)), fresh(PARAMS))[0])
  assert_bitwise(*outs)


def test_an_optimizer_built_in_the_step_from_a_traced_learning_rate() -> None:
  """The update closes over a value traced in the step: an operand of the host computation
  like the gradients; the same run as on the device."""
  def make_step(host: bool) -> Callable:
    def step(p: Any, s: Any, x: jax.Array, lr: jax.Array) -> tuple[Any, Any]:
      tx = oa.host_state(optax.adam(lr)) if host else optax.adam(lr)
      updates, s = tx.update(jax.grad(loss)(p, x), s, p)
      return optax.apply_updates(p, updates), s
    return jax.jit(step)

  runs = {host: (fresh(PARAMS), (oa.host_state(adam()) if host else adam()).init(fresh(PARAMS)))
          for host in (False, True)}
  steps = {host: make_step(host) for host in runs}  # each traced once
  for i in range(3):
    runs = {host: steps[host](*run, batch(i), jnp.float32(1e-2 * (i + 1)))
            for host, run in runs.items()}
    assert_on_host(runs[True][1])
    assert_bitwise((runs[True][0], inner_of(runs[True][1])), runs[False])


def test_flax_train_state_keeps_the_state_on_the_host() -> None:
  linen = pytest.importorskip("flax.linen")
  from optax_accum.flax import TrainState

  model = linen.Dense(3)
  params = model.init(jax.random.key(0), jnp.ones((1, 8)))["params"]

  def train_step(state: Any, x: jax.Array) -> Any:
    grads = jax.grad(lambda p: jnp.mean(model.apply({"params": p}, x) ** 2))(state.params)
    return state.apply_gradients(grads=grads)

  def make(host: bool) -> Any:
    inner = adamw_clipped()
    return TrainState.create(apply_fn=model.apply, params=fresh(params), tx=oa.accumulate(
        4, oa.host_state(inner) if host else inner))

  ref, run = make(False), make(True)
  ref_step, step = jax.jit(train_step), jax.jit(train_step, donate_argnums=0)
  for i in range(5):
    ref, run = ref_step(ref, batch(i)), step(run, batch(i))
    assert_on_host(run.opt_state)
    assert_bitwise((run.params, inner_of(run.opt_state)), (ref.params, inner_of(ref.opt_state)))


def test_nnx_optimizer_keeps_the_state_on_the_host() -> None:
  nnx = pytest.importorskip("flax.nnx")
  from optax_accum.flax import Optimizer

  def run(host: bool) -> tuple[Any, Any]:
    model = nnx.Linear(8, 3, rngs=nnx.Rngs(0))
    optimizer = Optimizer(model, oa.accumulate(2, oa.host_state(adam()) if host else adam()),
                          wrt=nnx.Param)

    @nnx.jit
    def step(model: Any, optimizer: Any, x: jax.Array) -> None:
      optimizer.update(model, nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model))

    for i in range(3):
      step(model, optimizer, batch(i))
      if host:
        assert_on_host(nnx.as_pure(optimizer.opt_state))
    return nnx.as_pure(nnx.state(model)), inner_of(nnx.as_pure(optimizer.opt_state))

  assert_bitwise(run(True), run(False))


def data_mesh(n: int) -> Any:
  return jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:n])


def on_mesh(mesh: Any) -> dict[str, jax.Array]:
  return jax.device_put(fresh(PARAMS), {"w": NamedSharding(mesh, P("data")),
                                        "b": NamedSharding(mesh, P())})


def mesh_step(tx: Any) -> Callable:
  def step(p: Any, s: Any, x: jax.Array) -> tuple[Any, Any]:
    _, grads = local_value_and_grad(loss, "data")(p, x)
    return oa.update_and_apply(tx, grads, s, p)
  return step


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_on_8_devices_the_state_is_sharded_on_the_host_like_on_the_device() -> None:
  """Initialised under jit with ``state_shardings``, or by a plain ``tx.init`` (its counters
  replicated on the params' mesh, in host memory): each device streams its own shards."""
  mesh = data_mesh(8)
  ref_tx = oa.accumulate(2, adam(), axis_name="data")
  tx = oa.accumulate(2, oa.host_state(adam()), axis_name="data")
  params = on_mesh(mesh)
  state = jax.jit(tx.init, out_shardings=state_shardings(tx, params))(params)
  ref = (on_mesh(mesh), ref_tx.init(on_mesh(mesh)))
  runs = {"out_shardings": (params, state), "plain init": (on_mesh(mesh), tx.init(on_mesh(mesh)))}
  steps = {name: jax.jit(mesh_step(tx)) for name in runs}
  ref_step = jax.jit(mesh_step(ref_tx))
  x = jax.device_put(batch(0, 16), NamedSharding(mesh, P("data")))
  with jax.set_mesh(mesh):
    for i in range(3):
      ref = ref_step(*ref, x * (i + 1))
      for name, step in steps.items():
        runs[name] = step(*runs[name], x * (i + 1))
        assert_on_host(runs[name][1])
        assert_bitwise((runs[name][0], inner_of(runs[name][1])), (ref[0], inner_of(ref[1])))
        specs = [(a.sharding.spec, b.sharding.spec) for a, b in zip(
            jax.tree.leaves(inner_of(runs[name][1])), jax.tree.leaves(inner_of(ref[1])),
            strict=True)]
        assert all(a == b for a, b in specs) and (P("data", None),) * 2 in specs, specs


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_under_shard_map_equals_the_device_run_bit_for_bit() -> None:
  """The step inside ``shard_map`` (``accumulate(..., axis_name=)``, per-device state)."""
  from optax_accum.sharding import per_device_state, shard_map_specs

  mesh, runs, steps = jax.make_mesh((8,), ("data",)), {}, {}
  for host in (False, True):
    tx = per_device_state(oa.accumulate(2, oa.host_state(adam()) if host else adam(),
                                        axis_name="data"), "data")
    specs = shard_map_specs(tx, PARAMS, "data")

    def body(p: Any, s: Any, x: jax.Array, tx: Any = tx) -> tuple[Any, Any]:
      grads = jax.grad(loss)(jax.lax.pcast(p, "data", to="varying"), x)
      return oa.update_and_apply(tx, grads, s, p)

    steps[host] = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P("data")),
                                        out_specs=(P(), specs)))
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
    runs[host] = (fresh(PARAMS), init(fresh(PARAMS)))
  for i in range(5):
    x = jax.device_put(batch(i, 16), NamedSharding(mesh, P("data")))
    runs = {host: steps[host](*runs[host], x) for host in runs}
    assert_on_host(runs[True][1])
    assert_bitwise((runs[True][0], inner_of(runs[True][1])),
                   (runs[False][0], inner_of(runs[False][1])))
  assert int(runs[True][1].gradient_step) == 2


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_orbax_and_reshard_state_bring_the_state_back_to_the_host(tmp_path: Path) -> None:
  """Saved mid-window with orbax; restored into the abstract target of
  ``state_shardings``: in host memory, bit for bit, and the resumed run ends as the
  uninterrupted one. ``reshard_state``
  onto 2 devices: the inner state in host memory again, bit for bit."""
  ocp = pytest.importorskip("orbax.checkpoint")
  mesh = data_mesh(8)
  tx = oa.accumulate(4, oa.host_state(adam()), axis_name="data")
  step = jax.jit(mesh_step(tx))
  x = jax.device_put(batch(0, 16), NamedSharding(mesh, P("data")))
  run = (on_mesh(mesh), tx.init(on_mesh(mesh)))
  with jax.set_mesh(mesh):
    for i in range(6):
      run = step(*run, x * (i + 1))
      if i == 2:
        saved = run
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp_path / "ckpt", run[1])
        checkpointer.wait_until_finished()
    structs = lambda shardings: jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=s), run[1], shardings)
    for target in (structs(state_shardings(tx, run[0])), tx.init(on_mesh(mesh))):
      restored = checkpointer.restore(tmp_path / "ckpt", target)
      assert_on_host(restored)
      assert_bitwise(restored, saved[1])
      resumed = (saved[0], restored)
      for i in range(3, 6):
        resumed = step(*resumed, x * (i + 1))
        assert_on_host(resumed[1])
      assert_bitwise(resumed, run)
  like = tx.init(on_mesh(data_mesh(2)))
  moved = reshard_state(jax.device_get(saved[1]), like)
  assert_on_host(moved)
  assert_bitwise(inner_of(moved), inner_of(saved[1]))
  assert {x.sharding.mesh.size for x in jax.tree.leaves(inner_of(moved))} == {2}


@pytest.mark.catches("host_state_single_device_placement")
def test_a_restored_state_stays_home(tmp_path: Path) -> None:
  """Saved by orbax mid-window on one device, restored into either target (the state
  ``tx.init`` builds, or ``ShapeDtypeStruct`` s of ``state_shardings``), resumed: in host
  memory after every resumed step, and the run ends as the uninterrupted one, bit for bit."""
  ocp = pytest.importorskip("orbax.checkpoint")
  tx, step = across_steps(4, adam, host=True)
  run = (fresh(PARAMS), tx.init(fresh(PARAMS)))
  for i in range(6):
    run = jax.jit(step)(*run, batch(i))
    if i == 2:
      saved, checkpointer = run, ocp.StandardCheckpointer()
      checkpointer.save(tmp_path / "ckpt", run[1], force=True)
      checkpointer.wait_until_finished()
  structs = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         run[1], state_shardings(tx, run[0]))
  for target in (tx.init(fresh(PARAMS)), structs):
    resumed = (fresh(saved[0]), checkpointer.restore(tmp_path / "ckpt", target))
    assert_on_host(resumed[1])
    for i in range(3, 6):
      resumed = jax.jit(step)(*resumed, batch(i))
      assert_on_host(resumed[1])
    assert_bitwise(resumed, run)


@pytest.mark.catches("host_state_single_device_placement")
def test_ahead_of_time_compilation_from_the_state_s_own_shardings() -> None:
  """``ShapeDtypeStruct`` s with the state's own shardings (one device) are typed in host
  memory, lower, compile (``memory_analysis``) and return the state in ``pinned_host``."""
  tx = oa.host_state(adam())
  structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                         (fresh(PARAMS), tx.init(fresh(PARAMS)), batch(0, 16)))
  in_avals = jax.jit(lambda s: s).trace(structs[1]).jaxpr.in_avals
  assert {str(a.memory_space) for a in in_avals} == {"MemorySpace.Host"}, in_avals

  def make_step(k: int) -> Callable:
    def step(p: Any, x: jax.Array, s: Any) -> tuple[Any, Any]:
      updates, s = tx.update(oa.microbatched(jax.value_and_grad(loss), k)(p, x)[1], s, p)
      return optax.apply_updates(p, updates), s
    return jax.jit(step, donate_argnums=(0, 2))

  compiled = make_step(2).lower(structs[0], structs[2], structs[1]).compile()
  assert compiled.memory_analysis() is not None
  kinds = {s.memory_kind for s in jax.tree.leaves(compiled.output_shardings[1])}
  assert kinds == {HOST}, kinds
  # `eval_shape`'s structs: JAX 0.12 keeps their memory kind (they compile as the state's own);
  # JAX 0.10.2 drops it, and host_state's error names the fix.
  bare = jax.eval_shape(tx.init, fresh(PARAMS))
  if {jax.typeof(x).memory_space for x in jax.tree.leaves(bare)} == {jax.memory.Space.Host}:
    assert make_step(1).lower(structs[0], structs[2], bare).compile().memory_analysis()
  else:
    with pytest.raises(ValueError, match=r"state_shardings\(tx, params\)"):
      make_step(1).lower(structs[0], structs[2], bare)


def test_a_platform_without_host_memory_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
  class Memory:
    kind = "device"

  class Device:
    platform, device_kind = "someplatform", "Some Accelerator"

    def addressable_memories(self) -> list[Memory]:
      return [Memory()]

  monkeypatch.setattr(jax, "local_devices", lambda: [Device()])
  with pytest.raises(ValueError, match="someplatform") as raised:
    oa.host_state(adam()).init(PARAMS)
  assert f"jax {jax.__version__}" in str(raised.value) and "'device'" in str(raised.value)


@pytest.mark.catches("host_state_updates_a_device_state")
def test_a_state_in_device_memory_raises() -> None:
  """A ``host_state`` state placed in device memory (a checkpoint restored into device
  shardings, say) is refused by name, alone and inside ``accumulate``: never updated on the
  device in silence, its bytes there."""
  on_device = lambda s: jax.tree.map(
      lambda x: jax.device_put(x, x.sharding.with_memory_kind("device")), s)
  for tx in (oa.host_state(adam()), oa.accumulate(2, oa.host_state(adam()))):
    state = on_device(tx.init(fresh(PARAMS)))
    try:
      jax.jit(tx.update)(fresh(PARAMS), state, fresh(PARAMS))
      message = ""
    except ValueError as e:
      message = str(e)
    assert "`state`" in message and "device memory" in message, message
    assert "state_shardings(tx, params)" in message
    placed = jax.device_put(state, state_shardings(tx, fresh(PARAMS)))  # the fix it names
    assert_on_host(jax.jit(tx.update)(fresh(PARAMS), placed, fresh(PARAMS))[1])
