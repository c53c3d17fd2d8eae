"""A training job's whole life on every path: checkpoint, resume, odd leaves, other meshes.

The paths: one device without a mesh (``single``), ``pmap``, ``shard_map`` with
``per_device_state`` (``shard_map``), plain ``jit`` on an Explicit mesh with
``local_value_and_grad`` and replicated params (``jit``) and with params sharded over the
data axis (``fsdp``); each on 1 and 8 devices, with one params tree holding every odd
kind of leaf (a scalar, size 1, size 0, bfloat16, an integer leaf whose gradient is
float0), through the optax protocol and ``update_and_apply``, with ``reduction="mean"``
and ``"weighted"``.

Every case trains ``2 k`` micro-steps and must equal the large batch (SGD with momentum on
each window's data as one batch, on one device: a scale-sensitive optimizer). Its state is
saved at a window boundary and mid-window, through orbax, ``flax.serialization`` and a
host round trip (``jax.device_get``, then ``jax.device_put(host, leaf.sharding)``); every
restored copy resumes and must end bit for bit like the uninterrupted run. A state saved on
8 devices resumes on 4, 2 and 1 (and one from 1 on 8) through ``reshard_state``; a job
killed with SIGKILL restarts from its latest ``CheckpointManager`` step
(``examples/resumable_training.py``), in one process and in two.

The one-device cases also run on a real one-device platform (a subprocess without the
forced host devices of ``tests/conftest.py``).
"""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum as oa
from optax_accum.sharding import (
    local_value_and_grad,
    per_device_state,
    reshard_state,
    shard_map_specs,
)
from tests._reference import free_port, multiprocess_env

ROOT = Path(__file__).resolve().parents[1]
K, STEPS, BATCH = 4, 8, 16  # two windows of 4 micro-batches of 16 rows (all devices)
SAVE_AT = (4, 6)  # after these micro-steps: a window boundary, and mid-window
LR, MOMENTUM = 0.1, 0.9
ONE_DEVICE_RUN = os.environ.get("OPTAX_ACCUM_TEST_DEVICES") == "1"
FLOAT_LEAVES = ("w", "scale", "bias", "empty", "half")


def host_params() -> dict[str, np.ndarray]:
  """Every kind of leaf a real model has: a matrix, a scalar (a learnable temperature),
  size 1, size 0, bfloat16, and an integer leaf (a counter; its gradient is float0)."""
  rng = np.random.default_rng(0)
  return {
      "w": (rng.normal(size=(8, 4)) / np.sqrt(8)).astype(np.float32),
      "scale": np.asarray(1.0, np.float32),
      "bias": np.zeros(1, np.float32),
      "empty": np.zeros(0, np.float32),
      "half": (0.1 * rng.normal(size=4)).astype(jnp.bfloat16),
      "count": np.asarray(2, np.int32),
  }


def host_data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``(STEPS, BATCH, ...)`` inputs, targets and a mask of real rows (4 to 16 per step)."""
  rng = np.random.default_rng(1)
  x = rng.normal(size=(STEPS, BATCH, 8)).astype(np.float32)
  y = rng.normal(size=(STEPS, BATCH, 4)).astype(np.float32)
  real = rng.integers(4, BATCH + 1, size=STEPS)
  mask = (np.arange(BATCH)[None, :] < real[:, None]).astype(np.float32)
  return x, y, rng.permuted(mask, axis=1)


def row_losses(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
  pred = (x @ p["w"]) * p["scale"] + p["bias"] + p["half"].astype(jnp.float32) + jnp.sum(
      p["empty"])
  return jnp.sum((pred - y) ** 2, axis=-1) * p["count"].astype(jnp.float32)


def mean_loss(p: Any, x: jax.Array, y: jax.Array, mask: jax.Array, weighted: bool) -> jax.Array:
  losses = row_losses(p, x, y)
  return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0) if weighted else jnp.mean(
      losses)


def inner() -> optax.GradientTransformation:
  return optax.sgd(LR, momentum=MOMENTUM)


@functools.cache
def large_batch(weighted: bool) -> dict[str, np.ndarray]:
  """SGD with momentum once per window, on the whole window's rows, on one device."""
  x, y, mask = host_data()
  p = jax.tree.map(jnp.asarray, host_params())
  floats = {n: p[n] for n in FLOAT_LEAVES}
  opt = inner()
  state = opt.init(floats)

  @jax.jit  # one program: eagerly, XLA:CPU compiles each op of the gradient and the update
  def step(floats: Any, state: Any, *window: jax.Array) -> tuple[Any, Any]:
    grads = jax.grad(lambda f: mean_loss({**p, **f}, *window, weighted))(floats)
    updates, state = opt.update(grads, state, floats)
    return optax.apply_updates(floats, updates), state

  for w in range(STEPS // K):
    rows = slice(w * K, (w + 1) * K)
    window = (x[rows].reshape(-1, 8), y[rows].reshape(-1, 4), mask[rows].reshape(-1))
    floats, state = step(floats, state, *window)
  return jax.device_get({**p, **floats})


# --- the paths: each builds its params, state and jitted step on n devices ---------------


class Job(NamedTuple):
  params: Any
  state: Any
  step: Callable[..., Any]  # step(params, state, i) -> (params, state), micro-batch i
  init: Callable[[], Any]  # the state `tx.init` builds here (a restore target)


def make_tx(mode: str, reduction: str, axis_name: Any = "data",
            **options: Any) -> optax.GradientTransformationExtraArgs:
  return oa.accumulate(K, inner(), reduction=reduction, axis_name=axis_name, **options)


def data_mesh(n: int) -> jax.sharding.Mesh:
  return jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,),
                       devices=jax.devices()[:n])


