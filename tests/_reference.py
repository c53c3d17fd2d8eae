"""An independent large-batch reference, a tiny model and the loop that trains it.

The reference never calls optax_accum: it averages the micro-batch gradients
itself (``np.mean`` over a stacked axis, in float64) and applies the inner
optimizer once per window, exactly what large-batch training does.
:func:`accumulate_run` is the other side of the comparison: the same windows,
one micro-batch per call of an accumulating transform.

:func:`tolerance` turns a test's CPU tolerance into the default backend's: the CPU
tolerance, or a multiple of the backend's measured float32 error, whichever is larger.
:func:`on_cpu` computes a float64 reference on the host CPU, whatever the default backend.
:func:`xla_cpu_fact` and :func:`premise` mark what a test asserts about XLA:CPU's compiler
(bytes of ``memory_analysis()``, counts of instructions): asserted there, skipped elsewhere
with the fact named. Numerics never skip: they get :func:`tolerance`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from fractions import Fraction
from pathlib import Path
from types import ModuleType
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

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


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on (for a run's coordinator)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def session_xla_flags() -> str:
  """This session's ``XLA_FLAGS`` less the forced host device count: for a process that
  sets its own device count, or runs on the platform's own devices, and compiles as the
  session does (tests/conftest.py's flags: XLA:CPU compiles the suite's small programs at
  half the CPU time or less)."""
  return " ".join(flag for flag in os.environ.get("XLA_FLAGS", "").split()
                  if not flag.startswith("--xla_force_host_platform_device_count="))


def multiprocess_env() -> dict[str, str]:
  """The environment of an example started as one of several processes (gloo collectives).

  This process's, with ``XLA_FLAGS`` less the device count (:func:`session_xla_flags`: the
  script sets its own count) and less the session's compilation cache (conftest.py): on jax
  0.12.1 (not 0.12.0.1, not 0.10.2) two processes hang in the first all-reduce of a program
  with two all-reduces that both load from a persistent compilation cache (the repro:
  docs/development/index.md). Their programs compile every time instead."""
  dropped = ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR",
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")
  env = {k: v for k, v in os.environ.items() if k not in dropped}
  return {**env, "XLA_FLAGS": session_xla_flags()}


# -- the default backend's float32 accuracy -------------------------------------------------
def _grid(low: float, high: float, *, log: bool = False) -> np.ndarray:
  """512 float32 points from ``low`` to ``high``, evenly or geometrically spaced."""
  points = np.geomspace(low, high, 512) if log else np.linspace(low, high, 512)
  return points.astype(np.float32)


# Each function on a grid away from its zeros (there a relative error means nothing), in
# float32 on the default backend and in float64 by numpy on the same float32 inputs.
ELEMENTARY: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any], np.ndarray]] = {
    "exp": (jnp.exp, np.exp, _grid(-20.0, 20.0)),
    "log": (jnp.log, np.log,
            np.concatenate([_grid(1e-6, 0.5, log=True), _grid(2.0, 1e6, log=True)])),
    "tanh": (jnp.tanh, np.tanh, np.concatenate([_grid(-5.0, -0.05), _grid(0.05, 5.0)])),
    "erf": (jax.scipy.special.erf, np.vectorize(math.erf),
            np.concatenate([_grid(-4.0, -0.05), _grid(0.05, 4.0)])),
}


def relative_error(fn: Callable[[Any], Any], exact: Callable[[Any], Any], x: np.ndarray) -> float:
  """The largest ``|fn(x) - exact(x)| / |exact(x)|`` over ``x``, ``fn`` jitted on the default
  device, ``exact`` in float64.

  >>> relative_error(lambda x: x.astype(jnp.bfloat16), lambda x: x, np.float32([1 + 2**-8]))
  0.00389...
  """
  got = np.asarray(jax.jit(fn)(x), np.float64)
  want = np.asarray(exact(np.asarray(x, np.float64)), np.float64)
  return float(np.max(np.abs(got - want) / np.abs(want)))


def dot_relative_error(precision: str = "highest") -> float:
  """A float32 matmul's largest error relative to ``|a| @ |b|`` (the size its rounding
  scales with), at ``precision``, against float64 on the same float32 inputs."""
  rng = np.random.default_rng(0)
  a, b = (rng.normal(size=shape).astype(np.float32) for shape in ((64, 256), (256, 64)))
  got = np.asarray(jax.jit(lambda a, b: jnp.dot(a, b, precision=precision))(a, b), np.float64)
  a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(got - a64 @ b64) / (np.abs(a64) @ np.abs(b64))))


@functools.cache
def backend_errors() -> dict[str, float]:
  """The default backend's measured float32 relative error of each elementary function of
  :data:`ELEMENTARY` and of ``"dot"`` (a matmul at precision "highest"), once a session.
  XLA:CPU is within a few float32 ulps (about 1e-7) of each; the TPU's exp, log, tanh and erf
  are accurate to 4-5 digits."""
  errors = {name: relative_error(*spec) for name, spec in ELEMENTARY.items()}
  return errors | {"dot": dot_relative_error()}


# A backend whose measured errors are all at most this (four float32 ulps at 1) computes
# float32 as XLA:CPU does, to the last few bits: its tolerances are the CPU ones, as written.
FULL_ACCURACY = 4 * float(np.finfo(np.float32).eps)
# Above that, a result's error is this many times the worst measured error of the functions it
# goes through: a log-sum-exp is an exp, a sum and a log, and a gradient can amplify them.
ERROR_FACTOR = 10.0


def tolerance(cpu_tolerance: float, *functions: str) -> float:
  """A test's tolerance on the default backend: ``cpu_tolerance`` where ``functions`` (names
  of :func:`backend_errors`) are accurate to :data:`FULL_ACCURACY`, as on XLA:CPU; else the
  larger of ``cpu_tolerance`` and :data:`ERROR_FACTOR` times their worst measured error.

  >>> errors = backend_errors()
  >>> worst = max(errors["exp"], errors["log"])
  >>> tolerance(1e-5, "exp", "log") == (1e-5 if worst <= FULL_ACCURACY else max(1e-5, 10 * worst))
  True
  """
  errors = backend_errors()
  unknown = sorted(set(functions) - set(errors))
  if unknown or not functions:
    raise ValueError(f"tolerance: name the functions the result goes through, among"
                     f" {sorted(errors)} (got {list(functions)})")
  worst = max(errors[name] for name in functions)
  return cpu_tolerance if worst <= FULL_ACCURACY else max(cpu_tolerance, ERROR_FACTOR * worst)


@functools.cache
def float64_rounding() -> float:
  """The default backend's largest relative error of one float64 product or sum, against
  exact rational arithmetic: at most half an ulp (``eps / 2``) where float64 is IEEE, as on
  XLA:CPU; more where it is emulated (a TPU's). Compiled under x64 once a session."""
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=256), rng.normal(size=256) * 10.0 ** rng.integers(-8, 8, 256)
  with jax.enable_x64(True):
    product, total = jax.jit(lambda x, y: (x * y, x + y))(x, y)
  errors = []
  for a, b, got_product, got_sum in zip(x, y, np.asarray(product), np.asarray(total), strict=True):
    wants = (Fraction(a) * Fraction(b), Fraction(a) + Fraction(b))
    for got, want in zip((got_product, got_sum), wants, strict=True):
      errors.append(abs(Fraction(float(got)) - want) / abs(want))
  return float(max(errors))


