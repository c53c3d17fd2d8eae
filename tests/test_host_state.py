"""Tests of :mod:`optax_accum.offload`: the inner optimizer's state in host memory.

Every run is compared bit for bit with the same run on the device (the inner optimizer
without ``host_state``; on an accelerator within the device's rounding: ``ROUNDING``), and
after every step every leaf of the inner state must be in ``pinned_host`` and typed
there. On XLA:CPU host and device memory are one, so where the update runs and what
moves is checked where JAX decides it: in the step's jaxpr (one ``compute_on`` on the
host, ``device_put`` s to host memory of what the update reads)."""

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
from tests._reference import tolerance

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


# On XLA:CPU the host's update and the device's are one compiler's: bit for bit. On an
# accelerator the device's own optimizer rounds apart from the host's: Adam's bias corrections
# (1 - b**t) go through its exp and log, whose float32 error a TPU v5e measures at 7e-5
# (tests/_reference.py), and each later gradient carries the difference (a step's 8.8e-6 in
# a param of 1e-2 there, 5.9e-4 of the step's size). Each leaf then agrees within ten times
# that error (``tolerance``) of its largest entry: a missed, doubled or mis-scaled step of
# 3e-2 is 40x over it.
ROUNDING = None if jax.default_backend() == "cpu" else tolerance(0.0, "exp", "log")


def assert_bitwise(a: Any, b: Any) -> None:
  """Bit for bit on XLA:CPU; on an accelerator floats within ``ROUNDING`` of each leaf's size."""
  a, b = jax.device_get((a, b))
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert np.asarray(x).dtype == np.asarray(y).dtype, (x, y)
    if ROUNDING is not None and jnp.issubdtype(np.asarray(x).dtype, jnp.floating) and np.size(x):
      scale = float(np.max(np.abs(np.asarray(y, np.float64))))
      np.testing.assert_allclose(x, y, rtol=0, atol=ROUNDING * scale)
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