def apply_step(tx: Any, mode: str, grads: Any, state: Any, params: Any, **kw: Any) -> Any:
  if mode == "update_and_apply":
    return oa.update_and_apply(tx, grads, state, params, **kw)
  updates, state = tx.update(grads, state, params, **kw)
  return optax.apply_updates(params, updates), state


def single_job(n: int, mode: str, reduction: str, **options: Any) -> Job:
  del n
  tx = make_tx(mode, reduction, axis_name=None, **options)
  weighted = reduction == "weighted"
  x, y, mask = host_data()
  params = jax.tree.map(jnp.asarray, host_params())

  @jax.jit
  def step(p: Any, s: Any, xb: Any, yb: Any, mb: Any) -> Any:
    grads = jax.grad(mean_loss, allow_int=True)(p, xb, yb, mb, weighted)
    kw = {"weight": jnp.sum(mb)} if weighted else {}
    return apply_step(tx, mode, grads, s, p, **kw)

  return Job(params, tx.init(params), lambda p, s, i: step(p, s, x[i], y[i], mask[i]),
             lambda: tx.init(params))


def pmap_job(n: int, mode: str, reduction: str, **options: Any) -> Job:
  tx = make_tx(mode, reduction, **options)
  weighted = reduction == "weighted"
  x, y, mask = (a.reshape(STEPS, n, BATCH // n, *a.shape[2:]) for a in host_data())
  devices = jax.devices()[:n]
  params = jax.pmap(lambda p: p, devices=devices)(  # one copy per device, as pmap keeps it
      jax.tree.map(lambda a: np.stack([a] * n), host_params()))

  def local(p: Any, s: Any, xb: Any, yb: Any, mb: Any) -> Any:
    grads = jax.grad(mean_loss, allow_int=True)(p, xb, yb, mb, weighted)
    kw = {"weight": jnp.sum(mb)} if weighted else {}  # this device's real rows
    return apply_step(tx, mode, grads, s, p, **kw)

  step = jax.pmap(local, axis_name="data", devices=devices)
  init = jax.pmap(tx.init, axis_name="data", devices=devices)
  return Job(params, init(params), lambda p, s, i: step(p, s, x[i], y[i], mask[i]),
             lambda: init(params))


def shard_map_job(n: int, mode: str, reduction: str, **options: Any) -> Job:
  tx = per_device_state(make_tx(mode, reduction, **options), "data")
  weighted = reduction == "weighted"
  mesh = data_mesh(n)
  x, y, mask = host_data()
  params = jax.device_put(jax.tree.map(jnp.asarray, host_params()), NamedSharding(mesh, P()))
  specs = shard_map_specs(tx, params, "data")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P("data"),
                                                         P("data")), out_specs=(P(), specs))
  def step(p: Any, s: Any, xb: Any, yb: Any, mb: Any) -> Any:
    varying = jax.tree.map(lambda a: jax.lax.pcast(a, "data", to="varying"), p)
    grads = jax.grad(mean_loss, allow_int=True)(varying, xb, yb, mb, weighted)
    kw = {"weight": jnp.sum(mb)} if weighted else {}
    return apply_step(tx, mode, grads, s, p, **kw)

  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
  rows = NamedSharding(mesh, P("data"))
  return Job(params, init(params), lambda p, s, i: step(p, s, *(
      jax.device_put(a[i], rows) for a in (x, y, mask))), lambda: init(params))


