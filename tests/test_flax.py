"""Tests of :mod:`optax_accum.flax`: the Linen ``TrainState`` and the NNX ``Optimizer``.

Every numerical test compares against the independent large-batch reference of
``tests/_reference.py``: the plain optimizer stepped once per window on the
mean (or weighted mean) of the window's micro-batch gradients, taken at the
window's starting params. SGD with momentum makes a wrong divisor visible;
Adam makes a wrong step count visible. Each test runs the same body on both
integrations through a small driver (``_LinenRun`` / ``_NnxRun``).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum as oa
from tests._reference import assert_trees_close, large_batch_run, make_batches, mean_tree

linen = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
flax_train_state = pytest.importorskip("flax.training.train_state")

from optax_accum.flax import Optimizer, TrainState  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
K = 3
Batch = tuple[jax.Array, jax.Array]


def _momentum() -> optax.GradientTransformation:
  return optax.sgd(0.1, momentum=0.9)


def _adam() -> optax.GradientTransformation:
  return optax.adam(3e-2)


OPTIMIZERS = {"sgd_momentum": _momentum, "adam": _adam}


def _windows(seed: int, sizes: Sequence[int]) -> list[list[Batch]]:
  """Windows of ``sizes[i]`` micro-batches (x [4, 5], y [4, 3]) each."""
  batches = make_batches(jax.random.key(seed), sum(sizes))
  bounds = np.cumsum([0, *sizes])
  return [batches[a:b] for a, b in itertools.pairwise(bounds)]


def _weighted_large_batch(
    optimizer: optax.GradientTransformation, params: Any, windows: Sequence[Sequence[Batch]],
    weights: Sequence[Sequence[float]], grad: Callable[[Any, Batch], Any],
) -> list[Any]:
  """Params after each window: one step on the weighted mean gradient."""
  state = optimizer.init(params)
  history = []
  for window, window_weights in zip(windows, weights, strict=True):
    grads = [grad(params, b) for b in window]
    mean = jax.tree.map(lambda m, g: jnp.asarray(m, g.dtype),
                        mean_tree(grads, window_weights), grads[0])
    updates, state = optimizer.update(mean, state, params)
    params = optax.apply_updates(params, updates)
    history.append(params)
  return history


# ----------------------------------------------------------------------------- Linen

class _LinenMLP(linen.Module):
  @linen.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return linen.Dense(3)(jnp.tanh(linen.Dense(8)(x)))


_LINEN = _LinenMLP()


def _linen_loss(params: Any, batch: Batch) -> jax.Array:
  x, y = batch
  return jnp.mean((_LINEN.apply({"params": params}, x) - y) ** 2)


@jax.jit
def _linen_step(state: Any, batch: Batch, **kwargs: Any) -> Any:
  return state.apply_gradients(grads=jax.grad(_linen_loss)(state.params, batch), **kwargs)


class _LinenRun:
  """A Linen train state stepped one micro-batch at a time."""

  grad = staticmethod(jax.jit(jax.grad(_linen_loss)))

  def __init__(self, tx: Any, cls: type = TrainState) -> None:
    self.state = cls.create(apply_fn=_LINEN.apply, params=self.init_params(), tx=tx)

  @staticmethod
  def init_params() -> Any:
    return _LINEN.init(jax.random.key(0), jnp.zeros((1, 5)))["params"]

  def step(self, batch: Batch, **kwargs: Any) -> None:
    self.state = _linen_step(self.state, batch, **kwargs)

  def params(self) -> Any:
    return self.state.params

  def opt_state(self) -> Any:
    return self.state.opt_state

  def steps(self) -> int:
    return int(self.state.step)


# ----------------------------------------------------------------------------- NNX

class _NnxMLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs) -> None:
    self.l1 = nnx.Linear(5, 8, rngs=rngs)
    self.l2 = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.l2(jnp.tanh(self.l1(x)))


def _nnx_loss(model: _NnxMLP, batch: Batch) -> jax.Array:
  x, y = batch
  return jnp.mean((model(x) - y) ** 2)


@nnx.jit
def _nnx_step(model: _NnxMLP, optimizer: Any, batch: Batch, **kwargs: Any) -> None:
  optimizer.update(model, nnx.grad(_nnx_loss)(model, batch), **kwargs)


_NNX_GRAPHDEF, _ = nnx.split(_NnxMLP(nnx.Rngs(0)))


class _NnxRun:
  """An NNX model and optimizer stepped one micro-batch at a time."""

  grad = staticmethod(jax.jit(jax.grad(
      lambda params, batch: _nnx_loss(nnx.merge(_NNX_GRAPHDEF, params), batch))))

  def __init__(self, tx: Any, cls: type = Optimizer) -> None:
    self.model = _NnxMLP(nnx.Rngs(0))
    self.optimizer = cls(self.model, tx, wrt=nnx.Param)

  @staticmethod
  def init_params() -> Any:
    return nnx.as_pure(nnx.state(_NnxMLP(nnx.Rngs(0)), nnx.Param))

  def step(self, batch: Batch, **kwargs: Any) -> None:
    _nnx_step(self.model, self.optimizer, batch, **kwargs)

  def params(self) -> Any:
    return nnx.as_pure(nnx.state(self.model, nnx.Param))

  def opt_state(self) -> Any:
    return nnx.as_pure(self.optimizer.opt_state)

  def steps(self) -> int:
    return int(self.optimizer.step[...])


RUNS = {"linen": _LinenRun, "nnx": _NnxRun}


def _snapshot(tree: Any) -> Any:
  return jax.tree.map(np.array, tree)


# ----------------------------------------------------------------------------- large batch

@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("run_name", sorted(RUNS))
def test_equals_large_batch_over_several_windows(run_name: str, opt_name: str):
  run_cls, make_opt = RUNS[run_name], OPTIMIZERS[opt_name]
  windows = _windows(1, [K] * 3)
  expected = large_batch_run(make_opt(), run_cls.init_params(), windows, grad=run_cls.grad)
  run = run_cls(oa.accumulate(K, make_opt()))
  for w, window in enumerate(windows):
    for i, batch in enumerate(window):
      before = _snapshot(run.params())
      run.step(batch)
      closed = i == K - 1
      assert bool(oa.has_updated(run.opt_state())) == closed
      if not closed:
        chex.assert_trees_all_equal(run.params(), before)  # mid-step: nothing moves
    assert_trees_close(run.params(), expected[w])
  assert run.steps() == 3 * K  # `step` counts micro-batches, as in the base classes
  assert int(run.opt_state().gradient_step) == 3


@pytest.mark.parametrize("run_name", sorted(RUNS))
def test_weighted_windows_equal_the_weighted_large_batch(run_name: str):
  run_cls = RUNS[run_name]
  windows = _windows(2, [K, K])
  weights = [[1.0, 4.0, 0.5], [2.0, 0.0, 3.0]]  # a zero weight drops its micro-batch
  expected = _weighted_large_batch(
      _momentum(), run_cls.init_params(), windows, weights, run_cls.grad)
  run = run_cls(oa.accumulate(K, _momentum(), reduction="weighted"))
  for w, (window, window_weights) in enumerate(zip(windows, weights, strict=True)):
    for batch, weight in zip(window, window_weights, strict=True):
      run.step(batch, weight=jnp.float32(weight))
    assert_trees_close(run.params(), expected[w])
  # Guard: the unweighted mean would differ.
  unweighted = large_batch_run(_momentum(), run_cls.init_params(), windows, grad=run_cls.grad)
  assert not np.allclose(jax.tree.leaves(run.params())[0], jax.tree.leaves(unweighted[-1])[0],
                         atol=1e-5)


@pytest.mark.parametrize("run_name", sorted(RUNS))
def test_emit_now_flushes_a_partial_window(run_name: str):
  run_cls = RUNS[run_name]
  windows = _windows(3, [K, 2, K])  # the middle window is cut short by emit_now
  expected = large_batch_run(_momentum(), run_cls.init_params(), windows, grad=run_cls.grad)
  run = run_cls(oa.accumulate(K, _momentum()))
  for w, window in enumerate(windows):
    for i, batch in enumerate(window):
      run.step(batch, emit_now=w == 1 and i == len(window) - 1)
    assert int(run.opt_state().mini_step) == 0
    assert int(run.opt_state().gradient_step) == w + 1
    assert_trees_close(run.params(), expected[w])


# ----------------------------------------------------------------------------- other tx kinds

TX_KINDS: dict[str, Callable[[], tuple[Any, optax.GradientTransformation]]] = {
    # name: () -> (accumulating tx, the equivalent large-batch optimizer)
    "multi_steps": lambda: (oa.MultiSteps(_momentum(), every_k_schedule=K), _momentum()),
    "multi_steps_gradient_transformation": lambda: (
        oa.MultiSteps(_momentum(), every_k_schedule=K).gradient_transformation(), _momentum()),
    "chain_ending_in_accumulate": lambda: (
        optax.chain(optax.scale(2.0), oa.accumulate(K, _momentum())),
        optax.chain(optax.scale(2.0), _momentum())),
}


@pytest.mark.parametrize("kind", sorted(TX_KINDS))
@pytest.mark.parametrize("run_name", sorted(RUNS))
def test_other_accumulating_tx_kinds_equal_large_batch(run_name: str, kind: str):
  """Needs the core's ``update_and_apply`` for any accumulating tx."""
  run_cls = RUNS[run_name]
  tx, reference = TX_KINDS[kind]()
  windows = _windows(4, [K, K])
  expected = large_batch_run(reference, run_cls.init_params(), windows, grad=run_cls.grad)
  run = run_cls(tx)
  for w, window in enumerate(windows):
    for i, batch in enumerate(window):
      before = _snapshot(run.params())
      run.step(batch)
      assert bool(oa.has_updated(run.opt_state())) == (i == K - 1)
      if i < K - 1:
        chex.assert_trees_all_equal(run.params(), before)
    assert_trees_close(run.params(), expected[w])


