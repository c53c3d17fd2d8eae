"""Deviceless GPU compile check: what XLA's H200 compiler makes of each train step.

XLA's GPU compiler runs without a GPU: the CUDA PJRT plugin can compile for a
*topology* described by a target config (the device's properties as text), so
a CPU machine can see the optimized HLO and the buffer assignment that an H200
would run. This script compiles the train steps of ``gpu.py`` /
``bench_accumulate.py`` (``step(params, state, grads) -> (params, state)``,
params and state donated; adam; window k = 4; 4M f32 params in 8 leaves: the
HLO structure hardly depends on the size) for the H200 and, in the same
process, for this machine's CPU backend, and reports per compiled program:

* ``conditionals``: HLO ``conditional`` instructions. XLA's GPU pipeline can
  rewrite a ``lax.cond`` whose branches are cheap elementwise work into
  ``select``s; then both branches (the inner optimizer included) run on every
  step;
* temporaries / parameter bytes (``memory_analysis().temp_size_in_bytes``);
* parameter-sized copies (``copy`` instructions of a whole leaf, outside
  fusions), split into data copies (a parameter, the buffer, optimizer state:
  the ones to avoid) and fills (a zero broadcast written into a buffer);
* bytes aliased (donated inputs reused as outputs) / parameter bytes;
* kernels and parameter-sized passes of a mid-step and of an emitting step
  (``debug.step_kernels``, ``debug.step_bytes``): the passes are the bytes
  the step's kernels read and write over the parameter bytes, so an emitting
  step's passes over the plain adam step's, compiled for the same backend, is
  the bandwidth-bound ratio that backend allows. The two reference programs
  of ``bench_accumulate.py`` are compiled too.

Counting uses ``optax_accum.debug`` (``conditionals``, ``copies``,
``opcodes``, ``step_kernels``, ``step_bytes``), the package's one HLO reader. Only
compilation happens here: nothing is timed, so the output is deterministic for
given JAX/XLA builds and a given ``optax_accum``.

Setup (a separate venv; ``python benchmarks/gpu_hlo.py --setup`` prints it)::

  python -m venv /tmp/gpuvenv
  /tmp/gpuvenv/bin/pip install jax==0.10.2 jaxlib==0.10.2 jax-cuda12-plugin==0.10.2 \\
      optax==0.2.8
  /tmp/gpuvenv/bin/pip install --no-deps jax-cuda12-pjrt==0.11.2
  /tmp/gpuvenv/bin/pip install --no-deps -e .      # this repository

``jax-cuda12-pjrt==0.11.2`` carries the same XLA GPU compiler as JAX 0.11.2
(the version on the H200 machine); the CPU backend is jaxlib 0.10.2's, as in
the project's normal venv. The script sets ``CUDA_VISIBLE_DEVICES=-1`` and
``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` before importing jax.

Run::

  /tmp/gpuvenv/bin/python benchmarks/gpu_hlo.py       # writes results/gpu_hlo.{json,md}
  /tmp/gpuvenv/bin/python benchmarks/gpu_hlo.py --size 1M --out /tmp/x

It fails (exit 2, printing the setup) if the CUDA plugin cannot compile for
the H200 target.

TPU: ``--tpu v5e:2x2`` (or ``v4:2x2x1``, ``v5p:2x2x1``) compiles the same
programs for one chip of a deviceless TPU topology with libtpu's compiler
instead, and writes ``results/tpu_hlo.{json,md}``. Its venv::

  python -m venv /tmp/tpuvenv
  /tmp/tpuvenv/bin/pip install "jax[tpu]==0.10.2" optax==0.2.8
  /tmp/tpuvenv/bin/pip install --no-deps -e .      # this repository
  /tmp/tpuvenv/bin/python benchmarks/gpu_hlo.py --tpu v5e:2x2
"""

from __future__ import annotations

import os

# Before jax is imported: no GPU runtime (deviceless), and no check that a CUDA
# installation matching the plugin exists.
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"