def jit_job(n: int, mode: str, reduction: str, *, fsdp: bool = False, **options: Any) -> Job:
  tx = make_tx(mode, reduction, **options)
  weighted = reduction == "weighted"
  mesh = data_mesh(n)
  x, y, mask = host_data()
  specs = {name: P("data") if fsdp and name == "w" else P() for name in host_params()}
  params = {name: jax.device_put(v, NamedSharding(mesh, specs[name]))
            for name, v in host_params().items()}
  # Token-weighted: each device's share is its masked sum over the global count.
  share = lambda p, xb, yb, mb, total: jnp.sum(row_losses(p, xb, yb) * mb) / jnp.maximum(
      total, 1.0)
  grad_fn = (local_value_and_grad(share, "data", batch_argnums=(1, 2, 3), combine="sum",
                                  allow_int=True) if weighted else
             local_value_and_grad(lambda p, xb, yb, mb: mean_loss(p, xb, yb, mb, False),
                                  "data", batch_argnums=(1, 2, 3), allow_int=True))

  @jax.jit
  def step(p: Any, s: Any, xb: Any, yb: Any, mb: Any) -> Any:
    args = (p, xb, yb, mb, jnp.sum(mb)) if weighted else (p, xb, yb, mb)
    _, grads = grad_fn(*args)
    kw = {"weight": jnp.sum(mb)} if weighted else {}  # a global scalar under jit
    return apply_step(tx, mode, grads, s, p, **kw)

  rows = NamedSharding(mesh, P("data"))
  return Job(params, tx.init(params), lambda p, s, i: step(p, s, *(
      jax.device_put(a[i], rows) for a in (x, y, mask))), lambda: tx.init(params))


PATHS: dict[str, Callable[..., Job]] = {
    "single": single_job, "pmap": pmap_job, "shard_map": shard_map_job, "jit": jit_job,
    "fsdp": functools.partial(jit_job, fsdp=True),
}
MODES = (("update", "mean"), ("update", "weighted"), ("update_and_apply", "mean"),
         ("update_and_apply", "weighted"))
# Every mode on 8 devices and on one without a mesh; on a mesh of 1 device two of them (the
# protocol with means, update_and_apply weighted) that between them touch every branch.
# (A mesh of 2 is where test_resume_on_another_number_of_devices resumes 8's state.)
CASES = [(path, n, *mode) for path in PATHS for n in ((1,) if path == "single" else (1, 8))
         for mode in (MODES if n == 8 or path == "single" else (MODES[0], MODES[3]))]


def case_id(case: tuple[Any, ...]) -> str:
  path, n, mode, reduction = case
  return f"{path}-n{n}-{mode}-{reduction}"


def needs(n: int) -> Any:
  return pytest.mark.skipif(jax.device_count() < n, reason=f"needs {n} devices")


# --- the three ways to save and restore a state ---------------------------------------------


def through_orbax(tree: Any, like: Any, tmp: Path) -> Any:
  """orbax 0.12 refuses zero-size arrays (a params rule of its own): they stay out of the
  checkpoint, and come back from ``like``, which holds nothing else of them."""
  checkpointer, path = orbax_save(tree, tmp / f"orbax_{time.monotonic_ns()}")
  ocp = pytest.importorskip("orbax.checkpoint")
  restored = checkpointer.restore(path, jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                                     sized(like)))
  return jax.tree.map(lambda r, t: t if r is None else r, restored, like,
                      is_leaf=lambda x: x is None)


def sized(tree: Any) -> Any:
  return jax.tree.map(lambda a: None if a.size == 0 else a, tree)


def orbax_save(tree: Any, path: Path) -> tuple[Any, Path]:
  ocp = pytest.importorskip("orbax.checkpoint")
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, sized(tree))
  checkpointer.wait_until_finished()
  return checkpointer, path


def through_flax(tree: Any, like: Any, tmp: Path) -> Any:
  serialization = pytest.importorskip("flax.serialization")
  restored = serialization.from_bytes(like, serialization.to_bytes(tree))
  return jax.tree.map(lambda h, t: jax.device_put(h, t.sharding), restored, like)


