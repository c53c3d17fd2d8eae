"""Integration tests: Flax NNX, Flax Linen, Equinox, checkpointing, logging, epoch ends.

Every test compares against an independent large-batch reference: the plain
optimizer stepped once on the whole window's batch (the concatenation of its
micro-batches), never against ``accumulate`` itself. SGD with momentum is used
where the gradient's scale must matter (Adam is nearly scale-invariant, so it
would hide a sum-vs-mean bug); Adam and schedules are used where step counts
must matter (bias correction, learning-rate decay).
"""

from __future__ import annotations

import functools
import os
import runpy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum as oa

K = 3
MICRO_BS = 4
IN_DIM = 5
RTOL = 1e-5
ATOL = 1e-6
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _data(n_micro: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """``n_micro`` micro-batches of a small regression problem: x [n, b, d], y [n, b, 1]."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n_micro, MICRO_BS, IN_DIM)).astype(np.float32)
  w = rng.normal(size=(IN_DIM, 1)).astype(np.float32)
  y = (np.tanh(x @ w) + 0.1 * rng.normal(size=(n_micro, MICRO_BS, 1))).astype(np.float32)
  return x, y


def _window(x: np.ndarray, y: np.ndarray, start: int, stop: int) -> tuple[jax.Array, jax.Array]:
  """The large batch made of micro-batches ``start:stop``."""
  return (jnp.asarray(x[start:stop].reshape(-1, IN_DIM)),
          jnp.asarray(y[start:stop].reshape(-1, 1)))


def _assert_trees_close(a: Any, b: Any, rtol: float = RTOL, atol: float = ATOL) -> None:
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _assert_trees_equal(a: Any, b: Any) -> None:
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert np.asarray(x).dtype == np.asarray(y).dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _momentum() -> optax.GradientTransformation:
  return optax.sgd(0.1, momentum=0.9)


# ----------------------------------------------------------------------------- plain-JAX model

def _init_params(seed: int = 1) -> dict[str, jax.Array]:
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {
      "w1": 0.5 * jax.random.normal(k1, (IN_DIM, 8)),
      "b1": jnp.zeros(8),
      "w2": 0.5 * jax.random.normal(k2, (8, 1)),
  }


def _loss(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] - y) ** 2)


def _make_step(tx: optax.GradientTransformation) -> Callable[..., Any]:
  @jax.jit
  def step(params, opt_state, x, y):
    grads = jax.grad(_loss)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return step


def _reference_run(tx: optax.GradientTransformation, params: Any, x: np.ndarray,
                   y: np.ndarray, windows: list[tuple[int, int]]) -> Any:
  """The plain optimizer, one step per window on the window's whole batch."""
  step = _make_step(tx)
  state = tx.init(params)
  for start, stop in windows:
    params, state = step(params, state, *_window(x, y, start, stop))
  return params


# ----------------------------------------------------------------------------- Flax NNX

nnx = pytest.importorskip("flax.nnx")


class _NnxMLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs) -> None:
    self.l1 = nnx.Linear(IN_DIM, 8, rngs=rngs)
    self.l2 = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.l2(jnp.tanh(self.l1(x)))


