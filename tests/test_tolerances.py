"""The suite's backend-derived tolerances (tests/_reference.py) against independent numbers.

On XLA:CPU every measured error is a few float32 ulps, so every tolerance is the one the
test was written with. Elsewhere a tolerance grows with the backend's measured error, and
only then: the measurement must see a less accurate function for what it is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import _reference
from tests._reference import ERROR_FACTOR, FULL_ACCURACY, XLA_CPU, backend_errors, tolerance

# Every CPU tolerance the suite hands to tolerance(), and the functions it names with it.
SUITE_TOLERANCES = [1e-6, 2e-6, 5e-6, 1e-5]
EVERY_FUNCTION = ("exp", "log", "tanh", "erf", "dot")
# What a TPU v5e measured with these grids (jax 0.10.2 with libtpu, 2026-12-05).
TPU_V5E = {"exp": 4.4e-6, "log": 6.9e-5, "tanh": 6.0e-5, "erf": 2.8e-7, "dot": 4.0e-8}


@pytest.mark.skipif(not XLA_CPU, reason="the numbers of XLA:CPU, the reference compiler")
def test_on_xla_cpu_every_tolerance_is_as_written() -> None:
  errors = backend_errors()
  assert set(errors) == set(EVERY_FUNCTION)
  assert all(0 < e <= FULL_ACCURACY for e in errors.values()), errors  # a few ulps, measured
  for cpu_tolerance in [0.0, *SUITE_TOLERANCES]:
    for name in EVERY_FUNCTION:
      assert tolerance(cpu_tolerance, name) == cpu_tolerance
    assert tolerance(cpu_tolerance, *EVERY_FUNCTION) == cpu_tolerance
  assert _reference.float64_rounding() <= np.finfo(np.float64).eps / 2  # IEEE: half an ulp
  assert _reference.float64_eps() == np.finfo(np.float64).eps


def test_a_less_accurate_function_is_measured_as_such() -> None:
  """exp rounded to bfloat16 (8 significant bits) is off by up to 2**-8 relative; exp in
  float32 is not (XLA:CPU: 6e-8; a TPU v5e: 4.4e-6)."""
  x = _reference.ELEMENTARY["exp"][2]
  rounded = _reference.relative_error(lambda v: jnp.exp(v).astype(jnp.bfloat16), np.exp, x)
  assert 2**-9 < rounded <= 2**-8 + tolerance(0.0, "exp")  # + the float32 exp's own error
  assert _reference.relative_error(jnp.exp, np.exp, x) < 1e-4


def test_tolerances_grow_with_the_measured_error_and_only_above_full_accuracy(
    monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setattr(_reference, "backend_errors", lambda: TPU_V5E)
  assert tolerance(1e-5, "exp", "log") == ERROR_FACTOR * 6.9e-5
  assert tolerance(1e-5, "exp") == ERROR_FACTOR * 4.4e-6
  assert tolerance(1e-3, "log") == 1e-3  # never below the CPU tolerance
  assert tolerance(2e-6, "erf", "dot") == 2e-6  # accurate functions: as written
  assert tolerance(0.0, "erf") == 0.0
  with pytest.raises(ValueError, match=r"name the functions.*\['cosh'\]"):
    tolerance(1e-5, "cosh")
  with pytest.raises(ValueError, match="name the functions"):
    tolerance(1e-5)


def test_float64_eps_grows_with_a_measured_rounding_above_half_an_ulp(
    monkeypatch: pytest.MonkeyPatch) -> None:
  eps = float(np.finfo(np.float64).eps)
  monkeypatch.setattr(_reference, "float64_rounding", lambda: eps / 2)
  assert _reference.float64_eps() == eps
  monkeypatch.setattr(_reference, "float64_rounding", lambda: 7.2e-15)  # a TPU v5e's
  assert _reference.float64_eps() == 2 * 7.2e-15


def test_on_cpu_computes_float64_on_the_host_cpu() -> None:
  with _reference.on_cpu():
    y = jnp.asarray(np.float64(1) + 2**-40) * 3
    assert y.dtype == jnp.float64 and y.devices() == {jax.devices("cpu")[0]}
    assert float(y) == 3 + 3 * 2**-40  # exact in float64, lost in float32
  assert jnp.asarray(1.0).dtype == jnp.float32  # x64 off again