import argparse
import datetime
import importlib.metadata
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum as oa

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_accumulate as ba
import harness

from optax_accum import debug as oa_debug

Tree = Any

# The H200's properties for XLA's GPU compiler (a stream_executor
# GpuTargetConfigProto in text form): SM 9.0, 132 SMs, 4.8 TB/s, 50 MiB L2,
# CUDA runtime 12.8, cuDNN 9.7.
H200_TEXT = """\
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150000000000
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 7 }
runtime_version { major: 12 minor: 8 patch: 0 }
device_description_str: "NVIDIA H200"
"""

SETUP = """\
python -m venv /tmp/gpuvenv
/tmp/gpuvenv/bin/pip install jax==0.10.2 jaxlib==0.10.2 jax-cuda12-plugin==0.10.2 optax==0.2.8
/tmp/gpuvenv/bin/pip install --no-deps jax-cuda12-pjrt==0.11.2
/tmp/gpuvenv/bin/pip install --no-deps -e .      # from the repository root
/tmp/gpuvenv/bin/python benchmarks/gpu_hlo.py"""

# What the design must compile to on the GPU: every optax_accum program keeps
# both its conditionals (the buffer write on mid-steps, the inner optimizer on
# emitting steps) and copies no parameter-sized buffer. The script exits with
# status 1 otherwise. (The weighted rule needs no third one: a window of total
# weight 0 closes without taking the emitting branch.)
OURS = ("accumulate", "chain", "update_and_apply", "oa_multisteps", "accumulate_update_level",
        "accumulate_weighted", "accumulate_noise")
EXPECTED_GPU_CONDITIONALS = dict.fromkeys(OURS, 2)
# And no parameter-sized temporaries (the updates ride in the buffer); on a
# TPU the noise-tracking program keeps the window's sum in the buffer and
# returns the updates from the conditional (libtpu holds less that way).
TEMPORARIES_ALLOWED = {"GPU": (), "TPU": ("accumulate_noise",)}


def print_setup() -> None:
  """Prints the commands that build the venv this script runs in."""
  print(SETUP)


# ------------------------------------------------------------------ backends
def h200_sharding() -> tuple[NamedSharding, dict[str, Any]]:
  """A replicated sharding on a deviceless one-H200 topology, and its facts."""
  from jax.experimental import topologies

  try:
    topo = topologies.get_topology_desc(platform="cuda", target_config=H200_TEXT,
                                        topology="1x1x1")
  except Exception as e:  # no CUDA plugin, or one that cannot compile deviceless
    print(f"Cannot build the deviceless CUDA topology: {type(e).__name__}: {e}\n"
          "Set up the venv this script needs:\n", file=sys.stderr)
    print(SETUP, file=sys.stderr)
    raise SystemExit(2) from e
  device = topo.devices[0]
  facts = {"platform": device.platform, "device_kind": device.device_kind,
           "runtime_devices": [str(d) for d in jax.devices()]}
  if device.platform != "gpu" or "H200" not in device.device_kind:
    raise SystemExit(f"Expected a deviceless NVIDIA H200 topology; got {facts}.")
  if any(d.platform == "gpu" for d in jax.devices()):
    raise SystemExit(f"A GPU runtime is visible ({jax.devices()}); this check is deviceless.")
  mesh = topologies.make_mesh(topo, (1,), ("d",))
  return NamedSharding(mesh, P()), facts


def tpu_sharding(topology: str) -> tuple[NamedSharding, dict[str, Any]]:
  """A replicated sharding on one chip of a deviceless TPU topology, and its facts."""
  from jax.experimental import topologies

  try:
    topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
  except Exception as e:  # no libtpu, or an unknown topology
    print(f"Cannot build the deviceless TPU topology {topology!r}: {type(e).__name__}: {e}\n"
          "Set up the venv this needs (see this file's docstring).", file=sys.stderr)
    raise SystemExit(2) from e
  device = topo.devices[0]
  facts = {"platform": device.platform, "device_kind": device.device_kind,
           "topology": topology, "runtime_devices": [str(d) for d in jax.devices()]}
  if device.platform != "tpu":
    raise SystemExit(f"Expected a deviceless TPU topology; got {facts}.")
  mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("d",))
  return NamedSharding(mesh, P()), facts


