"""An independent large-batch reference, a tiny model and the loop that trains it.

The reference never calls optax_accum: it averages the micro-batch gradients
itself (``np.mean`` over a stacked axis, in float64) and applies the inner
optimizer once per window, exactly what large-batch training does.
:func:`accumulate_run` is the other side of the comparison: the same windows,
one micro-batch per call of an accumulating transform.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum as oa


def init_params(key: jax.Array, dtype: Any = jnp.float32) -> dict[str, Any]:
  k1, k2, k3 = jax.random.split(key, 3)
  return {
      "dense": {
          "w": jax.random.normal(k1, (5, 3), dtype) * 0.5,
          "b": jnp.zeros((3,), dtype),
      },
      "scale": jax.random.normal(k2, (3,), dtype) * 0.1 + 1.0,
      "extra": jax.random.normal(k3, (2, 2), dtype) * 0.1,
  }


def loss_fn(params: dict[str, Any], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
  x, y = batch
  h = jnp.tanh(x @ params["dense"]["w"] + params["dense"]["b"]) * params["scale"]
  reg = jnp.sum(params["extra"] ** 2)
  return jnp.mean((h - y) ** 2) + 0.01 * reg


grad_fn = jax.jit(jax.grad(loss_fn))


def make_batches(key: jax.Array, n: int, size: int = 4) -> list[tuple[jax.Array, jax.Array]]:
  xs = jax.random.normal(key, (n, size, 5))
  ys = jax.random.normal(jax.random.fold_in(key, 1), (n, size, 3))
  return [(xs[i], ys[i]) for i in range(n)]


def make_windows(seed: int = 0, k: int = 3, n: int = 3) -> list[list[tuple[jax.Array, jax.Array]]]:
  """``n`` windows of ``k`` micro-batches each."""
  batches = make_batches(jax.random.key(seed), k * n)
  return [batches[i * k:(i + 1) * k] for i in range(n)]


def mean_tree(trees: Sequence[Any], weights: Sequence[float] | None = None) -> Any:
  """Mean (or weighted mean) of trees, computed in float64 numpy."""
  def combine(*leaves):
    stacked = np.stack([np.asarray(x, np.float64) for x in leaves])
    if weights is None:
      return stacked.mean(axis=0)
    w = np.asarray(weights, np.float64).reshape((-1,) + (1,) * (stacked.ndim - 1))
    return (stacked * w).sum(axis=0) / w.sum()
  return jax.tree.map(combine, *trees)


def large_batch_run(
    optimizer: optax.GradientTransformation,
    params: Any,
    windows: Sequence[Sequence[Any]],
    grad: Callable[[Any, Any], Any] = grad_fn,
) -> list[Any]:
  """Params after each window: one optimizer step on the mean gradient."""
  state = optimizer.init(params)
  history = []
  for window in windows:
    grads = [grad(params, b) for b in window]
    mean = jax.tree.map(
        lambda m, g: jnp.asarray(m, g.dtype), mean_tree(grads), grads[0])
    updates, state = optimizer.update(mean, state, params)
    params = optax.apply_updates(params, updates)
    history.append(params)
  return history


def assert_trees_close(a: Any, b: Any, rtol: float = 2e-5, atol: float = 2e-6) -> None:
  jax.tree.map(
      lambda x, y: np.testing.assert_allclose(
          np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol),
      a, b)


def accumulate_run(tx: optax.GradientTransformation, params: Any, windows: Sequence[Sequence[Any]],
                   *, jit: bool = True, **update_kwargs: Any) -> tuple[list[Any], Any]:
  """Params after each window, trained one micro-batch per ``tx.update`` call,
  and the last state. Mid-steps must leave the params as they are."""
  update = jax.jit(tx.update) if jit else tx.update
  state = tx.init(params)
  history = []
  for window in windows:
    for i, batch in enumerate(window):
      updates, state = update(grad_fn(params, batch), state, params, **update_kwargs)
      new_params = optax.apply_updates(params, updates)
      if i < len(window) - 1:
        chex.assert_trees_all_equal(new_params, params)  # mid-step: nothing moves
        assert not bool(oa.has_updated(state))
      else:
        assert bool(oa.has_updated(state))
      params = new_params
    history.append(params)
  return history, state


def load_example(name: str) -> ModuleType:
  """``examples/<name>.py`` imported as a module (the examples are scripts, not a package)."""
  path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"optax_accum_example_{name}", path)
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module