def _nnx_loss(model: _NnxMLP, x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean((model(x) - y) ** 2)


@nnx.jit
def _nnx_train_step(model: _NnxMLP, optimizer: Any, x: jax.Array, y: jax.Array) -> jax.Array:
  loss, grads = nnx.value_and_grad(_nnx_loss)(model, x, y)
  optimizer.update(model, grads)
  return loss


def _nnx_params(model: Any) -> Any:
  return jax.tree.map(jnp.array, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_nnx_optimizer_moves_params_once_per_window_and_equals_large_batch():
  x, y = _data(2 * K)
  model = _NnxMLP(nnx.Rngs(0))
  ref = nnx.clone(model)
  optimizer = nnx.Optimizer(model, oa.accumulate(K, _momentum()), wrt=nnx.Param)
  ref_opt = nnx.Optimizer(ref, _momentum(), wrt=nnx.Param)

  for window in range(2):
    before = _nnx_params(model)
    for i in range(window * K, (window + 1) * K):
      _nnx_train_step(model, optimizer, jnp.asarray(x[i]), jnp.asarray(y[i]))
      updated = bool(oa.has_updated(nnx.as_pure(optimizer.opt_state)))
      assert updated == (i % K == K - 1)
      if not updated:  # mid-window: the parameters have not moved
        _assert_trees_equal(_nnx_params(model), before)
    _nnx_train_step(ref, ref_opt, *_window(x, y, window * K, (window + 1) * K))
    _assert_trees_close(_nnx_params(model), _nnx_params(ref))
    assert not np.allclose(np.asarray(jax.tree.leaves(_nnx_params(model))[0]),
                           np.asarray(jax.tree.leaves(before)[0]))

  # nnx.Optimizer.step counts `update` calls (micro-batches); the optimizer
  # steps are the accumulate state's gradient_step.
  assert int(optimizer.step[...]) == 2 * K
  assert int(optimizer.opt_state.gradient_step[...]) == 2
  assert int(ref_opt.step[...]) == 2


@pytest.mark.parametrize(
    "make_tx, windows, seed",
    [
        # A schedule that changes every optimizer step must see window counts.
        (lambda: optax.sgd(lambda count: 0.2 / (1.0 + count)), 3, 3),
        (lambda: optax.adam(1e-2), 2, 4),
    ],
    ids=["sgd_schedule", "adam"],
)
def test_nnx_inner_optimizer_counts_windows(make_tx, windows, seed):
  x, y = _data(windows * K, seed=seed)
  model = _NnxMLP(nnx.Rngs(seed - 2))
  ref = nnx.clone(model)
  optimizer = nnx.Optimizer(model, oa.accumulate(K, make_tx()), wrt=nnx.Param)
  ref_opt = nnx.Optimizer(ref, make_tx(), wrt=nnx.Param)
  for i in range(windows * K):
    _nnx_train_step(model, optimizer, jnp.asarray(x[i]), jnp.asarray(y[i]))
  for w in range(windows):
    _nnx_train_step(ref, ref_opt, *_window(x, y, w * K, (w + 1) * K))
  _assert_trees_close(_nnx_params(model), _nnx_params(ref))
  inner = nnx.as_pure(optimizer.opt_state).inner_opt_state
  assert int(optax.tree_utils.tree_get(inner, "count")) == windows


def test_nnx_update_forwards_weight_and_emit_now():
  """Token-weighted micro-batches of unequal size, flushed early, through nnx.Optimizer."""
  sizes = [1, 4, 2]  # the third call flushes a window of k=4 after 3 micro-batches
  rng = np.random.default_rng(12)
  xs = [rng.normal(size=(n, IN_DIM)).astype(np.float32) for n in sizes]
  ys = [rng.normal(size=(n, 1)).astype(np.float32) for n in sizes]
  model = _NnxMLP(nnx.Rngs(3))
  ref = nnx.clone(model)
  tx = oa.accumulate(4, _momentum(), reduction="weighted")
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  grad_fn = nnx.jit(nnx.grad(_nnx_loss))  # a program per size, not an eager compile per op
  for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
    grads = grad_fn(model, jnp.asarray(x), jnp.asarray(y))
    optimizer.update(model, grads, weight=jnp.float32(len(x)), emit_now=i == len(xs) - 1)
  assert int(optimizer.opt_state.gradient_step[...]) == 1
  # The mean over all 7 examples, one step of the plain optimizer.
  ref_opt = nnx.Optimizer(ref, _momentum(), wrt=nnx.Param)
  _nnx_train_step(ref, ref_opt, jnp.asarray(np.concatenate(xs)), jnp.asarray(np.concatenate(ys)))
  _assert_trees_close(_nnx_params(model), _nnx_params(ref))


# ----------------------------------------------------------------------------- Flax Linen

def test_linen_train_state_equals_large_batch():
  linen = pytest.importorskip("flax.linen")
  train_state = pytest.importorskip("flax.training.train_state")

  class MLP(linen.Module):
    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
      return linen.Dense(1)(jnp.tanh(linen.Dense(8)(x)))

  model = MLP()
  x, y = _data(3 * K, seed=5)
  params = model.init(jax.random.key(0), jnp.zeros((1, IN_DIM)))["params"]

  def loss_fn(params, x, y):
    return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

  @jax.jit
  def train_step(state, x, y):
    grads = jax.grad(loss_fn)(state.params, x, y)
    return state.apply_gradients(grads=grads)

  state = train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=oa.accumulate(K, _momentum()))
  ref = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=_momentum())
  for w in range(3):
    before = state.params
    for i in range(w * K, (w + 1) * K):
      state = train_step(state, jnp.asarray(x[i]), jnp.asarray(y[i]))
      if i % K != K - 1:
        _assert_trees_equal(state.params, before)
    ref = train_step(ref, *_window(x, y, w * K, (w + 1) * K))
    _assert_trees_close(state.params, ref.params)
  assert int(state.opt_state.gradient_step) == 3  # TrainState.step counts micro-steps
  assert int(state.step) == 3 * K


