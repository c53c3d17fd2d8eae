"""BatchNorm with accumulation: what the running statistics and the gradient are.

A tiny net ``Dense(3 -> 4) -> BatchNorm -> tanh -> Dense(4 -> 1)`` in Flax
Linen (``oa.flax.TrainState`` with ``batch_stats``) and NNX
(``oa.flax.Optimizer(wrt=nnx.Param)``), a batch of 16 in ``K = 4``
micro-batches of 4 (micro-batch ``i`` holds rows ``i, i + K, ...``, the split
``microbatched`` makes), two ways:

* across steps: ``accumulate(K, sgd)``, one jitted step per micro-batch, the
  batch statistics updated by every micro-batch;
* inside one step: ``microbatched`` with the new statistics as aux (rule
  ``"mean"``) and a plain ``sgd``.

After one window (the params do not move inside it, so every micro-batch sees
the initial params), the running statistics are pinned to formulas computed
here in numpy float64 from ``h = x @ W + b`` (Flax stores the *biased* batch
variance, ``np.var``):

* across steps, one EMA update per micro-batch: ``r <- m r + (1 - m) stat_i``
  for ``i = 1..K``;
* inside one step, one update with the micro-batches' mean statistics:
  ``r <- m r + (1 - m) mean_i(stat_i)``. The aux rule averages the ``K``
  *updated* running statistics, which is this because the update is affine.
  Its mean is the whole batch's; its variance is the mean within-micro-batch
  variance, not the whole batch's.

The gradient is pinned to "ghost batch norm": the mean of the per-micro-batch
gradients, each normalised with its own micro-batch's statistics (the Flax
loss vmapped over the micro-batches, no optax_accum), and shown to differ
from the whole batch's gradient by a clear margin. Training then continues
on the same batch for a few windows and the loss must fall every window.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum as oa

linen = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

from optax_accum.flax import Optimizer, TrainState  # noqa: E402

K, B, MOMENTUM, LR, WINDOWS = 4, 16, 0.9, 0.2, 8
Batch = tuple[jax.Array, jax.Array]


def _batches() -> list[Batch]:
  """One batch of 16, every window: inputs off-centre and unevenly scaled, so BatchNorm matters."""
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (B, 3)) * jnp.array([1.0, 2.0, 0.5]) + jnp.array([1.0, -1.0, 0.5])
  y = jnp.sin(x @ jax.random.normal(kw, (3, 1)))
  return [(x, y)] * WINDOWS


def _micro(batch: Batch, i: int) -> Batch:
  """Rows ``i, i + K, ...``, cut on the host (an eager slice compiles per ``i``)."""
  return jax.tree.map(lambda a: np.asarray(a)[i::K], batch)


def _mse(pred: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean((pred - y) ** 2)


# ----------------------------------------------------------------------------- Linen

class _LinenNet(linen.Module):
  @linen.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    h = linen.BatchNorm(use_running_average=not train, momentum=MOMENTUM)(linen.Dense(4)(x))
    return linen.Dense(1)(jnp.tanh(h))


_LINEN = _LinenNet()


class _BNState(TrainState):
  batch_stats: Any


def _linen_loss(params: Any, batch: Batch, stats: Any) -> tuple[jax.Array, Any]:
  """The loss in training mode and the updated statistics (Flax's own pattern)."""
  x, y = batch
  out, updates = _LINEN.apply({"params": params, "batch_stats": stats}, x, train=True,
                              mutable=["batch_stats"])
  return _mse(out, y), updates["batch_stats"]


_linen_vg = jax.value_and_grad(_linen_loss, has_aux=True)


@jax.jit
def _linen_micro_step(state: _BNState, batch: Batch) -> tuple[_BNState, jax.Array]:
  (loss, stats), grads = _linen_vg(state.params, batch, state.batch_stats)
  return state.apply_gradients(grads=grads, batch_stats=stats), loss


class _Linen:
  loss = staticmethod(_linen_loss)

  @staticmethod
  def init() -> tuple[Any, Any]:
    variables = _LINEN.init(jax.random.key(1), jnp.zeros((1, 3)), train=False)
    return variables["params"], variables["batch_stats"]

  @staticmethod
  def first_layer(params: Any) -> tuple[np.ndarray, np.ndarray]:
    return params["Dense_0"]["kernel"], params["Dense_0"]["bias"]

  @staticmethod
  def running(stats: Any) -> tuple[np.ndarray, np.ndarray]:
    return stats["BatchNorm_0"]["mean"], stats["BatchNorm_0"]["var"]

  @classmethod
  def across_steps(cls, tx: Any, batches: list[Batch]) -> tuple[list, list]:
    """One jitted ``apply_gradients`` per micro-batch; (params, stats) per window, losses."""
    params, stats = cls.init()
    state = _BNState.create(apply_fn=_LINEN.apply, params=params, batch_stats=stats, tx=tx)
    windows, losses = [], []
    for batch in batches:
      for i in range(K):
        state, loss = _linen_micro_step(state, _micro(batch, i))
        losses.append(float(loss))
      windows.append((state.params, state.batch_stats))
    return windows, losses

  @classmethod
  def in_one_step(cls, tx: Any, batches: list[Batch]) -> tuple[list, list]:
    """One jitted step per batch, ``microbatched`` inside, the statistics as aux."""
    params, stats = cls.init()
    state = _BNState.create(apply_fn=_LINEN.apply, params=params, batch_stats=stats, tx=tx)
    fn = oa.microbatched(_linen_vg, K, has_aux=True, aux_rules="mean")

    @jax.jit
    def step(state: _BNState, batch: Batch) -> tuple[_BNState, jax.Array]:
      (loss, stats), grads = fn(state.params, batch, state.batch_stats)
      return state.apply_gradients(grads=grads, batch_stats=stats), loss

    windows, losses = [], []
    for batch in batches:
      state, loss = step(state, batch)
      windows.append((state.params, state.batch_stats))
      losses.append(float(loss))
    return windows, losses


# ----------------------------------------------------------------------------- NNX

class _NnxNet(nnx.Module):
  def __init__(self, rngs: nnx.Rngs) -> None:
    self.l1 = nnx.Linear(3, 4, rngs=rngs)
    self.bn = nnx.BatchNorm(4, momentum=MOMENTUM, rngs=rngs)
    self.l2 = nnx.Linear(4, 1, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.l2(jnp.tanh(self.bn(self.l1(x))))


_NNX_GRAPHDEF = nnx.graphdef(_NnxNet(nnx.Rngs(1)))


def _nnx_loss(params: Any, batch: Batch, stats: Any) -> tuple[jax.Array, Any]:
  """The pure form: params and statistics in, the loss and the updated statistics out."""
  model = nnx.merge(_NNX_GRAPHDEF, params, stats)
  x, y = batch
  loss = _mse(model(x), y)
  return loss, nnx.state(model, nnx.BatchStat)


@nnx.jit
def _nnx_micro_step(model: _NnxNet, optimizer: Optimizer, batch: Batch) -> jax.Array:
  x, y = batch
  loss, grads = nnx.value_and_grad(lambda m: _mse(m(x), y))(model)  # updates model.bn in place
  optimizer.update(model, grads)
  return loss


def _nnx_pure(model: _NnxNet) -> tuple[Any, Any]:
  """The params and the statistics, as ``nnx.State``s (``optimizer.update`` takes the former's
  gradient)."""
  return nnx.state(model, nnx.Param), nnx.state(model, nnx.BatchStat)


class _Nnx:
  loss = staticmethod(_nnx_loss)

  @staticmethod
  def init() -> tuple[Any, Any]:
    return nnx.as_pure(_nnx_pure(_NnxNet(nnx.Rngs(1))))  # arrays: no Variable outlives a trace

  @staticmethod
  def first_layer(params: Any) -> tuple[np.ndarray, np.ndarray]:
    return params["l1"]["kernel"], params["l1"]["bias"]

  @staticmethod
  def running(stats: Any) -> tuple[np.ndarray, np.ndarray]:
    return stats["bn"]["mean"], stats["bn"]["var"]

  @staticmethod
  def across_steps(tx: Any, batches: list[Batch]) -> tuple[list, list]:
    model = _NnxNet(nnx.Rngs(1))
    optimizer = Optimizer(model, tx, wrt=nnx.Param)
    windows, losses = [], []
    for batch in batches:
      for i in range(K):
        losses.append(float(_nnx_micro_step(model, optimizer, _micro(batch, i))))
      windows.append(nnx.as_pure(_nnx_pure(model)))  # a snapshot: Variables are references
    return windows, losses

  @staticmethod
  def in_one_step(tx: Any, batches: list[Batch]) -> tuple[list, list]:
    model = _NnxNet(nnx.Rngs(1))
    optimizer = Optimizer(model, tx, wrt=nnx.Param)
    fn = oa.microbatched(jax.value_and_grad(_nnx_loss, has_aux=True), K, has_aux=True,
                         aux_rules="mean")

    @nnx.jit
    def step(model: _NnxNet, optimizer: Optimizer, batch: Batch) -> jax.Array:
      params, stats = _nnx_pure(model)
      # Arrays into the scan (a Variable of this trace cannot be updated inside it); the
      # gradient goes back into Param variables for `optimizer.update` (wrt=nnx.Param).
      (loss, new_stats), grads = fn(nnx.as_pure(params), batch, nnx.as_pure(stats))
      nnx.update(model, new_stats)
      optimizer.update(model, jax.tree.map(lambda p, g: p.replace(g), params, grads,
                                           is_leaf=lambda v: isinstance(v, nnx.Variable)))
      return loss

    windows, losses = [], []
    for batch in batches:
      losses.append(float(step(model, optimizer, batch)))
      windows.append(nnx.as_pure(_nnx_pure(model)))  # a snapshot: Variables are references
    return windows, losses


# ----------------------------------------------------------------------------- references

def _f64(x: Any) -> np.ndarray:
  return np.asarray(x[...] if isinstance(x, nnx.Variable) else x, np.float64)


def _running_stats_reference(api: Any, params: Any, batch: Batch, mode: str) -> tuple:
  """The running (mean, var) after one window from (0, 1), in numpy float64."""
  w, b = map(_f64, api.first_layer(params))
  h = [_f64(x_i) @ w + b for x_i, _ in (_micro(batch, i) for i in range(K))]
  m = MOMENTUM
  mean, var = np.zeros(4), np.ones(4)
  if mode == "across_steps":  # one EMA update per micro-batch
    for h_i in h:
      mean, var = m * mean + (1 - m) * h_i.mean(0), m * var + (1 - m) * h_i.var(0)
  else:  # one update with the micro-batches' mean statistics
    mean = m * mean + (1 - m) * np.mean([h_i.mean(0) for h_i in h], 0)
    var = m * var + (1 - m) * np.mean([h_i.var(0) for h_i in h], 0)
  return mean, var


@functools.cache
def _ghost_and_whole(loss: Callable) -> Callable[[Any, Any, Batch], tuple[Any, Any]]:
  """``(params, stats, batch) ->`` the mean of per-micro-batch gradients (each with its own
  statistics), and the whole batch's: one jitted program per API (eagerly, XLA:CPU compiles
  each op of the vmapped gradient, most of this file's time)."""
  grad = jax.grad(lambda p, batch, s: loss(p, batch, s)[0])

  @jax.jit
  def both(params: Any, stats: Any, batch: Batch) -> tuple[Any, Any]:
    stacked = jax.tree.map(lambda a: a.reshape(B // K, K, *a.shape[1:]).swapaxes(0, 1), batch)
    per_micro = jax.vmap(grad, in_axes=(None, 0, None))(params, stacked, stats)
    return jax.tree.map(lambda g: g.mean(0), per_micro), grad(params, batch, stats)
  return both


def _flat(tree: Any) -> np.ndarray:
  return np.concatenate([_f64(x).ravel() for x in jax.tree.leaves(tree)])


# ----------------------------------------------------------------------------- the tests

@pytest.mark.parametrize("api", [
    pytest.param(_Linen, id="linen"),
    pytest.param(_Nnx, id="nnx"),
])
@pytest.mark.parametrize("mode", [
    pytest.param("across_steps", marks=pytest.mark.catches("mean_off_by_one_accumulate")),
    pytest.param("in_one_step", marks=pytest.mark.catches("mean_off_by_one_microbatched")),
])
def test_running_stats_and_ghost_gradient(api: Any, mode: str):
  batches = _batches()
  if mode == "across_steps":
    windows, losses = api.across_steps(oa.accumulate(K, optax.sgd(LR)), batches)
    # Every micro-batch is one call; report the window's mean loss.
    losses = np.mean(np.reshape(losses, (WINDOWS, K)), axis=1)
  else:
    windows, losses = api.in_one_step(optax.sgd(LR), batches)
  params0, stats0 = api.init()
  params1, stats1 = windows[0]

  # The running statistics after the first window.
  ref_mean, ref_var = _running_stats_reference(api, params0, batches[0], mode)
  mean, var = map(_f64, api.running(stats1))
  np.testing.assert_allclose(mean, ref_mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(var, ref_var, rtol=1e-5, atol=1e-6)
  # Neither is the large batch's one update: its variance is over all 16 rows.
  w, b = map(_f64, api.first_layer(params0))
  large_var = MOMENTUM + (1 - MOMENTUM) * (_f64(batches[0][0]) @ w + b).var(0)
  assert np.max(np.abs(large_var - var)) > 1e-2, large_var - var

  # The window's gradient, read off one SGD step: ghost batch norm, not the whole batch's.
  ghost, whole = map(_flat, _ghost_and_whole(api.loss)(params0, stats0, batches[0]))
  used = (_flat(params0) - _flat(params1)) / LR
  np.testing.assert_allclose(used, ghost, rtol=1e-4, atol=1e-5)
  gap = np.linalg.norm(ghost - whole) / np.linalg.norm(whole)
  assert gap > 1.0, gap  # 3.4 (Linen), 2.0 (NNX): micro-batches of 4, their own statistics

  # It trains.
  assert np.all(np.isfinite(losses))
  assert np.all(np.diff(losses) < 0) and losses[-1] < 0.8 * losses[0], losses