def float64_eps() -> float:
  """float64's eps where products and sums round correctly (the CPU's, as written), else
  twice the measured rounding (:func:`float64_rounding`): what an error bound written in
  ``eps`` for correctly rounded arithmetic becomes on this backend."""
  eps = float(np.finfo(np.float64).eps)
  return max(eps, 2 * float64_rounding())


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
  """float64 on the host CPU: the references' place on every backend.

  A TPU emulates float64 (a float64 program compiles for minutes there) and its exp and log
  are float32-accurate only to 4-5 digits; the host CPU computes the reference in real float64.
  """
  with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
    yield


# -- XLA:CPU's compiler facts ------------------------------------------------------------------
#: The suite's reference compiler: its buffer assignment and instruction choices are what the
#: memory and HLO tests were written against. Another compiler's differ without being wrong.
XLA_CPU = jax.default_backend() == "cpu"


def xla_cpu_fact(fact: str) -> pytest.MarkDecorator:
  """Marks a test that asserts ``fact``, a fact of XLA:CPU's compiler: it skips elsewhere,
  with ``fact`` in the reason."""
  return pytest.mark.skipif(not XLA_CPU, reason=f"asserts an XLA:CPU compiler fact: {fact}")


def premise(holds: bool, fact: str) -> None:
  """A compiler fact a test is built on (peaks that fall with k, activations that dominate):
  asserted on XLA:CPU; where another compiler lacks it, the test skips, naming it."""
  if holds:
    return
  if XLA_CPU:
    raise AssertionError(f"premise: {fact}")
  pytest.skip(f"an XLA:CPU compiler fact this test is built on does not hold on"
              f" {jax.default_backend()}: {fact}")