# ----------------------------------------------------------------------------- Equinox

def test_equinox_filtered_params_equal_large_batch():
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.MLP(IN_DIM, 1, width_size=8, depth=1, activation=jnp.tanh,
                     key=jax.random.key(0))
  x, y = _data(2 * K, seed=6)

  def loss_fn(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)

  def make_step(tx):
    @eqx.filter_jit
    def step(model, opt_state, x, y):
      grads = eqx.filter_grad(loss_fn)(model, x, y)
      updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
      return eqx.apply_updates(model, updates), opt_state
    return step

  tx = oa.accumulate(K, _momentum())
  ref_tx = _momentum()
  step, ref_step = make_step(tx), make_step(ref_tx)
  acc_model, ref_model = model, model
  state = tx.init(eqx.filter(model, eqx.is_array))
  ref_state = ref_tx.init(eqx.filter(model, eqx.is_array))
  for w in range(2):
    before = eqx.filter(acc_model, eqx.is_array)
    for i in range(w * K, (w + 1) * K):
      acc_model, state = step(acc_model, state, jnp.asarray(x[i]), jnp.asarray(y[i]))
      if i % K != K - 1:
        _assert_trees_equal(eqx.filter(acc_model, eqx.is_array), before)
    ref_model, ref_state = ref_step(ref_model, ref_state, *_window(x, y, w * K, (w + 1) * K))
    _assert_trees_close(eqx.filter(acc_model, eqx.is_array),
                        eqx.filter(ref_model, eqx.is_array))
  assert int(state.gradient_step) == 2


@pytest.mark.parametrize("reduction", ["mean", "weighted"])
def test_equinox_update_and_apply_recipe_equals_large_batch(reduction: str):
  """The README recipe: eqx.partition, jit with donation, oa.update_and_apply.

  "weighted" feeds micro-batches of unequal sizes with weight = their size:
  the window's step is then the plain optimizer's on the concatenated batch.
  """
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.MLP(IN_DIM, 1, width_size=8, depth=1, activation=jnp.tanh,
                     key=jax.random.key(1))
  params, static = eqx.partition(model, eqx.is_array)
  sizes = [MICRO_BS] * K if reduction == "mean" else [1, 5, 2]
  rng = np.random.default_rng(13)
  xs = [rng.normal(size=(2, n, IN_DIM)).astype(np.float32) for n in sizes]  # 2 windows
  ys = [rng.normal(size=(2, n, 1)).astype(np.float32) for n in sizes]

  def loss_fn(params, x, y):
    return jnp.mean((jax.vmap(eqx.combine(params, static))(x) - y) ** 2)

  tx = oa.accumulate(K, _momentum(), reduction=reduction)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, x, y, **kwargs):
    grads = jax.grad(loss_fn)(params, x, y)
    return oa.update_and_apply(tx, grads, opt_state, params, **kwargs)

  ref_tx = _momentum()
  ref_params = jax.tree.map(jnp.copy, params)  # `step` donates `params`
  ref_state = ref_tx.init(ref_params)
  state = tx.init(params)
  for w in range(2):
    before = jax.tree.map(np.array, params)
    for i, n in enumerate(sizes):
      kwargs = {"weight": jnp.float32(n)} if reduction == "weighted" else {}
      params, state = step(params, state, jnp.asarray(xs[i][w]), jnp.asarray(ys[i][w]), **kwargs)
      if i < K - 1:
        _assert_trees_equal(params, before)
    x = jnp.asarray(np.concatenate([xs[i][w] for i in range(K)]))
    y = jnp.asarray(np.concatenate([ys[i][w] for i in range(K)]))
    updates, ref_state = ref_tx.update(jax.grad(loss_fn)(ref_params, x, y), ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, updates)
    _assert_trees_close(params, ref_params)
  assert int(state.gradient_step) == 2


# ----------------------------------------------------------------------------- checkpointing

def _run(step: Callable[..., Any], params: Any, state: Any, x: np.ndarray, y: np.ndarray,
         start: int, stop: int) -> tuple[Any, Any]:
  for i in range(start, stop):
    params, state = step(params, state, jnp.asarray(x[i]), jnp.asarray(y[i]))
  return params, state


def _checkpoint_setup() -> tuple[Any, Callable[..., Any], Any, np.ndarray, np.ndarray]:
  tx = oa.accumulate(K, optax.adam(3e-2))
  x, y = _data(3 * K, seed=7)
  return tx, _make_step(tx), _init_params(), x, y