def through_host(tree: Any, like: Any, tmp: Path) -> Any:
  host = jax.device_get(tree)
  assert all(isinstance(a, (np.ndarray, np.generic)) for a in jax.tree.leaves(host))
  return jax.tree.map(lambda h, t: jax.device_put(h, t.sharding), host, like)


SAVES = {"orbax": through_orbax, "flax": through_flax, "host": through_host}


def leaves_equal(a: Any, b: Any) -> bool:
  a, b = jax.device_get((a, b))
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
      np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(x, y)
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def train(job: Job, params: Any, state: Any, start: int, stop: int,
          at: tuple[int, ...] = ()) -> tuple[Any, Any, dict[int, Any]]:
  saved = {}
  for i in range(start, stop):
    params, state = job.step(params, state, i)
    if i + 1 in at:
      saved[i + 1] = (params, state)
  return params, state, saved


def assert_large_batch(params: Any, weighted: bool, single_copy: Callable[[Any], Any]) -> None:
  got = jax.device_get(jax.tree.map(single_copy, params))
  expected = large_batch(weighted)
  for name in FLOAT_LEAVES:
    # The bfloat16 leaf's gradient rounds per micro-batch here, once in the large batch:
    # a bfloat16 ulp (0.4%) there moves the other leaves by up to 1e-3 after two windows.
    tol = 2e-2 if name == "half" else 1e-3
    np.testing.assert_allclose(np.asarray(got[name], np.float32),
                               np.asarray(expected[name], np.float32), rtol=tol, atol=tol,
                               err_msg=name)
  assert got["empty"].shape == (0,) and got["half"].dtype == jnp.bfloat16
  assert got["count"].dtype == np.int32 and int(got["count"]) == 2  # not trained
  assert not np.allclose(got["w"], host_params()["w"])  # it did train


# --- the matrix ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", [pytest.param(c, marks=needs(c[1])) for c in CASES],
                         ids=case_id)
def test_a_job_saves_and_resumes_bit_for_bit(case: tuple[Any, ...], tmp_path: Path) -> None:
  path, n, mode, reduction = case
  job = PATHS[path](n, mode, reduction)
  params, state, saved = train(job, job.params, job.state, 0, STEPS, SAVE_AT)
  assert int(jax.device_get(state.gradient_step).max()) == STEPS // K
  assert_large_batch(params, reduction == "weighted",
                     (lambda a: a[0]) if path == "pmap" else (lambda a: a))
  like = {"params": job.params, "state": job.init()}
  for at, (p_at, s_at) in saved.items():
    assert int(jax.device_get(s_at.mini_step).max()) == at % K
    for name, save in SAVES.items():
      restored = save({"params": p_at, "state": s_at}, like, tmp_path)
      assert type(restored["state"]) is type(s_at), name
      p, s, _ = train(job, restored["params"], restored["state"], at, STEPS)
      assert leaves_equal(p, params), f"{name}, saved after micro-step {at}: params"
      assert leaves_equal(s, state), f"{name}, saved after micro-step {at}: state"


@pytest.mark.skipif(ONE_DEVICE_RUN or jax.device_count() == 1, reason="this is that run")
def test_the_one_device_cases_on_a_one_device_platform() -> None:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(OPTAX_ACCUM_TEST_DEVICES="1", JAX_PLATFORMS="cpu")
  selected = "n1 and (update-mean or update_and_apply-weighted) or one_device"
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-n0", "-p", "no:cacheprovider", str(Path(__file__)),
       "-k", selected], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
  # Every selected case ran: the one-device matrix rows, and the device count check.
  expected = sum(n == 1 and (mode, reduction) in (MODES[0], MODES[3])
                 for _, n, mode, reduction in CASES) + 1
  assert re.search(rf"\b{expected} passed", result.stdout), result.stdout[-2000:]


def test_one_device_is_really_one_device_in_that_run() -> None:
  if ONE_DEVICE_RUN:
    assert jax.device_count() == 1


# --- the bfloat16 buffer, its stochastic rounding per device ------------------------------


@pytest.mark.parametrize("path,n", [pytest.param(p, n, marks=needs(n)) for p, n in (
    ("single", 1), ("pmap", 8), ("shard_map", 8), ("jit", 1), ("jit", 8), ("fsdp", 8))])