@pytest.mark.parametrize("run_name", sorted(RUNS))
def test_non_accumulating_tx_behaves_exactly_like_the_base_class(run_name: str):
  """Needs the core's ``update_and_apply`` fallback for a plain tx."""
  run_cls = RUNS[run_name]
  base_cls = flax_train_state.TrainState if run_name == "linen" else nnx.Optimizer
  ours, base = run_cls(optax.adam(3e-2)), run_cls(optax.adam(3e-2), cls=base_cls)
  for batch in _windows(5, [4])[0]:
    ours.step(batch)
    base.step(batch)
    chex.assert_trees_all_equal(ours.params(), base.params())
    chex.assert_trees_all_equal(ours.opt_state(), base.opt_state())
  assert ours.steps() == base.steps() == 4


# ----------------------------------------------------------------------------- Linen details

class _MemMLP(linen.Module):
  @linen.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return linen.Dense(256)(jnp.tanh(linen.Dense(512)(x)))


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_linen_mid_step_has_no_parameter_sized_temporaries(opt_name: str):
  """``apply_gradients`` jitted with the state donated, on a ~1 MiB model.

  The gradients are an input, so the measurement is the update alone (the
  backward pass needs its own temporaries either way). Ours passes the
  params through the window's cond. (The base class with ``oa.accumulate``
  has none either, since the updates ride in the buffer, but it rewrites the
  params on every mid-step; with ``optax.MultiSteps`` it holds several times
  the param bytes on XLA:CPU, which keeps this measurement live.)
  """
  model = _MemMLP()
  params = model.init(jax.random.key(0), jnp.zeros((1, 256)))["params"]
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  assert 0.9 * 2**20 < param_bytes < 1.1 * 2**20
  grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
  step = jax.jit(lambda state, g: state.apply_gradients(grads=g), donate_argnums=0)

  def state_of(cls: type, tx: Any = None) -> Any:
    return cls.create(apply_fn=model.apply, params=params,
                      tx=tx or oa.accumulate(4, OPTIMIZERS[opt_name]()))

  ours = step.lower(state_of(TrainState), grads).compile().memory_analysis()
  assert ours.temp_size_in_bytes <= 0.05 * param_bytes
  if jax.default_backend() == "cpu":  # the measurement is live
    optax_ms = state_of(flax_train_state.TrainState, optax.MultiSteps(OPTIMIZERS[opt_name](), 4))
    base = step.lower(optax_ms, grads).compile().memory_analysis()
    assert base.temp_size_in_bytes >= 0.9 * param_bytes
  # Params, buffer and the inner optimizer's state are all updated in place.
  inner_trees = 1 if opt_name == "sgd_momentum" else 2
  assert ours.alias_size_in_bytes >= (2 + inner_trees) * param_bytes

  state = state_of(TrainState)
  before = _snapshot(state.params)
  for _ in range(3):  # mid-steps: the params are the same values
    state = step(state, grads)
    chex.assert_trees_all_equal(state.params, before)
  state = step(state, grads)
  assert not np.array_equal(state.params["Dense_0"]["kernel"], before["Dense_0"]["kernel"])