def test_uninterrupted_run_equals_large_batch_reference():
  tx, step, params, x, y = _checkpoint_setup()
  full, _ = _run(step, params, tx.init(params), x, y, 0, 3 * K)
  ref = _reference_run(optax.adam(3e-2), params, x, y, [(0, K), (K, 2 * K), (2 * K, 3 * K)])
  _assert_trees_close(full, ref)


def test_orbax_save_restore_mid_window_resumes_exactly(tmp_path: Path):
  ocp = pytest.importorskip("orbax.checkpoint")
  tx, step, params, x, y = _checkpoint_setup()
  uninterrupted, final_state = _run(step, params, tx.init(params), x, y, 0, 3 * K)

  stop = K + 1  # one micro-batch into the second window
  p, s = _run(step, params, tx.init(params), x, y, 0, stop)
  assert int(s.mini_step) == 1 and not np.all(np.asarray(s.acc_grads["w1"]) == 0)
  path = tmp_path / "ckpt"
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, {"params": p, "opt_state": s})
  checkpointer.wait_until_finished()
  del p, s

  # A fresh process would rebuild the target from `init`, not from the saved run.
  fresh_state = tx.init(params)
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                        {"params": params, "opt_state": fresh_state})
  restored = checkpointer.restore(path, target)
  assert isinstance(restored["opt_state"], oa.AccumulateState)
  assert int(restored["opt_state"].mini_step) == 1
  p, s = _run(step, restored["params"], restored["opt_state"], x, y, stop, 3 * K)
  _assert_trees_equal(p, uninterrupted)
  _assert_trees_equal(s, final_state)


def test_numpy_round_trip_mid_window_resumes_exactly(tmp_path: Path):
  tx, step, params, x, y = _checkpoint_setup()
  uninterrupted, final_state = _run(step, params, tx.init(params), x, y, 0, 3 * K)

  stop = 2 * K - 1
  p, s = _run(step, params, tx.init(params), x, y, 0, stop)
  leaves = jax.tree.leaves(jax.tree.map(np.asarray, {"params": p, "opt_state": s}))
  np.savez(tmp_path / "ckpt.npz", *leaves)
  del p, s

  treedef = jax.tree.structure({"params": params, "opt_state": tx.init(params)})
  with np.load(tmp_path / "ckpt.npz") as f:
    loaded = [jnp.asarray(f[f"arr_{i}"]) for i in range(len(f.files))]
  restored = jax.tree.unflatten(treedef, loaded)
  assert int(restored["opt_state"].mini_step) == K - 1
  p, s = _run(step, restored["params"], restored["opt_state"], x, y, stop, 3 * K)
  _assert_trees_equal(p, uninterrupted)
  _assert_trees_equal(s, final_state)


def test_restarting_without_the_buffer_would_differ():
  """Guards the two resume tests: dropping the mid-window buffer changes the result."""
  tx, step, params, x, y = _checkpoint_setup()
  uninterrupted, _ = _run(step, params, tx.init(params), x, y, 0, 3 * K)
  p, s = _run(step, params, tx.init(params), x, y, 0, K + 1)
  lost = s._replace(mini_step=jnp.zeros_like(s.mini_step),
                    acc_grads=jax.tree.map(jnp.zeros_like, s.acc_grads))
  p, _ = _run(step, p, lost, x, y, K + 1, 3 * K)
  assert not np.allclose(np.asarray(p["w1"]), np.asarray(uninterrupted["w1"]), atol=1e-6)


# ----------------------------------------------------------------------------- has_updated logging

def test_has_updated_logs_only_on_update_steps():
  tx = oa.accumulate(K, _momentum())
  x, y = _data(3 * K, seed=8)
  params = _init_params()

  @jax.jit
  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(_loss)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  state = tx.init(params)
  log: list[tuple[int, int, float]] = []
  window_losses: list[float] = []
  for i in range(3 * K):
    params, state, loss = step(params, state, jnp.asarray(x[i]), jnp.asarray(y[i]))
    window_losses.append(float(loss))
    if oa.has_updated(state):
      log.append((i, int(state.gradient_step), float(np.mean(window_losses))))
      window_losses = []
  assert [(i, g) for i, g, _ in log] == [(K - 1, 1), (2 * K - 1, 2), (3 * K - 1, 3)]
  # The logged loss is the large-batch loss of each window, at the window's params.
  ref_params = _init_params()
  ref_step = _make_step(_momentum())
  ref_state = _momentum().init(ref_params)
  for w, (_, _, logged) in enumerate(log):
    xb, yb = _window(x, y, w * K, (w + 1) * K)
    np.testing.assert_allclose(logged, float(_loss(ref_params, xb, yb)), rtol=1e-5)
    ref_params, ref_state = ref_step(ref_params, ref_state, xb, yb)