def _version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def _source_revision() -> dict[str, Any]:
  """The ``optax_accum`` being compiled: its path, git commit, uncommitted changes."""
  root = Path(oa.__file__).resolve().parents[1]
  info: dict[str, Any] = {"optax_accum_path": str(Path(oa.__file__).resolve().parent)}
  try:
    info["git_commit"] = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
        check=True).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(root), "status", "--porcelain", "--", "optax_accum"],
        capture_output=True, text=True, check=True).stdout.strip()
    info["optax_accum_uncommitted_changes"] = bool(dirty)
  except (OSError, subprocess.CalledProcessError):
    info["git_commit"] = None
  return info


# ------------------------------------------------------------------ counting
def analyse(compiled: Any, param_bytes: int, leaf_bytes: int) -> dict[str, Any]:
  """The per-program facts of the table."""
  mem = compiled.memory_analysis()
  conds = oa_debug.conditionals(compiled)
  cps = [{"computation": c.computation, "fill": c.fill}
         for c in oa_debug.copies(compiled, min_bytes=leaf_bytes) if c.bytes == leaf_bytes]
  where: dict[str, int] = {}
  for c in cps:
    key = f"{'fill' if c['fill'] else 'data'} in {c['computation']}"
    where[key] = where.get(key, 0) + 1
  return {
      "conditionals": conds,
      "temps_bytes": int(mem.temp_size_in_bytes),
      "temps_ratio": mem.temp_size_in_bytes / param_bytes,
      "alias_bytes": int(mem.alias_size_in_bytes),
      "alias_ratio": mem.alias_size_in_bytes / param_bytes,
      "param_sized_copies_data": sum(not c["fill"] for c in cps),
      "param_sized_copies_fill": sum(c["fill"] for c in cps),
      "copies_where": ", ".join(f"{n} {k}" for k, n in sorted(where.items())) or "none",
      "selects": oa_debug.opcodes(compiled).get("select", 0),
      **kernel_launches(compiled),
      **bytes_moved(compiled, param_bytes),
  }


def kernel_launches(compiled: Any) -> dict[str, int]:
  """Kernels a mid-step and an emitting step launch (``debug.step_kernels``).

  On a dispatch-bound small model every launch (and each conditional's
  predicate, read on the host) is host time.
  """
  count = oa_debug.step_kernels(compiled)
  return {"kernels_mid": count["mid"], "kernels_emit": count["emit"]}


def bytes_moved(compiled: Any, param_bytes: int) -> dict[str, float]:
  """Parameter-sized passes of a mid-step and an emitting step (``debug.step_bytes``).

  The bytes the step's kernels read and write, over the parameter bytes: the
  compiled program's own pass count (no cache reuse between kernels). NaN
  without an ``optax_accum.debug`` that has ``step_bytes``.
  """
  moved = oa_debug.step_bytes(compiled)
  return {"passes_mid": moved["mid"] / param_bytes, "passes_emit": moved["emit"] / param_bytes}


# ------------------------------------------------------------------ programs
def update_level_program(k: int) -> ba.Program:
  """``tx.update`` alone (state donated, state first in the outputs)."""
  tx = oa.accumulate(k, optax.adam(1e-3))

  def step(state: Any, grads: Tree, params: Tree) -> tuple[Any, Tree]:
    updates, state = tx.update(grads, state, params)
    return state, updates

  return ba.Program("accumulate_update_level", k, step, tx.init)


def option_program(key: str, k: int, **options: Any) -> ba.Program:
  """``oa.accumulate(k, adam, **options)``: update + apply_updates."""
  tx = oa.accumulate(k, optax.adam(1e-3), **options)
  kw = {"weight": 2.0} if options.get("reduction") == "weighted" else {}

  def step(params: Tree, state: Any, grads: Tree) -> tuple[Tree, Any]:
    updates, state = tx.update(grads, state, params, **kw)
    return optax.apply_updates(params, updates), state

  return ba.Program(key, k, step, tx.init)