def test_a_bf16_buffer_on_every_path(path: str, n: int) -> None:
  job = PATHS[path](n, "update_and_apply", "mean", accumulator_dtype=jnp.bfloat16)
  buffer = job.state.acc_grads["w"]
  assert buffer.dtype == jnp.bfloat16
  params, _, saved = train(job, job.params, job.state, 0, STEPS, (6,))
  # 2 windows of 4 micro-batches: the narrow buffer's error is well under its 2^-8 ulp
  # times the values; the f32 leaves still match the large batch closely.
  got = jax.device_get(jax.tree.map((lambda a: a[0]) if path == "pmap" else (lambda a: a),
                                    params))
  expected = large_batch(False)
  np.testing.assert_allclose(got["w"], expected["w"], rtol=2e-2, atol=2e-3)
  p_at, s_at = saved[6]
  restored = through_host({"params": p_at, "state": s_at},
                          {"params": job.params, "state": job.init()}, Path())
  p, _, _ = train(job, restored["params"], restored["state"], 6, STEPS)
  assert leaves_equal(p, params)  # the rounding's bits come from counters: reruns agree


# --- another number of devices -----------------------------------------------------------


@needs(8)
@pytest.mark.parametrize("path,before,after", [
    ("jit", 8, 4), ("jit", 8, 2), ("jit", 8, 1), ("jit", 1, 8), ("fsdp", 8, 2),
    ("shard_map", 8, 2), ("pmap", 8, 2), ("jit->single", 8, 1), ("single->jit", 1, 8)])
def test_resume_on_another_number_of_devices(path: str, before: int, after: int,
                                             tmp_path: Path) -> None:
  """Saved mid-window on ``before`` devices, resumed on ``after`` through orbax's host
  restore and ``reshard_state``: the partial sums combine, the run ends as the large
  batch does (weighted: the partial sums are shares on every path). ``a->b``: saved on
  path ``a``, resumed on ``b`` (one device without ``axis_name``, one buffer). Under
  ``pmap`` every leaf holds a copy per device: the others are device 0's."""
  path, _, resumed = path.partition("->")
  first_copy = (lambda a: np.asarray(a)[0]) if path == "pmap" else np.asarray
  first = PATHS[path](before, "update", "weighted")
  _, _, saved = train(first, first.params, first.state, 0, STEPS, (6,))
  p_at, s_at = saved[6]
  checkpointer, ckpt = orbax_save({"params": p_at, "state": s_at}, tmp_path / "ckpt")
  # The documented restore onto another mesh: host arrays in the saved layout.
  meta = checkpointer.metadata(ckpt).item_metadata.tree
  host = checkpointer.restore(ckpt, jax.tree.map(lambda m: np.empty(m.shape, m.dtype), meta))
  second = PATHS[resumed or path](after, "update", "weighted")
  state = reshard_state(host["state"], second.init())
  assert jax.tree.structure(state) == jax.tree.structure(second.state)
  assert state.acc_grads["w"].shape == second.state.acc_grads["w"].shape
  assert int(first_copy(state.mini_step)) == 2
  params = reshard_state(host["params"], second.params)  # (params: no per-device leaf)
  params, state, _ = train(second, params, state, 6, STEPS)
  assert int(first_copy(state.gradient_step)) == 2
  assert_large_batch(params, True, first_copy)


@needs(8)
def test_a_state_on_its_own_layout_comes_back_unchanged() -> None:
  job = jit_job(8, "update", "mean", track_noise_scale=True)
  _, state, _ = train(job, job.params, job.state, 0, 6)
  again = reshard_state(jax.device_get(state), job.init())
  assert leaves_equal(again, state)


@needs(8)
def test_a_state_from_another_mesh_without_reshard_state_names_it() -> None:
  eight, four = jit_job(8, "update", "mean"), jit_job(4, "update", "mean")
  serialization = pytest.importorskip("flax.serialization")
  host = serialization.from_bytes(four.init(), serialization.to_bytes(eight.state))
  state = jax.tree.map(lambda h, t: jax.device_put(h, t.sharding), host, four.init())
  with pytest.raises(ValueError, match=r"not one copy per device for the 4 device.*"
                     r"optax_accum\.sharding\.reshard_state"):
    four.step(four.params, state, 0)
  with pytest.raises(ValueError, match=r"not sharded over `axis_name='data'`.*state_shardings"):
    four.step(four.params, jax.tree.map(jnp.asarray, jax.device_get(four.state)), 0)
  with pytest.raises(ValueError, match=r"has no leaf at .*mini_step"):
    reshard_state({"acc_grads": host.acc_grads}, four.init())