def test_has_updated_finds_the_state_inside_a_chain():
  tx = optax.chain(oa.accumulate(2, None), optax.sgd(0.1))
  params = _init_params()
  state = tx.init(params)
  flags = []
  for _ in range(4):
    _, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    flags.append(bool(oa.has_updated(state)))
  assert flags == [False, True, False, True]


# ----------------------------------------------------------------------- epoch-end partial window

N_MICRO = 2 * K + 2  # an epoch: two full windows and a partial one of 2 micro-batches


def _flushing_step(tx: optax.GradientTransformation) -> Callable[..., Any]:
  @jax.jit
  def step(params, opt_state, x, y, flush):
    grads = jax.grad(_loss)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params, emit_now=flush)
    return optax.apply_updates(params, updates), opt_state
  return step


def test_epoch_end_flush_equals_large_batch_on_the_partial_window():
  tx = oa.accumulate(K, _momentum())
  step = _flushing_step(tx)
  x, y = _data(N_MICRO, seed=9)
  params0 = _init_params()
  params, state = params0, tx.init(params0)
  for i in range(N_MICRO):
    last = i == N_MICRO - 1
    params, state = step(params, state, jnp.asarray(x[i]), jnp.asarray(y[i]), jnp.asarray(last))
  assert int(state.gradient_step) == 3 and int(state.mini_step) == 0
  assert bool(oa.has_updated(state))
  # The partial window's step uses the mean over its 2 micro-batches.
  ref = _reference_run(_momentum(), params0, x, y, [(0, K), (K, 2 * K), (2 * K, N_MICRO)])
  _assert_trees_close(params, ref)
  # Not equal to dropping the partial window.
  dropped = _reference_run(_momentum(), params0, x, y, [(0, K), (K, 2 * K)])
  assert not np.allclose(np.asarray(params["w1"]), np.asarray(dropped["w1"]), atol=1e-6)


def test_epoch_end_carry_over_keeps_the_partial_sums():
  tx = oa.accumulate(K, _momentum())
  step = _flushing_step(tx)
  x1, y1 = _data(N_MICRO, seed=10)
  x2, y2 = _data(N_MICRO, seed=11)
  params0 = _init_params()
  params, state = params0, tx.init(params0)
  no = jnp.asarray(False)
  for i in range(N_MICRO):
    params, state = step(params, state, jnp.asarray(x1[i]), jnp.asarray(y1[i]), no)
  # End of epoch 1: the two last micro-batches wait in the buffer (their sum).
  assert int(state.mini_step) == 2 and int(state.gradient_step) == 2
  expected = jax.tree.map(
      lambda a, b: a + b,
      jax.grad(_loss)(params, jnp.asarray(x1[-2]), jnp.asarray(y1[-2])),
      jax.grad(_loss)(params, jnp.asarray(x1[-1]), jnp.asarray(y1[-1])))
  _assert_trees_close(state.acc_grads, expected)
  for i in range(N_MICRO):
    params, state = step(params, state, jnp.asarray(x2[i]), jnp.asarray(y2[i]), no)
  # Epochs 1+2 as one stream: 16 micro-batches = 5 windows + 1 waiting.
  x, y = np.concatenate([x1, x2]), np.concatenate([y1, y2])
  windows = [(w * K, (w + 1) * K) for w in range(2 * N_MICRO // K)]
  ref = _reference_run(_momentum(), params0, x, y, windows)
  _assert_trees_close(params, ref)
  assert int(state.mini_step) == 2 * N_MICRO % K


# ----------------------------------------------------------------------------- examples

@pytest.mark.parametrize(
    "script", ["flax_nnx.py", "flax_linen.py", "equinox_example.py", "checkpoint_resume.py"])
def test_example_scripts_run(script: str, capsys: pytest.CaptureFixture[str]):
  if script == "equinox_example.py":
    pytest.importorskip("equinox")
  if script == "checkpoint_resume.py":
    pytest.importorskip("orbax.checkpoint")
  path = EXAMPLES / script
  assert path.exists(), f"missing {path}"
  cwd = os.getcwd()
  try:
    runpy.run_path(str(path), run_name="__main__")  # each script asserts its own claim
  finally:
    os.chdir(cwd)
  assert "OK" in capsys.readouterr().out