LABELS = {**dict(ba.PROGRAMS),
          "accumulate_update_level": "oa.accumulate: tx.update alone (update level)",
          "accumulate_weighted": 'oa.accumulate(k, opt, reduction="weighted"): update + apply',
          "accumulate_noise": "oa.accumulate(k, opt, track_noise_scale=True): update + apply"}


def compile_all(n_params: int, k: int, sharding: NamedSharding | None) -> list[dict[str, Any]]:
  """Compiles every program for the H200 (``sharding`` given) or the CPU (None)."""
  params = ba.make_tree(n_params)
  pbytes = 4 * n_params
  leaf_bytes = pbytes // ba.LEAVES

  def abstract(tree: Tree) -> Tree:
    kw = {} if sharding is None else {"sharding": sharding}
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, **kw), tree)

  p_abs = abstract(jax.eval_shape(lambda: params))
  rows = []
  programs: list[tuple[ba.Program, Callable[[Any], tuple], tuple[int, ...]]] = [
      (prog, lambda s: (p_abs, s, p_abs), (0, 1))
      for prog in ba.make_programs("adam", k, references=True)]
  programs.append((update_level_program(k), lambda s: (s, p_abs, p_abs), (0,)))
  for prog in (option_program("accumulate_weighted", k, reduction="weighted"),
               option_program("accumulate_noise", k, track_noise_scale=True)):
    programs.append((prog, lambda s: (p_abs, s, p_abs), (0, 1)))
  for prog, args_of, donate in programs:
    state = abstract(jax.eval_shape(prog.init, params))
    compiled = jax.jit(prog.step, donate_argnums=donate).lower(*args_of(state)).compile()
    rows.append({"program": prog.key, "label": LABELS[prog.key],
                 "donated": "params, state" if donate == (0, 1) else "state",
                 **analyse(compiled, pbytes, leaf_bytes)})
  return rows


# ------------------------------------------------------------------- reports
def table(rows: list[dict[str, Any]]) -> list[str]:
  plain = next((r["passes_emit"] for r in rows if r["program"] == "plain"), float("nan"))
  lines = ["| program | donated | conditionals | temps / params | param-sized copies:"
           " data / fill (where) | aliased / params | select ops (incl. fused) |"
           " kernels: mid / emit | passes (P): mid / emit | emit / plain step's passes |",
           "|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(
        f"| {r['label']} | {r['donated']} | {r['conditionals']} | {r['temps_ratio']:.2f}x |"
        f" {r['param_sized_copies_data']} / {r['param_sized_copies_fill']}"
        f" ({r['copies_where']}) | {r['alias_ratio']:.2f}x | {r['selects']} |"
        f" {r['kernels_mid']} / {r['kernels_emit']} |"
        f" {r['passes_mid']:.1f} / {r['passes_emit']:.1f} | {r['passes_emit'] / plain:.2f}x |")
  return lines


