"""The init / update / train-step idioms of public JAX training code.

Each test names the pattern it copies and runs it against an independent
reference: SGD with momentum (scale-sensitive: a gradient summed instead of
averaged, or reduced twice, changes the result) stepped once per window on the
window's whole batch, on one device, with no optax_accum code. A regression of
the kind a new user hits (an idiom that plain JAX accepts and we reject) fails
here instead of in a user's script. ``tests/conftest.py`` forces 8 host devices.
"""

from __future__ import annotations

import ast
import importlib
import re
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum as oa
from optax_accum.debug import hlo_collectives
from optax_accum.sharding import local_value_and_grad, per_device_state, shard_map_specs

N_DEV = 8
K = 2  # micro-batches per window
WINDOWS = 2
ROWS = 16  # examples per micro-batch, over all devices
D_IN, D_HID, D_OUT = 4, 8, 2
LR, MOMENTUM = 0.2, 0.9

pytestmark = pytest.mark.skipif(
    jax.device_count() < N_DEV,
    reason="needs 8 devices: run through pytest so tests/conftest.py sets XLA_FLAGS")


def sgd() -> optax.GradientTransformation:
  return optax.sgd(LR, momentum=MOMENTUM)


def init_params(seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {
      "w1": (rng.normal(size=(D_IN, D_HID)) / 2).astype(np.float32),
      "b1": (0.1 * rng.normal(size=D_HID)).astype(np.float32),
      "w2": (rng.normal(size=(D_HID, D_OUT)) / 3).astype(np.float32),
      "b2": (0.1 * rng.normal(size=D_OUT)).astype(np.float32),
  }


def mlp(params: Any, x: jax.Array) -> jax.Array:
  """An unmodified model: bias adds, no sharding annotations."""
  return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean((mlp(params, x) - y) ** 2)


def make_data(seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """``(K * WINDOWS, ROWS, ...)`` inputs and targets: one row of micro-batches per call."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(K * WINDOWS, ROWS, D_IN)).astype(np.float32)
  y = rng.normal(size=(K * WINDOWS, ROWS, D_OUT)).astype(np.float32)
  return x, y


def reference(params: Any, data: tuple[np.ndarray, np.ndarray],
              loss_fn: Callable[..., jax.Array] = loss) -> Any:
  """SGD+momentum once per window on the window's K * ROWS examples, one device."""
  x, y = data
  opt = sgd()
  p = jax.tree.map(jnp.asarray, params)
  state = opt.init(p)
  for w in range(WINDOWS):
    xs = x[w * K:(w + 1) * K].reshape(-1, D_IN)
    ys = y[w * K:(w + 1) * K].reshape(-1, D_OUT)
    updates, state = opt.update(jax.grad(loss_fn)(p, xs, ys), state, p)
    p = optax.apply_updates(p, updates)
  return p


def assert_close(actual: Any, expected: Any) -> None:
  chex.assert_trees_all_close(jax.tree.map(np.asarray, actual),
                              jax.tree.map(np.asarray, expected), rtol=2e-5, atol=2e-6)


def data_mesh(axis_types: tuple[AxisType, ...] = (AxisType.Explicit,)) -> jax.sharding.Mesh:
  return jax.make_mesh((N_DEV,), ("data",), axis_types=axis_types)


def emitting_only(compiled: Any) -> bool:
  """No gradient reduction outside accumulate's emitting branch (the cond's branch 1)."""
  reductions = [c for c in hlo_collectives(compiled)
                if c.op in ("all-reduce", "all-reduce-start", "reduce-scatter")]
  return bool(reductions) and all(c.context[:1] == (("conditional", 1),) for c in reductions)


# --- pmap -------------------------------------------------------------------------------------


def replicate(tree: Any) -> Any:
  """flax.jax_utils.replicate: one copy per local device on a leading axis."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (N_DEV, *jnp.shape(x))), tree)


def per_device(rows: np.ndarray) -> np.ndarray:
  """One micro-batch's rows split over the devices on a leading axis (pmap's layout)."""
  return rows.reshape(N_DEV, ROWS // N_DEV, -1)


def pmap_train(tx: optax.GradientTransformation, *, init_mapped: bool) -> Any:
  """The pmap idiom: ``jax.pmap(tx.init)(replicated)`` (or init once, then replicate)."""
  params = replicate(jax.tree.map(jnp.asarray, init_params()))
  if init_mapped:
    state = jax.pmap(tx.init)(params)  # init is mapped without naming the axis
  else:
    state = replicate(tx.init(jax.tree.map(jnp.asarray, init_params())))

  @partial(jax.pmap, axis_name="batch")
  def step(params: Any, state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any]:
    grads = jax.grad(loss)(params, x, y)  # per device: its own rows, reduced once per window
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  x, y = make_data()
  for i in range(K * WINDOWS):
    params, state = step(params, state, per_device(x[i]), per_device(y[i]))
  return jax.tree.map(lambda a: a[0], params), state


@pytest.mark.parametrize("init_mapped", [True, False], ids=["pmap(init)", "replicate(init)"])
def test_pmap_init_idiom_equals_large_batch(init_mapped: bool) -> None:
  """flax/examples/imagenet: ``state = jax.pmap(tx.init)(replicate(params))``; the train
  step is pmapped with ``axis_name``."""
  tx = oa.accumulate(K, sgd(), axis_name="batch")
  params, state = pmap_train(tx, init_mapped=init_mapped)
  assert int(state.gradient_step[0]) == WINDOWS
  # The per-device mean over 2 rows, averaged over 8 devices: the window's mean.
  assert_close(params, reference(init_params(), make_data()))


def test_pmap_init_idiom_multisteps_equals_large_batch() -> None:
  """The same idiom with the optax.MultiSteps drop-in (gradients pmean'd by the user)."""
  tx = oa.MultiSteps(sgd(), K)
  params = replicate(jax.tree.map(jnp.asarray, init_params()))
  state = jax.pmap(tx.init)(params)

  @partial(jax.pmap, axis_name="batch")
  def step(params: Any, state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any]:
    grads = jax.lax.pmean(jax.grad(loss)(params, x, y), "batch")
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  x, y = make_data()
  for i in range(K * WINDOWS):
    params, state = step(params, state, per_device(x[i]), per_device(y[i]))
  assert_close(jax.tree.map(lambda a: a[0], params), reference(init_params(), make_data()))


@pytest.mark.parametrize("make_tx", [
    lambda: oa.accumulate(K, sgd(), axis_name="batch", reduction="weighted"),
    lambda: per_device_state(oa.accumulate(K, sgd(), axis_name="batch"), "batch"),
], ids=["weighted", "per_device_state"])
def test_pmap_init_needs_no_bound_axis(make_tx: Callable[[], Any]) -> None:
  """``jax.pmap(tx.init)`` for the other transforms that take ``axis_name``."""
  tx = make_tx()
  params = replicate(jax.tree.map(jnp.asarray, init_params()))
  state = jax.pmap(tx.init)(params)
  assert state.acc_grads["w1"].shape[0] == N_DEV
  assert not np.any(np.asarray(state.acc_grads["w1"]))


# --- shard_map --------------------------------------------------------------------------------


def test_shard_map_idiom_equals_large_batch() -> None:
  """jax docs, "Distributed arrays and automatic parallelization": a train step in
  ``jax.shard_map`` over ``Mesh(devices, ("data",))`` with a per-device buffer
  (``per_device_state``)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:N_DEV]), ("data",))
  tx = per_device_state(oa.accumulate(K, sgd(), axis_name="data"), "data")
  params = jax.tree.map(jnp.asarray, init_params())
  specs = shard_map_specs(tx, params, "data")
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

  @jax.jit
  @partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
           out_specs=(P(), specs))
  def step(params: Any, state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any]:
    local = jax.lax.pcast(params, "data", to="varying")
    grads = jax.grad(loss)(local, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  x, y = make_data()
  for i in range(K * WINDOWS):
    params, state = step(params, state, x[i], y[i])
  assert_close(params, reference(init_params(), make_data()))


# --- jit with NamedSharding inputs ------------------------------------------------------------


@pytest.mark.parametrize("set_mesh", [False, True], ids=["no set_mesh", "set_mesh"])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_jit_named_sharding_microbatched_equals_full_batch(set_mesh: bool,
                                                           axis_type: AxisType) -> None:
  """The pjit idiom: ``device_put(x, NamedSharding(mesh, P("data")))`` and
  ``jax.jit(oa.microbatched(vg, 4))(params, x)``, with or without ``jax.set_mesh``."""
  mesh = data_mesh((axis_type,))
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  params = put(init_params(), P())
  x, y = make_data()
  xs, ys = put(x.reshape(-1, D_IN), P("data")), put(y.reshape(-1, D_OUT), P("data"))
  vg = jax.value_and_grad(loss)
  if set_mesh:
    with jax.set_mesh(mesh):
      value, grads = jax.jit(oa.microbatched(vg, 4, batch_argnums=(1, 2)))(params, xs, ys)
  else:
    value, grads = jax.jit(oa.microbatched(vg, 4, batch_argnums=(1, 2)))(params, xs, ys)
  ref_value, ref_grads = vg(jax.tree.map(jnp.asarray, init_params()),
                            x.reshape(-1, D_IN), y.reshape(-1, D_OUT))
  assert_close((value, grads), (ref_value, ref_grads))


@pytest.mark.parametrize("set_mesh", [False, True], ids=["no set_mesh", "set_mesh"])
def test_jit_local_value_and_grad_unmodified_model_equals_large_batch(set_mesh: bool) -> None:
  """The pjit idiom across steps: an unmodified model (bias adds) under plain jit,
  ``local_value_and_grad`` + ``accumulate(k, opt, axis_name="data")``; one gradient
  reduction per window, inside the emitting branch."""
  mesh = data_mesh()
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  tx = oa.accumulate(K, sgd(), axis_name="data")
  grad_fn = local_value_and_grad(loss, "data", batch_argnums=(1, 2))

  @jax.jit
  def step(params: Any, state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any]:
    _, grads = grad_fn(params, x, y)
    return oa.update_and_apply(tx, grads, state, params)

  def run() -> tuple[Any, Any]:
    params = put(init_params(), P())
    state = tx.init(params)
    x, y = make_data()
    assert emitting_only(step.lower(params, state, put(x[0], P("data")),
                                    put(y[0], P("data"))).compile())
    for i in range(K * WINDOWS):
      params, state = step(params, state, put(x[i], P("data")), put(y[i], P("data")))
    return params, state

  if set_mesh:
    with jax.set_mesh(mesh):
      params, state = run()
  else:
    params, state = run()
  assert int(state.gradient_step) == WINDOWS
  assert_close(params, reference(init_params(), make_data()))


# --- Flax -------------------------------------------------------------------------------------


def test_linen_train_state_unmodified_model_under_plain_jit_equals_large_batch() -> None:
  """flax/examples (Linen): ``TrainState.create(apply_fn=model.apply, params=..., tx=...)``
  and ``state.apply_gradients(grads=grads)``; unmodified ``nn.Dense`` layers on an
  Explicit mesh, gradients from ``local_value_and_grad``."""
  nn = pytest.importorskip("flax.linen")
  train_state = pytest.importorskip("flax.training.train_state")

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
      return nn.Dense(D_OUT)(jnp.tanh(nn.Dense(D_HID)(x)))

  model = MLP()
  mesh = data_mesh()
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, D_IN)))
  linen_loss = lambda p, x, y: jnp.mean((model.apply(p, x) - y) ** 2)
  grad_fn = local_value_and_grad(linen_loss, "data", batch_argnums=(1, 2))
  state = train_state.TrainState.create(
      apply_fn=model.apply, params=put(variables, P()),
      tx=oa.accumulate(K, sgd(), axis_name="data"))

  @jax.jit
  def step(state: Any, x: jax.Array, y: jax.Array) -> Any:
    _, grads = grad_fn(state.params, x, y)
    return state.apply_gradients(grads=grads)

  x, y = make_data()
  for i in range(K * WINDOWS):
    state = step(state, put(x[i], P("data")), put(y[i], P("data")))
  assert_close(state.params, reference(variables, make_data(), linen_loss))


def test_nnx_optimizer_unmodified_model_under_plain_jit_equals_large_batch() -> None:
  """flax NNX: ``nnx.Optimizer(model, tx, wrt=nnx.Param)``, ``optimizer.update(model,
  grads)`` in an ``nnx.jit`` step; unmodified ``nnx.Linear`` layers, params placed on an
  Explicit mesh, gradients of the split state from ``local_value_and_grad``."""
  nnx = pytest.importorskip("flax.nnx")

  class MLP(nnx.Module):
    def __init__(self, rngs: Any):
      self.l1 = nnx.Linear(D_IN, D_HID, rngs=rngs)
      self.l2 = nnx.Linear(D_HID, D_OUT, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
      return self.l2(jnp.tanh(self.l1(x)))

  mesh = data_mesh()
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  model = MLP(nnx.Rngs(0))
  graphdef, start = nnx.split(model, nnx.Param)
  start = jax.tree.map(np.asarray, start)
  nnx.update(model, put(start, P()))
  optimizer = nnx.Optimizer(model, oa.accumulate(K, sgd(), axis_name="data"), wrt=nnx.Param)
  nnx_loss = lambda state, x, y: jnp.mean((nnx.merge(graphdef, state)(x) - y) ** 2)
  grad_fn = local_value_and_grad(nnx_loss, "data", batch_argnums=(1, 2))

  @nnx.jit
  def step(model: Any, optimizer: Any, x: jax.Array, y: jax.Array) -> None:
    _, grads = grad_fn(nnx.state(model, nnx.Param), x, y)
    optimizer.update(model, grads)

  x, y = make_data()
  for i in range(K * WINDOWS):
    step(model, optimizer, put(x[i], P("data")), put(y[i], P("data")))
  assert_close(nnx.state(model, nnx.Param), reference(start, make_data(), nnx_loss))


# --- Equinox ----------------------------------------------------------------------------------


def _eqx_model() -> Any:
  eqx = pytest.importorskip("equinox")
  return eqx, eqx.nn.MLP(D_IN, D_OUT, D_HID, 1, key=jax.random.PRNGKey(0))


def _eqx_loss(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean((jax.vmap(model)(x) - y) ** 2)


@pytest.mark.parametrize("jit", ["eqx.filter_jit", "jax.jit of the arrays"])
def test_equinox_module_in_microbatched_equals_full_batch(jit: str) -> None:
  """equinox docs: ``eqx.filter_value_and_grad(loss)(model, x, y)`` with an ``eqx.nn.MLP``
  (its activations are non-array leaves), wrapped by ``microbatched`` under
  ``eqx.filter_jit``, or under ``jax.jit`` with ``eqx.partition``."""
  eqx, model = _eqx_model()
  x, y = (a.reshape(-1, a.shape[-1]) for a in make_data())
  vg = eqx.filter_value_and_grad(_eqx_loss)
  wrapped = oa.microbatched(vg, 4, batch_argnums=(1, 2))
  if jit == "eqx.filter_jit":
    value, grads = eqx.filter_jit(wrapped)(model, x, y)
  else:
    arrays, static = eqx.partition(model, eqx.is_array)
    value, grads = jax.jit(lambda a, x, y: wrapped(eqx.combine(a, static), x, y))(arrays, x, y)
  ref_value, ref_grads = vg(model, x, y)
  assert_close((value, eqx.filter(grads, eqx.is_array)),
               (ref_value, eqx.filter(ref_grads, eqx.is_array)))


def test_equinox_static_fields_and_filter_accumulate_equals_large_batch() -> None:
  """equinox #590/#853: ``tx.init(eqx.filter(model, eqx.is_array))`` and
  ``eqx.apply_updates``; a module with a static field, trained with accumulate."""
  eqx, _ = _eqx_model()

  class Affine(eqx.Module):
    w: jax.Array
    b: jax.Array
    name: str = eqx.field(static=True)

    def __call__(self, x: jax.Array) -> jax.Array:
      return x @ self.w + self.b

  params = init_params()
  model = Affine(jnp.asarray(params["w1"][:, :D_OUT]), jnp.asarray(params["b2"]), "affine")
  tx = oa.accumulate(K, sgd())
  state = tx.init(eqx.filter(model, eqx.is_array))
  eqx_loss = lambda m, x, y: jnp.mean((m(x) - y) ** 2)

  @eqx.filter_jit
  def step(model: Any, state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any]:
    grads = eqx.filter_grad(eqx_loss)(model, x, y)
    updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), state

  x, y = make_data()
  for i in range(K * WINDOWS):
    model, state = step(model, state, x[i], y[i])
  assert model.name == "affine"
  expected = reference({"w": model.w * 0 + params["w1"][:, :D_OUT], "b": params["b2"]},
                       make_data(), lambda p, x, y: jnp.mean((x @ p["w"] + p["b"] - y) ** 2))
  assert_close({"w": model.w, "b": model.b}, expected)


def test_integer_leaves_count_as_zero_gradients() -> None:
  """``jax.grad(loss, allow_int=True)`` gives float0 cotangents for integer leaves (a
  step counter, an Equinox integer field): accumulate and MultiSteps train the other
  leaves as the large batch does and leave the integer one as it is; microbatched, which
  must sum them, names the leaf and the fix."""
  params = {"w": jnp.ones(3), "count": jnp.asarray(3)}
  loss_fn = lambda p, x: jnp.sum(p["w"] * x.sum() * p["count"])
  xs = [jnp.full((4, 1), float(i + 1)) for i in range(K)]
  whole = jax.grad(loss_fn, allow_int=True)(params, jnp.concatenate(xs))
  expected = params["w"] - 0.1 * whole["w"] / K  # the large batch's mean gradient
  for tx in (oa.accumulate(K, optax.sgd(0.1)), oa.MultiSteps(optax.sgd(0.1), K)):
    p, state = params, tx.init(params)
    for x in xs:
      grads = jax.grad(loss_fn, allow_int=True)(p, x)
      assert grads["count"].dtype == jax.dtypes.float0
      updates, state = jax.jit(tx.update)(grads, state, p)
      p = optax.apply_updates(p, updates)
    np.testing.assert_allclose(p["w"], expected, rtol=1e-6)
    assert p["count"].dtype == params["count"].dtype and int(p["count"]) == 3
  vg = oa.microbatched(jax.value_and_grad(loss_fn, allow_int=True), 2)
  with pytest.raises(TypeError, match=r"\['count'\] has dtype float0.*eqx.partition"):
    vg(params, jnp.ones((4, 1)))


# --- checkpointing ----------------------------------------------------------------------------


def test_orbax_restore_into_an_abstract_target_mid_window(tmp_path: Path) -> None:
  """orbax docs: ``restore(path, jax.eval_shape(tx.init, params))``: restored into the
  abstract target one micro-batch into a window, the run finishes like the large batch."""
  ocp = pytest.importorskip("orbax.checkpoint")
  tx = oa.accumulate(K, sgd())
  step = jax.jit(lambda p, s, x, y: oa.update_and_apply(tx, jax.grad(loss)(p, x, y), s, p))
  x, y = make_data()
  params = jax.tree.map(jnp.asarray, init_params())
  state = tx.init(params)
  for i in range(K + 1):
    params, state = step(params, state, x[i], y[i])
  assert int(state.mini_step) == 1
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
  checkpointer.wait_until_finished()
  target = jax.eval_shape(lambda p: {"params": p, "opt_state": tx.init(p)}, params)
  restored = checkpointer.restore(tmp_path / "ckpt", target)
  params, state = restored["params"], restored["opt_state"]
  assert isinstance(state, oa.AccumulateState) and int(state.mini_step) == 1
  for i in range(K + 1, K * WINDOWS):
    params, state = step(params, state, x[i], y[i])
  assert_close(params, reference(init_params(), make_data()))


# --- error messages -----------------------------------------------------------------------


def _raised_texts(tree: ast.AST) -> list[str]:
  """The string parts of every ``raise`` and ``warnings.warn`` message in a module."""
  texts = []
  for node in ast.walk(tree):
    call = node.exc if isinstance(node, ast.Raise) else node
    if isinstance(node, ast.Raise) or (
        isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "warn"):
      texts += [n.value for n in ast.walk(call)
                if isinstance(n, ast.Constant) and isinstance(n.value, str)]
  return texts


def test_error_messages_name_only_public_names_that_exist() -> None:
  """A fix an error names is one the user can call: public, present, not deprecated."""
  package = Path(oa.__file__).parent
  named = set()
  for module in package.glob("*.py"):
    text = " ".join(_raised_texts(ast.parse(module.read_text())))
    named |= {m.group(1) for m in re.finditer(r"\b(optax_accum(?:\.\w+)+|oa(?:\.\w+)+)", text)}
  assert "optax_accum.sharding.reshard_state" in named  # the scan sees the messages
  for dotted in sorted(named):
    parts = dotted.replace("oa.", "optax_accum.", 1).split(".")
    assert not any(p.startswith("_") for p in parts), dotted
    with warnings.catch_warnings():
      warnings.simplefilter("error", DeprecationWarning)  # no deprecated alias
      obj = importlib.import_module(parts[0])
      for i, part in enumerate(parts[1:], 1):
        try:
          obj = getattr(obj, part)
        except AttributeError:
          obj = importlib.import_module(".".join(parts[: i + 1]))
    assert obj is not None, dotted


# Deprecated spellings (optax_accum/__init__.py's _MOVED, microbatched's 0.2 options), as a
# page or docstring would write them.
_DEPRECATED = re.compile(
    r"\b(?:oa|optax_accum)\.(?:" + "|".join(oa._MOVED) + r")\b"
    r"|\bsplit\s*=\s*[\"']contiguous[\"']|\b(?:rng_mode|unroll)\s*="
    r"|microbatched\([^)]*\baccumulator_dtype\s*=")
# History is not advice: the changelogs record what was current then.
_HISTORY = ("CHANGELOG.md", "docs/changelog.md", "docs/development/changes.md")


def _paragraphs(text: str) -> list[str]:
  """Blank-line separated paragraphs; a table's rows one by one."""
  paragraphs = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
  return [unit for p in paragraphs
          for unit in (p.splitlines() if p.lstrip().startswith("|") else [p])]


def _docstrings(path: Path) -> list[str]:
  nodes = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(
      n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
  return [d for d in (ast.get_docstring(n) for n in nodes) if d]


def test_pages_and_docstrings_present_no_deprecated_name_as_current() -> None:
  """A deprecated name appears only in a paragraph that says it is deprecated."""
  root = Path(oa.__file__).parents[1]
  texts = {str(p.relative_to(root)): [p.read_text()] for p in sorted(root.glob("docs/**/*.md"))}
  texts["README.md"] = [(root / "README.md").read_text()]
  for module in sorted(Path(oa.__file__).parent.glob("*.py")):
    texts[str(module.relative_to(root))] = _docstrings(module)
  found = [f"{where}: {match.group(0)!r} in {paragraph.strip()[:120]!r}"
           for where, docs in texts.items() if where not in _HISTORY
           for text in docs for paragraph in _paragraphs(text)
           for match in [_DEPRECATED.search(paragraph)]
           if match and "deprecat" not in paragraph.lower()]
  assert len(texts) > 40 and all(_DEPRECATED.search(t) for t in (  # what the scan reads
      "{class}`~optax_accum.AuxRule`", "oa.per_device_state(tx)", 'split="contiguous"',
      "microbatched(fn, 4, accumulator_dtype=jnp.float32)"))
  assert not found, "deprecated names presented as current:\n" + "\n".join(found)