class _MemNnx(nnx.Module):
  def __init__(self, rngs: nnx.Rngs) -> None:
    self.l1 = nnx.Linear(256, 512, rngs=rngs)
    self.l2 = nnx.Linear(512, 256, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.l2(jnp.tanh(self.l1(x)))


def test_nnx_update_has_no_parameter_sized_temporaries():
  """``update`` in a jitted functional step (split/merge) with the state donated.

  The base class with ``oa.accumulate`` has no temporaries either (the
  updates ride in the buffer) but rewrites the params on every mid-step;
  with ``optax.MultiSteps`` it holds about the param bytes on XLA:CPU, which
  keeps the measurement live.
  """
  def temps(cls: type, tx: Any = None) -> float:
    model = _MemNnx(nnx.Rngs(0))
    optimizer = cls(model, tx or oa.accumulate(4, _momentum()), wrt=nnx.Param)
    params = nnx.state(model, nnx.Param)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
    graphdef, state = nnx.split((model, optimizer))

    def step(state: Any, grads: Any) -> Any:
      model, optimizer = nnx.merge(graphdef, state)
      optimizer.update(model, grads)
      return nnx.state((model, optimizer))

    compiled = jax.jit(step, donate_argnums=0).lower(state, grads).compile()
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    return compiled.memory_analysis().temp_size_in_bytes / param_bytes

  assert temps(Optimizer) <= 0.05
  if jax.default_backend() == "cpu":
    assert temps(nnx.Optimizer, optax.MultiSteps(_momentum(), 4)) >= 0.9


def test_linen_apply_gradients_replaces_kwargs_and_overwrite_with_gradient():
  """Mirrors the base class: extra fields are replaced, fp8 OWG entries copied."""
  owg = "_overwrite_with_gradient"

  class StateWithStats(TrainState):
    batch_stats: Any = None

  inner = _LinenRun.init_params()
  params = {"params": inner, owg: {"scale": jnp.ones(2)}}
  state = StateWithStats.create(apply_fn=_LINEN.apply, params=params,
                                tx=oa.accumulate(2, optax.sgd(1.0)), batch_stats=0)
  grads = {"params": jax.tree.map(jnp.ones_like, inner), owg: {"scale": jnp.full(2, 7.0)}}
  for i in range(2):
    state = state.apply_gradients(grads=grads, batch_stats=i + 1)
    assert state.batch_stats == i + 1
    chex.assert_trees_all_equal(state.params[owg], grads[owg])
  # One SGD step on the mean gradient (ones), on the optimised part only.
  assert_trees_close(state.params["params"], jax.tree.map(lambda p: p - 1.0, inner))
  assert int(state.step) == 2


def test_nnx_update_returns_none():
  """The updates tree is never built; the base class's return value is not mirrored."""
  run = _NnxRun(oa.accumulate(2, _momentum()))
  batch = _windows(6, [1])[0][0]
  assert run.optimizer.update(run.model, nnx.grad(_nnx_loss)(run.model, batch)) is None


# ----------------------------------------------------------------------------- imports

def _python(code: str) -> subprocess.CompletedProcess[str]:
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        cwd=ROOT, timeout=300, check=False)


@pytest.fixture(scope="module")
def imports() -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
  """One fresh process for both import tests (a process imports jax in 2 CPU-seconds): what
  ``import optax_accum`` loaded, then, Flax made missing, what ``import optax_accum.flax``
  raised."""
  proc = _python(
      "import json, sys, optax_accum\n"
      "out = {'loaded': sorted(m for m in ('flax', 'matplotlib', 'tqdm') if m in sys.modules)}\n"
      "sys.modules['flax'] = None  # as if Flax were not installed\n"
      "try:\n"
      "  import optax_accum.flax\n"
      "except ImportError as e:\n"
      "  out['error'] = str(e)\n"
      "print(json.dumps(out))\n")
  return proc, (json.loads(proc.stdout.splitlines()[-1]) if proc.returncode == 0 else {})


def test_import_optax_accum_imports_no_optional_dependency(imports):
  proc, out = imports
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert out["loaded"] == []


def test_missing_flax_raises_an_import_error_naming_the_extra(imports):
  proc, out = imports
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "pip install 'optax_accum[flax]'" in out.get("error", "")