def eqns(jaxpr: Any, name: str, where: tuple[Any, ...] = ()) -> list[tuple[Any, Any]]:
  """``(where, eqn)`` for each equation of primitive ``name`` in ``jaxpr``, nested ones
  included; ``where`` lists the (primitive, index) of the jaxprs around it (a ``cond``'s
  branch 1 is its true branch: the emitting one)."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == name:
      found.append((where, eqn))
    for i, sub in enumerate(jax.extend.core.jaxprs_in_params(eqn.params)):
      found += eqns(sub, name, (*where, (eqn.primitive.name, i)))
  return found


def to_host(jaxpr: Any) -> list[tuple[int, ...]]:
  """The shapes each ``device_put`` of ``jaxpr`` moves, sorted; every one to host memory."""
  moves = [(e.params["devices"], v.aval.shape) for _, e in eqns(jaxpr, "device_put")
           for v in e.invars]
  assert all(d == (jax.memory.Space.Host,) for d, _ in moves), moves
  return sorted(shape for _, shape in moves)


SHAPES = sorted(np.shape(x) for x in jax.tree.leaves(PARAMS))


@pytest.mark.catches("host_state_moves_the_state_in", "host_state_on_device")
def test_the_update_runs_on_the_host_and_the_state_never_enters_the_device() -> None:
  """One program: the window's emitting branch runs on the host (one ``compute_on`` on
  values in host memory): the window's sum (the buffer, this micro-batch added on the device)
  and the params go there (and scalars: the window's counters), the window's mean, adam and
  its application run there; the new params come out on the device, the new state in host
  memory; nothing moves to the device (no parameter-sized temporary there: the mean, the
  updates)."""
  tx = oa.accumulate(4, oa.host_state(adam()))
  step = lambda p, s, g: oa.update_and_apply(tx, g, s, p)
  args = (fresh(PARAMS), tx.init(fresh(PARAMS)), fresh(PARAMS))
  jaxpr = jax.make_jaxpr(step)(*args).jaxpr
  computes = eqns(jaxpr, "compute_on")
  assert len(computes) == 1, computes
  (where, host), = computes
  assert ("cond", 1) in where and host.params["compute_type"] == "device_host"
  assert {str(v.aval.memory_space) for v in host.invars} == {"MemorySpace.Host"}
  spaces = [str(s).split(".")[1] for s in host.params["out_memory_spaces"]]
  assert spaces == ["Device"] * 2 + ["Host"] * 5  # the new params; adam's count, mu and nu
  assert [s for s in to_host(jaxpr) if s] == sorted(SHAPES * 2)  # params, the window's sum
  lowered = jax.jit(step).lower(*args)
  assert '_xla_compute_type = "host"' in lowered.as_text()
  # The compiled program keeps it: XLA:CPU marks the computation, a TPU calls it on the host.
  compiled = lowered.compile().as_text()
  assert '_xla_compute_type="host"' in compiled or 'custom_call_target="HostExecute"' in compiled


@pytest.mark.parametrize("opt", ["adam", "adamw"])
def test_the_link_carries_what_the_update_reads(opt: str) -> None:
  """A step of its own (``microbatched``, then the update): the gradients go to the host,
  and the params only where the optimizer reads them (adamw's weight decay)."""
  tx = oa.host_state(adam() if opt == "adam" else optax.adamw(3e-2, weight_decay=0.1))
  in_step = lambda p, s, x: tx.update(oa.microbatched(jax.value_and_grad(loss), 2)(p, x)[1], s, p)
  jaxpr = jax.make_jaxpr(in_step)(PARAMS, tx.init(PARAMS), batch(0)).jaxpr
  assert to_host(jaxpr) == sorted(SHAPES * (1 if opt == "adam" else 2))


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
  for i in range(3):
    runs = {host: make_step(host)(*run, batch(i), jnp.float32(1e-2 * (i + 1)))
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
  mesh = data_mesh(8)
  ref_tx = oa.accumulate(2, adam(), axis_name="data")
  tx = oa.accumulate(2, oa.host_state(adam()), axis_name="data")
  params = on_mesh(mesh)
  state = jax.jit(tx.init, out_shardings=state_shardings(tx, params))(params)
  ref = (on_mesh(mesh), ref_tx.init(on_mesh(mesh)))
  runs = {"one": (params, state)}
  steps = {"one": jax.jit(mesh_step(tx))}
  x = jax.device_put(batch(0, 16), NamedSharding(mesh, P("data")))
  with jax.set_mesh(mesh):
    for i in range(3):
      ref = jax.jit(mesh_step(ref_tx))(*ref, x * (i + 1))
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
  memory, lower, compile (``memory_analysis``) and return the state in ``pinned_host``;
  ``plan_k`` plans a step with ``host_state`` from them."""
  from optax_accum.planning import plan_k

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
  plan = plan_k(make_step, structs[0], structs[2], structs[1], memory_limit=1 << 30)
  assert plan.k == 1 and plan.peak_bytes <= 1 << 30


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


TILED = {"w": np.linspace(-1.0, 1.0, 32, dtype=np.float32).reshape(8, 4),
         "b": np.full(4, 0.1, np.float32)}


def tiled_layout(m2m: tuple[int, ...], tile: tuple[int, ...]) -> Any:
  return jax.experimental.layout.Layout(major_to_minor=m2m, tiling=(tile,))


def test_device_order_is_the_tiled_storage_order() -> None:
  """``device_ordered`` reads the elements in the order a tiled layout stores them; its
  inverse undoes it; a nested tiling or a padding tile leaves the array as it is."""
  x = jnp.arange(16 * 256, dtype=jnp.float32).reshape(16, 256)
  ordered = oa.offload.device_ordered(x, tiled_layout((0, 1), (8, 128)))
  tiles = x.reshape(2, 8, 2, 128).transpose(0, 2, 1, 3)  # T(8,128): tile by tile
  assert np.array_equal(ordered.reshape(-1), tiles.reshape(-1))
  transposed = oa.offload.device_ordered(x, tiled_layout((1, 0), (8, 8)))  # dim 1 major
  assert np.array_equal(transposed.reshape(-1), x.T.reshape(32, 8, 2, 8).transpose(
      0, 2, 1, 3).reshape(-1))
  for layout in (tiled_layout((0, 1), (8, 128)), tiled_layout((1, 0), (8, 8)),
                 tiled_layout((0,), (128,))):
    y = x if len(layout.major_to_minor) == 2 else x.reshape(-1)
    assert np.array_equal(oa.offload.device_ordered(oa.offload.device_ordered(
        y, layout), layout, inverse=True), y)
  nested = jax.experimental.layout.Layout((0, 1), tiling=((8, 128), (2, 1)))
  for layout in (nested, tiled_layout((0, 1), (16, 512))):
    assert oa.offload.device_ordered(x, layout) is x


@pytest.mark.parametrize("apply", [False, True])
def test_what_returns_to_the_device_leaves_the_host_in_its_order(
    apply: bool, monkeypatch: pytest.MonkeyPatch) -> None:
  """Compiled for a device whose layouts are tiled and transposed (as a TPU's are), the host
  stores what it returns (the new params, or the updates: parked in the buffer) in that
  order and the device reads it back: the run still equals the device run bit for bit."""
  real, seen = jax.experimental.layout.Layout.from_pjrt_layout, []

  def tiled(pjrt_layout: Any) -> Any:
    layout = real(pjrt_layout)
    seen.append(layout)
    return tiled_layout(layout.major_to_minor[::-1], (2,) * min(2, len(layout.major_to_minor)))
  monkeypatch.setattr(oa.offload.Layout, "from_pjrt_layout", tiled)
  run, ref = ((oa.accumulate(2, oa.host_state(adam()) if host else adam()), fresh(TILED))
              for host in (True, False))
  step = lambda tx: jax.jit(lambda p, s, g: oa.update_and_apply(tx, g, s, p) if apply else (
      optax.apply_updates(p, tx.update(g, s, p)[0]), tx.update(g, s, p)[1]))
  runs, steps = [(p, tx.init(p)) for tx, p in (run, ref)], [step(tx) for tx, _ in (run, ref)]
  for i in range(4):
    g = {name: x * (i + 1.0) for name, x in fresh(TILED).items()}
    runs = [f(*r, g) for f, r in zip(steps, runs, strict=True)]
    assert_on_host(runs[0][1])
    assert_bitwise(runs[0][0], runs[1][0])
  assert seen  # the lowering asked for the device's layouts