def markdown(result: dict[str, Any]) -> str:
  meta = result["meta"]
  lines = [
      f"# Deviceless {result['target']['kind']} compile check",
      "",
      f"`{meta['command']}` (interpreter `{meta['python']}`), {meta['date']}."
      " Train steps `step(params, state, grads) -> (params, state)` (params and state"
      f" donated), adam, window k = {meta['k']},"
      f" {ba.size_label(meta['params'])} f32 params in {meta['leaves']} leaves; one compiled"
      " program per row (mid and emitting steps are its two runtime paths). Counting:"
      f" {meta['counter']}. optax_accum: commit {meta['source'].get('git_commit')}"
      + (" **with uncommitted changes to optax_accum/**"
         if meta["source"].get("optax_accum_uncommitted_changes") else "") + ".",
      "",
      f"## {result['target']['title']}",
      "",
      *table(result["accelerator"]),
      "",
      f"## CPU (same process: jaxlib {meta['versions']['jaxlib']} CPU backend)",
      "",
      *table(result["cpu"]),
      "",
      "## Expectations (the script exits with status 1 when one differs)",
      "",
      f"| program | expected on the {result['target']['kind']} | got | |",
      "|---|---:|---:|---|",
  ]
  for e in result["expectations"]:
    lines.append(f"| {e['program']} | {e['expected']} | {e['got']} |"
                 f" {'as expected' if e['met'] else '**differs**'} |")
  lines += ["", "0 conditionals means XLA turned the `lax.cond` into selects: the inner"
            " optimizer's arithmetic runs on every mid-step. Passes: the bytes each step's"
            " kernels read and write over the parameter bytes"
            " (`optax_accum.debug.step_bytes`: every operand and result once per kernel,"
            " no cache reuse); the last column divides an emitting step's by the plain"
            " adam step's, compiled for the same backend.", ""]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--setup", action="store_true", help="print the venv setup and exit")
  ap.add_argument("--size", default="4M", help="f32 params, e.g. 4M (8 equal leaves)")
  ap.add_argument("--k", type=int, default=ba.K_WINDOW, help="accumulation window")
  ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
  ap.add_argument("--tpu", metavar="TOPOLOGY", default=None,
                  help="compile for one chip of this deviceless TPU topology (e.g. v5e:2x2)")
  args = ap.parse_args(argv)
  if args.setup:
    print_setup()
    return {}
  if args.tpu:
    sharding, gpu_facts = tpu_sharding(args.tpu)
    target = {"kind": "TPU", "stem": "tpu_hlo",
              "title": f"{gpu_facts['device_kind']} (deviceless: libtpu {_version('libtpu')},"
                       f" topology `{args.tpu}`, one chip)"}
  else:
    sharding, gpu_facts = h200_sharding()
    target = {"kind": "GPU", "stem": "gpu_hlo",
              "title": f"H200 (deviceless: jax-cuda12-pjrt {_version('jax-cuda12-pjrt')},"
                       f" target `{gpu_facts['device_kind']}`)"}
  n = ba.parse_size(args.size)
  gpu_rows = compile_all(n, args.k, sharding)
  cpu_rows = compile_all(n, args.k, None)
  by_key = {r["program"]: r for r in gpu_rows}
  expectations = []
  for p, want in EXPECTED_GPU_CONDITIONALS.items():
    row = by_key[p]
    no_temps = p not in TEMPORARIES_ALLOWED[target["kind"]]
    expected = f"{want} conditionals, 0 data copies" + (", temps ~0" if no_temps else "")
    got = f"{row['conditionals']} conditionals, {row['param_sized_copies_data']} data copies"
    met = row["conditionals"] == want and row["param_sized_copies_data"] == 0
    if no_temps:
      got += f", temps {row['temps_ratio']:.2f}x"
      met = met and row["temps_ratio"] <= 0.05
    expectations.append({"program": p, "expected": expected, "got": got, "met": met})
  result = {
      "meta": {
          "command": " ".join(["python benchmarks/gpu_hlo.py",
                               *(argv if argv is not None else sys.argv[1:])]),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "python": sys.executable, "params": n, "leaves": ba.LEAVES, "k": args.k,
          "optimizer": "adam",
          "counter": "optax_accum.debug",
          "versions": {d: _version(d) for d in ("jax", "jaxlib", "jax-cuda12-plugin",
                                                "jax-cuda12-pjrt", "libtpu", "optax")},
          "source": _source_revision(),
          "cpu_backend": "same process (jaxlib CPU backend)",
      },
      "target": target,
      "accelerator_backend": gpu_facts,
      "accelerator": gpu_rows,
      "cpu": cpu_rows,
      "expectations": expectations,
  }
  harness.write(args.out, target["stem"], result, markdown(result))
  return result


if __name__ == "__main__":
  out = main()
  if out and not all(e["met"] for e in out["expectations"]):
    raise SystemExit(1)
