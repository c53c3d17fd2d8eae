"""Two processes x two CPU devices through ``jax.distributed`` (gloo on 127.0.0.1).

Training is checked in both of ``examples/multihost.py``'s modes: ``shard_map``
with per-device buffers, and plain ``jit`` on an Explicit mesh over all 4
devices with ``local_value_and_grad`` (unreduced gradients, the unmodified
model, no ``jax.set_mesh``). Each test launches
``examples/multihost.py`` twice as subprocesses with hard timeouts; a
subprocess that outlives its timeout is killed with its whole process group,
so a hang fails the test instead of the suite.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests._reference import free_port, multiprocess_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "multihost.py"
TIMEOUT_S = 120


def _load_script() -> Any:
  spec = importlib.util.spec_from_file_location("optax_accum_example_multihost", SCRIPT)
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _launch(tmp_path: Path, extra: dict[int, list[str]], common: list[str]) -> list[dict[str, Any]]:
  """Starts 2 processes, waits for both (bounded), returns their results."""
  port = free_port()
  env = multiprocess_env()
  env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
  procs = []
  start = time.monotonic()
  for pid in range(2):
    cmd = [sys.executable, str(SCRIPT), "--process-id", str(pid), "--num-processes", "2",
           "--port", str(port), "--cpu-devices", "2", *common, *extra.get(pid, [])]
    log = open(tmp_path / f"process{pid}.log", "w+")
    procs.append((subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True),
        log))
  results = []
  for proc, log in procs:
    remaining = max(1.0, TIMEOUT_S - (time.monotonic() - start))
    timed_out = False
    try:
      proc.wait(timeout=remaining)
    except subprocess.TimeoutExpired:
      timed_out = True
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
    log.seek(0)
    results.append({"returncode": proc.returncode, "timed_out": timed_out,
                    "elapsed": time.monotonic() - start, "log": log.read()})
    log.close()
  return results


def _reference(mh: Any, windows: int, k: int, global_batch: int) -> dict[str, np.ndarray]:
  """Single process, single device: SGD+momentum on the gradient of each whole window."""
  params = jax.tree.map(jnp.asarray, mh.init_params())
  x, y = mh.make_data(windows, k, global_batch)
  opt = optax.sgd(mh.LR, momentum=mh.MOMENTUM)
  state = opt.init(params)
  for w in range(windows):
    grads = jax.grad(mh.loss_fn)(params, x[w].reshape(-1, mh.D_IN), y[w].reshape(-1, mh.D_OUT))
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return {name: np.asarray(v) for name, v in params.items()}


@pytest.mark.parametrize("mode", ["shard_map", "plain_jit"])
def test_two_processes_match_single_process_large_batch(tmp_path: Path, mode: str) -> None:
  windows, k, global_batch = 3, 4, 16
  outs = [tmp_path / f"params{pid}.npz" for pid in range(2)]
  results = _launch(
      tmp_path, {pid: ["--out", str(outs[pid])] for pid in range(2)},
      ["--mode", mode, "--windows", str(windows), "--k", str(k),
       "--global-batch", str(global_batch)])
  for pid, r in enumerate(results):
    assert not r["timed_out"] and r["returncode"] == 0, f"process {pid}:\n{r['log'][-3000:]}"
    assert "2 local / 4 global devices" in r["log"]
    # One buffer per device, stacked: by the shard_map specs, or by `init` under jit.
    buffer = {"shard_map": "buffer float32[4,8,4]", "plain_jit": "buffer float32[4@data,8,4]"}
    assert f"{mode}: {buffer[mode]}" in r["log"], r["log"][-3000:]
    assert r["log"].count("emitted=True") == windows
  expected = _reference(_load_script(), windows, k, global_batch)
  initial = _load_script().init_params()
  for out in outs:
    got = np.load(out)
    assert set(got.files) == set(expected)
    for name in expected:
      np.testing.assert_allclose(got[name], expected[name], rtol=2e-5, atol=2e-6)
      assert not np.allclose(got[name], initial[name])  # it did train


@pytest.mark.parametrize("dying", [1, 0], ids=["worker_dies", "coordinator_dies"])
def test_dead_process_makes_the_other_fail_fast(tmp_path: Path, dying: int) -> None:
  """A process that exits mid-training: its peer must exit non-zero, within bounds."""
  results = _launch(
      tmp_path, {dying: ["--die-after", "1"]},
      ["--windows", "50", "--k", "4", "--heartbeat-timeout", "5", "--init-timeout", "30"])
  dead, survivor = results[dying], results[1 - dying]
  assert dead["returncode"] == 3, dead["log"][-3000:]
  assert not survivor["timed_out"], "the surviving process hung:\n" + survivor["log"][-3000:]
  assert survivor["returncode"] != 0, survivor["log"][-3000:]
  assert "window 50 done" not in survivor["log"]
  assert max(r["elapsed"] for r in results) < 90, [r["elapsed"] for r in results]
  # A clear error names the distributed runtime, not a silent exit.
  assert any(s in survivor["log"] for s in (
      "JAX distributed service detected fatal errors", "stopped sending heartbeats")), (
          survivor["log"][-3000:])
