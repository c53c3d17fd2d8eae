"""Deviceless compile check: what XLA's H200 compiler makes of each train step.

The CUDA PJRT plugin compiles for a topology described by a target config (the
device's properties as text): a CPU machine sees the optimized HLO an H200 would run.
Per train step: conditionals kept, copies, temporaries, bytes held per parameter. What
it expects (NOTES.md): unmet on the H200, the script exits with status 1.

Setup (a separate venv; ``--setup`` prints it)::

  python3.12 -m venv /tmp/gpuvenv   # Python 3.12 or newer: JAX 0.11 dropped 3.11
  /tmp/gpuvenv/bin/pip install jax==0.12.0.1 jaxlib==0.12.0.1 jax-cuda12-plugin==0.12.0.1 \\
      jax-cuda12-pjrt==0.12.0.1 optax==0.2.8 matplotlib   # one XLA throughout: the newest
  /tmp/gpuvenv/bin/pip install --no-deps -e .                 # this repository

Run::

  /tmp/gpuvenv/bin/python benchmarks/gpu_hlo.py                  # results/gpu_hlo.{json,md}

Without a compiler for the target the script exits with status 2.
"""

from __future__ import annotations

import os

# Before jax is imported: no GPU runtime (deviceless), no check for a CUDA install.
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"

import importlib.metadata
import subprocess
import sys
from pathlib import Path
from typing import Any

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
from bench_accumulate import K_WINDOW, LEAVES, size_label
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum as oa
from optax_accum import debug

# The H200's properties for XLA's GPU compiler (a stream_executor
# GpuTargetConfigProto in text form): SM 9.0, 132 SMs, 4.8 TB/s, 50 MiB L2.
H200_TEXT = """\
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 4800000000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 150000000000 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 7 }
runtime_version { major: 12 minor: 8 patch: 0 }
device_description_str: "NVIDIA H200"
"""
SETUP = __doc__.split("Setup (a separate venv; ``--setup`` prints it)::\n\n")[1].split("\n\n")[0]
TEMPS_LIMIT = 0.05
XLA_DISTRIBUTIONS = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt")


def target() -> tuple[NamedSharding, str]:
  """A replicated sharding on one deviceless H200, and what it is."""
  from jax.experimental import topologies

  try:
    topo = topologies.get_topology_desc(platform="cuda", target_config=H200_TEXT,
                                        topology="1x1x1")
  except Exception as e:  # no plugin, or one that cannot compile deviceless
    print(f"Cannot build the deviceless topology: {type(e).__name__}: {e}\nSetup:\n{SETUP}",
          file=sys.stderr)
    raise SystemExit(2) from e
  device = topo.devices[0]
  if device.platform != "gpu" or "H200" not in device.device_kind:
    raise SystemExit(f"Expected a deviceless NVIDIA H200; got {device.device_kind}.")
  if any(d.platform in ("gpu", "tpu") for d in jax.devices()):
    raise SystemExit(f"An accelerator runtime is visible ({jax.devices()}); this is deviceless.")
  compiler = ", ".join(f"{d} {_version(d)}" for d in XLA_DISTRIBUTIONS)
  title = f"{device.device_kind} (deviceless: {compiler})"
  return NamedSharding(jax.sharding.Mesh(np.array(topo.devices[:1]), ("d",)), P()), title


