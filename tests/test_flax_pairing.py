"""``optax_accum.flax`` on a Flax/JAX pairing whose ``flax.nnx`` does not import.

pip allows Flax 0.12.8 beside JAX 0.11.2 (Flax declares no upper bound on
JAX), and there ``import flax.nnx`` raises ``AttributeError`` from inside NNX.
The Linen half (``TrainState``) must still work and the NNX half
(``Optimizer``) must raise an ``ImportError`` that names the Flax to install.

The pairing lives in its own venv, built by ``.ci/run`` (Python 3.12,
``jax==0.11.2 jaxlib==0.11.2 flax==0.12.8 optax``), whose interpreter is given
in ``OPTAX_ACCUM_PAIRING_PYTHON``; this test runs a script in it against this
checkout. Without the variable it skips, except under CI, where it fails.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, jax, jax.numpy as jnp, numpy as np, optax, flax
out = {"jax": jax.__version__, "flax": flax.__version__}
try:
  import flax.nnx
  out["nnx_imports"] = True
except Exception as e:
  out["nnx_imports"] = False

import flax.linen as nn
import optax_accum as oa
from optax_accum.flax import TrainState

# Linen: two micro-batches through accumulate(2, sgd) equal one SGD step on their mean.
model = nn.Dense(1)
params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
xs = [jnp.arange(12.0).reshape(4, 3) / 10, jnp.ones((4, 3))]
loss = lambda p, x: jnp.mean((model.apply({"params": p}, x) - 1.0) ** 2)
state = TrainState.create(apply_fn=model.apply, params=params, tx=oa.accumulate(2, optax.sgd(0.5)))
step = jax.jit(lambda s, x: s.apply_gradients(grads=jax.grad(loss)(s.params, x)))
for x in xs:
  state = step(state, x)
grads = [jax.grad(loss)(params, x) for x in xs]
expected = jax.tree.map(lambda p, a, b: np.asarray(p) - 0.5 * (np.asarray(a) + np.asarray(b)) / 2,
                        params, *grads)
out["linen_max_error"] = max(float(np.max(np.abs(np.asarray(a) - e))) for a, e in
                             zip(jax.tree.leaves(state.params), jax.tree.leaves(expected)))
out["linen_gradient_step"] = int(state.opt_state.gradient_step)

try:
  from optax_accum.flax import Optimizer
  out["optimizer"] = "imported"
except ImportError as e:
  out["optimizer"] = "ImportError"
  out["message"] = str(e)
  out["cause"] = type(e.__cause__).__name__
print("RESULT " + json.dumps(out))
"""


def test_linen_works_and_nnx_names_the_fix_on_a_broken_pairing() -> None:
  python = os.environ.get("OPTAX_ACCUM_PAIRING_PYTHON")
  if not python:
    if os.environ.get("CI"):
      pytest.fail("OPTAX_ACCUM_PAIRING_PYTHON is not set: .ci/run builds the JAX 0.11.2 +"
                  " Flax 0.12.8 venv and sets it")
    pytest.skip("set OPTAX_ACCUM_PAIRING_PYTHON to a venv with jax 0.11.2 + flax 0.12.8")
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([python, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  out = json.loads(proc.stdout.split("RESULT ", 1)[1])
  assert (out["jax"], out["flax"]) == ("0.11.2", "0.12.8"), out
  assert not out["nnx_imports"], "this pairing's flax.nnx imports: it no longer tests the case"
  assert out["linen_gradient_step"] == 1 and out["linen_max_error"] < 1e-6, out
  assert out["optimizer"] == "ImportError" and out["cause"] == "AttributeError", out
  assert "Flax 0.12.10 or newer" in out["message"] and "JAX 0.11.1" in out["message"], out