# --- a job that is killed ------------------------------------------------------------------

SCRIPT = ROOT / "examples" / "resumable_training.py"
# A run takes 11-15 s alone on 2 cores; the deadline is for a CI machine under the whole suite.
KILL_TIMEOUT_S = 150


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
  env = multiprocess_env()  # the one-process runs too, but for the compilation cache:
  if "--num-processes" not in args:  # one process keeps the session's (the hang that
    # multiprocess_env avoids is two processes'), so the killed and resumed runs load the
    # step the uninterrupted run compiled (0.8 CPU-seconds a run on jaxlib 0.12).
    env.update({k: v for k, v in os.environ.items()
                if k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))})
  # PYTHONFAULTHANDLER: a hung process, sent SIGABRT, writes every thread's stack to its log.
  env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", PYTHONFAULTHANDLER="1")
  return subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                          stdout=log.open("w"), stderr=subprocess.STDOUT,
                          start_new_session=True)


def _logs(procs: list[tuple[subprocess.Popen[bytes], Path]]) -> str:
  return "\n".join(f"--- {log.name} (exit {p.returncode}):\n{log.read_text()[-3000:]}"
                   for p, log in procs)


def _run_all(jobs: list[tuple[list[str], Path]], *, kill_at: str | None = None) -> None:
  """Runs the processes to their end, or SIGKILLs them all once each log shows ``kill_at``.

  Fails, with every log (a hung process's stacks in it), where they do neither by the
  deadline."""
  procs = [(_start(args, log), log) for args, log in jobs]
  deadline = time.monotonic() + KILL_TIMEOUT_S
  try:
    while time.monotonic() < deadline:
      done = [p.poll() is not None for p, _ in procs]
      if kill_at is not None and all(kill_at in log.read_text() for _, log in procs):
        for p, _ in procs:
          os.killpg(p.pid, signal.SIGKILL)
        for p, _ in procs:
          assert p.wait() == -signal.SIGKILL
        return
      if all(done):
        break
      time.sleep(0.2)
  finally:
    hung = [p for p, _ in procs if p.poll() is None]
    for p in hung:
      os.killpg(p.pid, signal.SIGABRT)
    for p in hung:
      try:
        p.wait(timeout=20)
      except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  if hung:
    pytest.fail(f"{len(hung)} of {len(procs)} processes hung for {KILL_TIMEOUT_S} s:\n"
                + _logs(procs))
  assert all(p.returncode == 0 for p, _ in procs), _logs(procs)
  assert kill_at is None, "the job ended before it could be killed"


@pytest.mark.parametrize("processes", [1, 2], ids=["one_process", "two_processes"])
def test_a_killed_job_resumes_bit_for_bit(processes: int, tmp_path: Path) -> None:
  """8 devices in all, plain jit, k = 4, CheckpointManager every 3 micro-steps (so the
  latest is mid-window), SIGKILL after micro-step 7, restart: the same params, bit for bit,
  as the run that was never killed. A run that hangs fails with every process's stacks."""
  port = iter([free_port() for _ in range(3)])

  def jobs(ckpt: Path, tag: str, *extra: str) -> list[tuple[list[str], Path]]:
    common = ["--ckpt-dir", str(ckpt), "--steps", "12", "--save-every", "3", "--k", "4",
              "--out", str(tmp_path / f"{tag}.npz"), *extra]
    if processes == 1:
      return [([*common, "--cpu-devices", "8"], tmp_path / f"{tag}.log")]
    p = str(next(port))
    return [([*common, "--cpu-devices", "4", "--num-processes", "2", "--process-id", str(i),
              "--port", p], tmp_path / f"{tag}{i}.log") for i in range(2)]

  _run_all(jobs(tmp_path / "never_killed", "uninterrupted"))
  _run_all(jobs(tmp_path / "killed", "killed", "--stall-after", "7"), kill_at="stalling")
  resumed = jobs(tmp_path / "killed", "resumed")
  _run_all(resumed)
  logs = [log.read_text() for _, log in resumed]
  assert all("resumed from micro-step 6 (mini_step 2)" in log for log in logs), logs[0]
  with np.load(tmp_path / "uninterrupted.npz") as a, np.load(tmp_path / "resumed.npz") as b:
    assert sorted(a.files) == sorted(b.files)
    for name in a.files:
      np.testing.assert_array_equal(a[name], b[name], err_msg=name)