def _version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def _commit() -> str:
  """The checkout's commit, marked when optax_accum/ has uncommitted changes."""
  root = Path(oa.__file__).resolve().parents[1]
  try:
    git = ["git", "-C", str(root)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--", "optax_accum"],
                           capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return head + (" with uncommitted changes to optax_accum/" if dirty else "")


def programs(k: int) -> list[tuple[str, str, Any]]:
  """``(key, label, (init, step))`` of every program; ``oa.accumulate`` keys start with ``oa``."""
  out = []
  for name, options, kw in (("mean", {}, {}),
                            ("weighted", {"reduction": "weighted"}, {"weight": 2.0}),
                            ("noise", {"track_noise_scale": True}, {}),
                            ("mean, bf16 buffer", {"accumulator_dtype": jnp.bfloat16}, {})):
    tx = oa.accumulate(k, optax.adam(1e-3), **options)
    key = "oa_" + name.replace(",", "").replace(" ", "_")
    out += [(f"{key}_protocol", f"accumulate {name}: update + apply_updates",
             (tx.init, harness.protocol_step(tx, **kw))),
            (f"{key}_update_and_apply", f"accumulate {name}: update_and_apply",
             (tx.init, harness.fast_step(tx, **kw)))]
  for key, label, tx in (("optax_multisteps", "optax.MultiSteps: update + apply_updates",
                          optax.MultiSteps(optax.adam(1e-3), k)),
                         ("plain", "plain adam", optax.adam(1e-3))):
    out.append((key, label, (tx.init, harness.protocol_step(tx))))
  return out


def compile_all(n_params: int, k: int, sharding: NamedSharding | None) -> list[dict[str, Any]]:
  """Every program at f32 and bf16 params, for the accelerator (``sharding``) or the CPU."""
  rows: list[dict[str, Any]] = []
  for dtype in (jnp.float32, jnp.bfloat16):
    leaf = jax.ShapeDtypeStruct((n_params // LEAVES,), dtype, sharding=sharding)
    params = {f"w{i:02d}": leaf for i in range(LEAVES)}
    param_bytes = n_params * jnp.dtype(dtype).itemsize
    for key, label, (init, step) in programs(k):
      state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                           jax.eval_shape(init, params))
      compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile()
      copies = debug.copies(compiled, min_bytes=param_bytes // LEAVES)
      row = {"program": key, "label": label, "dtype": jnp.dtype(dtype).name,
             "conditionals": debug.conditionals(compiled),
             "copies": sum(not c.fill for c in copies),
             "temps_ratio": compiled.memory_analysis().temp_size_in_bytes / param_bytes,
             "bytes_per_param_held": harness.peak_bytes(compiled) / n_params}
      if key.startswith("oa_"):  # 1.05x where f32 updates leave a bf16 buffer (protocol, f32)
        limit = TEMPS_LIMIT + (key == "oa_mean_bf16_buffer_protocol" and dtype == jnp.float32)
        row.update(temps_limit=limit, met=row["conditionals"] >= 1 and row["temps_ratio"] <= limit)
      rows.append(row)
  return rows


def table(rows: list[dict[str, Any]], expect: bool) -> list[str]:
  def verdict(r: dict[str, Any]) -> str:
    if "met" not in r:
      return "-"
    note = "" if r["temps_limit"] == TEMPS_LIMIT else f" (<= {r['temps_limit']}x by design)"
    return ("met" if r["met"] else "**differs**") + note

  head = "program | params | conditionals | data copies | temps / params | bytes held / param"
  return harness.table(
      head + (f" | temps <= {TEMPS_LIMIT}x, conditional kept" if expect else ""),
      "llrrrr" + "l" * expect,
      [[r["label"], r["dtype"], r["conditionals"], r["copies"], f"{r['temps_ratio']:.2f}x",
        f"{r['bytes_per_param_held']:.1f}",
        *([verdict(r)] if expect else [])] for r in rows])


def markdown(result: dict[str, Any]) -> str:
  meta = result["meta"]
  return "\n".join([
      "# Deviceless H200 compile check", "",
      f"`{meta['command']}` (Python {meta['python']}), {meta['date']};"
      f" optax_accum {meta['commit']}."
      " Train steps `step(params, state, grads) -> (params, state)`, params and state donated,"
      f" adam, window k = {meta['k']}, {size_label(meta['params'])} params in {LEAVES} leaves;"
      " one compiled program per row (mid and emitting steps are its two runtime paths)."
      " Counted with `optax_accum.debug`; bytes held: `harness.peak_bytes` over the"
      " parameter count.", "",
      f"## {result['target']}", "", *table(result["accelerator"], expect=True), "",
      f"## CPU (same process: jaxlib {meta['versions']['jaxlib']})", "",
      *table(result["cpu"], expect=False), "",
      "0 conditionals: XLA turned the window's `lax.cond` into selects, and the inner"
      " optimizer runs on every step (as `optax.MultiSteps` does by design).", ""])


def main(argv: list[str] | None = None) -> None:
  """Writes the results; exits with status 1 where an H200 program misses what it expects."""
  ap = harness.parser(__doc__)
  ap.add_argument("--setup", action="store_true", help="print the venv setup and exit")
  args = ap.parse_args(argv)
  if args.setup:
    print(SETUP)
    return
  sharding, title = target()
  n = 4 * 2**20  # in LEAVES equal leaves
  meta = harness.machine()
  result = {
      "meta": {"command": " ".join(["python benchmarks/gpu_hlo.py", *(argv or sys.argv[1:])]),
               "python": sys.version.split()[0], "date": meta["date"], "commit": _commit(),
               "params": n, "k": K_WINDOW,
               "versions": {d: _version(d) for d in (*XLA_DISTRIBUTIONS, "optax")}},
      "target": title,
      "accelerator": compile_all(n, K_WINDOW, sharding),
      "cpu": compile_all(n, K_WINDOW, None),
  }
  harness.write(args.out, "gpu_hlo", result, markdown(result))
  if not all(r.get("met", True) for r in result["accelerator"]):
    raise SystemExit(1)


if __name__ == "__main__":
  main()
