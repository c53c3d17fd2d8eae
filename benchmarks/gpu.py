"""GPU benchmark: accumulation train steps and in-step microbatching on one GPU.

What is measured (one process; every number comes from this run):

1. **Accumulation train steps** at 1M, 16M and 256M f32 params (8 equal
   leaves), inner optimizer adam, window k = 4, with the machinery of
   ``bench_accumulate.py``: ``step(params, state, grads) -> (params, state)``
   with params and state donated; plain adam, ``oa.accumulate(k, adam)`` +
   ``apply_updates``, ``optax.chain(oa.accumulate(k, None), adam)`` (not large-batch
   training), ``oa.update_and_apply``, ``oa.MultiSteps`` and
   ``optax.MultiSteps``, mid and emitting steps (phases of one compiled
   program, timed call by call with ``jax.block_until_ready`` after a warm-up
   window). Per program: the number of HLO ``conditional``s in
   ``compiled.as_text()`` (XLA's GPU pipeline can turn a ``lax.cond`` into
   selects, and then the inner optimizer runs on every step), compiled
   temporaries, argument leaves, enqueue time (host overhead: at 1M a step is
   dispatch-bound). Floors: bytes a step must move (3P mid, 6P optax-protocol
   mid, 7P adam step; P = parameter bytes) over the copy bandwidth of a 1 GiB
   jitted copy into a donated buffer, measured in the same rounds. Two
   reference programs time the work an emitting step cannot avoid (adam on the
   window's sum; the same in a ``lax.cond`` with the updates going through the
   buffer to ``apply_updates``): emitting rows report their ratio to them.
2. **In-step microbatching**: ``oa.microbatched`` vs the full batch vs
   ``optax.microbatching.microbatch`` (MEAN) on the value-and-grad of a
   transformer (d_model 1024, 4 layers, 16 heads, seq 512, batch 64, vocab
   8192; k = 4 and 16) and an MLP (B = 8192, 1024 -> 3 x 4096 -> 1000; k = 16):
   compiled temporaries over the full batch's, step-time ratio to the full
   batch (interleaved rounds, seeded random order, median of per-round ratios),
   loss and gradient differences to the full batch.
3. **What a conditional costs** a dispatch-bound step: a tiny ``p + g``
   split over 0, 1 or 2 ``lax.cond``s, per-call time (does a
   one-conditional GPU layout pay off? ``benchmarks/NOTES.md``).
4. **Matmul precision**: whether ``jax_default_matmul_precision`` is the
   default (TF32 for f32 matmuls on NVIDIA GPUs since Ampere), and the
   microbatched-vs-full-batch loss and gradient difference under the default
   and under ``"highest"`` (true f32): what "equal to the large batch" means on
   a GPU.

Run on a machine with one NVIDIA GPU (aimed at under 4 minutes on an H200)::

  python benchmarks/gpu.py                    # writes benchmarks/results/gpu.{json,md}
  python benchmarks/gpu.py --out "$OUT"       # elsewhere (e.g. a device runner's $OUT)
  python benchmarks/gpu.py --cpu-smoke        # tiny sizes on the CPU: checks the script

Without a GPU it exits with an error unless ``--cpu-smoke`` is given (then it
writes to a temporary directory unless ``--out`` is given). The last thing it
prints is one summary table.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import harness
import jax
import jax.numpy as jnp
import optax
import optax.microbatching

import optax_accum as oa

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_accumulate as ba
import bench_microbatched as bm

Tree = Any
GPU_SIZES = ("1M", "16M", "256M")
SMOKE_SIZES = ("64K", "256K")


# ------------------------------------------------------------------- setup
def require_gpu(cpu_smoke: bool) -> None:
  """Fails loudly without a GPU, unless this is the CPU smoke run."""
  backend = jax.default_backend()
  if cpu_smoke:
    print(f"--cpu-smoke: tiny sizes on backend {backend!r}; numbers are not GPU numbers.")
    return
  if backend != "gpu":
    raise SystemExit(
        f"benchmarks/gpu.py needs a GPU, but jax.default_backend() is {backend!r}"
        f" (devices: {jax.devices()}). Install a CUDA jaxlib on a GPU machine, or pass"
        " --cpu-smoke to check the script at tiny sizes on the CPU.")


def precision_setting() -> dict[str, Any]:
  """The matmul precision in force, and what it means on this backend."""
  value = jax.config.jax_default_matmul_precision
  is_default = value in (None, "default", "DEFAULT")
  on_gpu = jax.default_backend() == "gpu"
  if is_default and on_gpu:
    meaning = "default: f32 matmuls use TF32 on NVIDIA GPUs (Ampere and later)"
  elif is_default:
    meaning = f"default (on {jax.default_backend()}: full f32 matmuls)"
  else:
    meaning = f"set to {value!r}"
  return {"jax_default_matmul_precision": value, "is_default": is_default,
          "env_JAX_DEFAULT_MATMUL_PRECISION": os.environ.get("JAX_DEFAULT_MATMUL_PRECISION"),
          "meaning": meaning}


# ------------------------------------------------------- conditional cost
def conditional_split(n: int) -> Callable[[Tree, Tree, jax.Array], Tree]:
  """A step adding ``g`` into ``p`` (a list of leaves) inside ``n`` ``lax.cond``s.

  Conditional ``i`` adds leaves ``i, i + n, ...`` and every predicate is true,
  so each program does the same arithmetic, once; ``n = 0`` adds outside any
  conditional. A scalar ``optimization_barrier`` in each taken branch keeps
  XLA's GPU compiler from turning it into selects (as optax_accum's branches
  do). The predicates are a runtime argument.
  """
  def add(p: Tree, g: Tree) -> Tree:
    one = jax.lax.optimization_barrier(jnp.float32(1.0))
    return jax.tree.map(lambda x, y: x + y * one.astype(x.dtype), p, g)

  def step(p: list[jax.Array], g: list[jax.Array], flags: jax.Array) -> list[jax.Array]:
    if n == 0:
      return add(p, g)
    out = list(p)
    for i in range(n):
      part = jax.lax.cond(flags[i], add, lambda p, g: p, p[i::n], g[i::n])
      out[i::n] = part
    return out
  return step


def conditional_cost(rounds: int, calls: int, log: Callable[[str], None]) -> list[dict[str, Any]]:
  """Per-call time of a tiny step split over 0, 1 and 2 conditionals.

  What one more conditional costs a dispatch-bound step on this backend
  (on XLA:GPU a conditional's predicate may be read on the host): the open
  question of a one-conditional GPU layout (benchmarks/NOTES.md).
  Interleaved rounds (``harness.interleaved``, seed 2, one warm-up round), a
  fresh random order per round, ``calls`` blocking calls per sample, params
  donated.
  """
  params = list(ba.make_tree(ba.TINY_PARAMS).values())
  grads = list(ba.make_tree(ba.TINY_PARAMS, fill=1e-3).values())
  progs = {}
  for n in (0, 1, 2):
    flags = jnp.ones(max(n, 1), bool)
    compiled = jax.jit(conditional_split(n), donate_argnums=(0,)).lower(
        params, grads, flags).compile()
    progs[n] = {"compiled": compiled, "flags": flags, "carry": jax.tree.map(jnp.copy, params),
                "conditionals": oa.debug.conditionals(compiled)}

  def run(prog: dict[str, Any]) -> None:
    for _ in range(calls):
      prog["carry"] = jax.block_until_ready(prog["compiled"](prog["carry"], grads, prog["flags"]))

  secs = harness.interleaved({n: functools.partial(run, prog) for n, prog in progs.items()},
                             rounds, seed=2)
  for n, prog in progs.items():
    prog["samples"] = [s / calls for s in secs[n]]
  base = progs[0]["samples"]
  rows = [{"conditionals_requested": n, "conditionals": p["conditionals"],
           "call_s": statistics.median(p["samples"]),
           "extra_s": statistics.median([a - b for a, b in zip(p["samples"], base, strict=True)])}
          for n, p in progs.items()]
  log("conditional cost: " + ", ".join(
      f"{r['conditionals']} conds {r['call_s'] * 1e6:.1f} us" for r in rows))
  return rows


# ------------------------------------------------------------ accumulation
def gpu_windows(size: int) -> int:
  """Whole windows per program per round: many at 1M (dispatch-bound), 2 at 256M."""
  return max(2, min(32, (64 * 2**20) // size))


def accumulation(sizes: Sequence[int], rounds: int, copy: ba.CopyTimer,
                 log: Callable[[str], None]) -> list[dict[str, Any]]:
  records: list[dict[str, Any]] = []
  for size in sizes:
    t0 = time.perf_counter()
    recs, compile_s = ba.measure_size(size, "adam", copy, rounds, gpu_windows(size))
    records += recs
    gc.collect()
    get = {r["row"]: r for r in recs}
    log(f"accumulation {ba.size_label(size)}: compile {compile_s:.1f} s, total"
        f" {time.perf_counter() - t0:.1f} s; conditionals: accumulate"
        f" {get['accumulate_mid']['conditionals']}, update_and_apply"
        f" {get['update_and_apply_mid']['conditionals']}")
  return records


# ----------------------------------------------------------- microbatching
def mlp_init(key: jax.Array, d_in: int, width: int, depth: int, classes: int) -> Tree:
  dims = [d_in, *[width] * depth, classes]
  keys = jax.random.split(key, len(dims) - 1)
  return {f"l{i}": {"w": jax.random.normal(k, (a, b), jnp.float32) / math.sqrt(a),
                    "b": jnp.zeros((b,), jnp.float32)}
          for i, (k, a, b) in enumerate(zip(keys, dims[:-1], dims[1:], strict=True))}


def mlp_loss(params: Tree, batch: dict[str, jax.Array]) -> jax.Array:
  """Mean softmax cross-entropy of a ReLU MLP."""
  x = batch["x"]
  n = len(params)
  for i in range(n):
    x = x @ params[f"l{i}"]["w"] + params[f"l{i}"]["b"]
    if i < n - 1:
      x = jax.nn.relu(x)
  logp = jax.nn.log_softmax(x)
  return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=-1))


def grad_fns(loss: Callable, batch_size: int, ks: Sequence[int]) -> dict[str, Callable]:
  """Full batch, ``oa.microbatched`` and ``optax.microbatching.microbatch`` per k."""
  vg = jax.value_and_grad(loss)
  fns: dict[str, Callable] = {"full batch": vg}
  for k in ks:
    fns[f"oa.microbatched k={k}"] = oa.microbatched(vg, k)
  for k in ks:
    fns[f"optax microbatch k={k}"] = optax.microbatching.microbatch(
        vg, argnums=1, microbatch_size=batch_size // k,
        accumulator=optax.microbatching.AccumulationType.MEAN)
  return fns


def _rel_diffs(a: tuple[jax.Array, Tree], b: tuple[jax.Array, Tree]) -> tuple[float, float]:
  """(|loss_a - loss_b| / |loss_b|, max over leaves of max|ga - gb| / max|gb|)."""
  loss_d = float(jnp.abs(a[0] - b[0]) / jnp.abs(b[0]))
  grad_d = max(float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30))
               for x, y in zip(jax.tree.leaves(a[1]), jax.tree.leaves(b[1]), strict=True))
  return loss_d, grad_d


def microbatching(name: str, loss: Callable, params: Tree, batch: dict[str, jax.Array],
                  ks: Sequence[int], rounds: int, iters: int,
                  log: Callable[[str], None]) -> list[dict[str, Any]]:
  """Temporaries, interleaved step-time ratios and differences per config."""
  batch_size = jax.tree.leaves(batch)[0].shape[0]
  t0 = time.perf_counter()
  compiled, outs, rows = [], [], []
  for cfg, fn in grad_fns(loss, batch_size, ks).items():
    c = jax.jit(fn).lower(params, batch).compile()
    out = jax.block_until_ready(c(params, batch))  # first call (warm-up)
    compiled.append(c)
    outs.append(out)
    rows.append({"model": name, "config": cfg,
                 "temp_bytes": int(c.memory_analysis().temp_size_in_bytes),
                 "loss": float(out[0])})
  compile_s = time.perf_counter() - t0
  for c in compiled:  # second warm-up call
    jax.block_until_ready(c(params, batch))
  # Interleaved rounds (harness.interleaved): a fresh seeded random order per
  # round, ``iters`` steps per sample; ratios pair the same round.
  secs = harness.interleaved({i: functools.partial(bm.run_steps, c, params, batch, iters)
                              for i, c in enumerate(compiled)}, rounds, warmup=0)
  times = [[s / iters for s in secs[i]] for i in range(len(compiled))]
  for i, row in enumerate(rows):
    row["temp_ratio_vs_full"] = row["temp_bytes"] / rows[0]["temp_bytes"]
    row["step_ms"] = 1e3 * statistics.median(times[i])
    row["step_ratio_vs_full"] = harness.paired_ratio(times[i], times[0])
    row["loss_rel_diff_vs_full"], row["grad_rel_diff_vs_full"] = _rel_diffs(outs[i], outs[0])
  log(f"{name}: compile + first calls {compile_s:.1f} s, timing"
      f" {time.perf_counter() - t0 - compile_s:.1f} s")
  return rows


def precision_check(name: str, loss: Callable, params: Tree, batch: dict[str, jax.Array],
                    k: int, mb_rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """``oa.microbatched`` vs full batch under the default and "highest" precision.

  The default-precision programs are the ones of the microbatching table
  (``mb_rows``: their differences are reused, not recompiled); the "highest"
  pair is compiled here.
  """
  vg = jax.value_and_grad(loss)
  rows = {r["config"]: r for r in mb_rows if r["model"] == name}
  full_row, micro_row = rows["full batch"], rows[f"oa.microbatched k={k}"]
  out = [{"model": name, "k": k, "precision": "default", "loss_full": full_row["loss"],
          "loss_microbatched": micro_row["loss"],
          "loss_rel_diff": micro_row["loss_rel_diff_vs_full"],
          "grad_rel_diff": micro_row["grad_rel_diff_vs_full"],
          "dots": None, "dots_highest": None}]
  with jax.default_matmul_precision("highest"):
    full_lowered = jax.jit(vg).lower(params, batch)
    micro = jax.jit(oa.microbatched(vg, k)).lower(params, batch).compile()
  full = full_lowered.compile()
  # The precision is fixed at lowering: check that it took.
  dots = [ln for ln in full_lowered.as_text().splitlines() if "dot_general" in ln]
  a = jax.block_until_ready(micro(params, batch))
  b = jax.block_until_ready(full(params, batch))
  loss_d, grad_d = _rel_diffs(a, b)
  out.append({"model": name, "k": k, "precision": "highest",
              "loss_full": float(b[0]), "loss_microbatched": float(a[0]),
              "loss_rel_diff": loss_d, "grad_rel_diff": grad_d,
              "dots": len(dots), "dots_highest": sum("HIGHEST" in ln for ln in dots)})
  return out


# ----------------------------------------------------------------- reports
def _mib(b: float) -> str:
  return f"{b / 2**20:,.1f}"


def markdown(result: dict[str, Any]) -> str:
  meta, bw = result["meta"], result["bandwidth"]
  lines = [
      "# GPU benchmark" + (" (CPU smoke run: not GPU numbers)" if meta["cpu_smoke"] else ""),
      "",
      f"`python benchmarks/gpu.py {' '.join(meta['argv'])}` on {meta['device']}"
      f" (backend {meta['backend']}), jax {meta['jax']}, optax {meta['optax']},"
      f" {meta['date']}, {meta['wall_s']} s. Matmul precision: {result['precision']['meaning']}.",
      "",
      f"Copy bandwidth ({bw['copy_bytes'] // 2 // 2**20} MiB jitted copy into a donated"
      f" buffer, read + write): **{bw['copy_GBps']:.0f} GB/s**. Floors: bytes / that"
      " bandwidth in the same round; 3P train-step mid, 6P optax-protocol mid, 7P adam step."
      f" Train step, params and state donated, window k = {meta['k']}, adam;"
      f" medians over {meta['rounds']} interleaved rounds.",
      "",
  ]
  for size in meta["sizes"]:
    recs = [r for r in result["accumulation"] if r["size"] == size]
    lines += [f"## {ba.size_label(size)} params ({4 * size / 2**20:g} MiB)", "",
              *ba.rows_table(recs), ""]
  lines += ["## Host overhead", "",
            f"Enqueue time (until the call returns) at {ba.size_label(result['enqueue_size'])}"
            " and a tiny model's blocked call time:", "",
            *ba.host_table(result["host_overhead"], result["enqueue"],
                           result["enqueue_size"]), ""]
  lines += ["## What a conditional costs a dispatch-bound step", "",
            f"`p + g` on {ba.TINY_PARAMS} f32 params in {ba.LEAVES} leaves, outside any"
            " conditional or split over 1 or 2 `lax.cond`s (all taken; a barrier keeps"
            " each); blocked calls, medians over interleaved rounds; extra: median of the"
            " per-round difference to 0.", "",
            "| conditionals (compiled) | us per call | extra us |", "|---:|---:|---:|"]
  lines += [f"| {r['conditionals']} | {r['call_s'] * 1e6:.1f} | {r['extra_s'] * 1e6:+.1f} |"
            for r in result["conditional_cost"]]
  lines += [""]
  lines += [f"## Bars of bench_accumulate at {ba.size_label(result['bar_size'])} (for"
            " information; they are set for the CPU at 4M)", "",
            *ba.bars_table(result["bars"]), ""]
  for model in ("transformer", "mlp"):
    setup = result["setup"][model]
    lines += [f"## In-step microbatching: {model}", "",
              ", ".join(f"{k} {v}" for k, v in setup.items()) + ".", "",
              "| config | temporaries (MiB) | vs full | step (ms) | step vs full |"
              " loss rel. diff | grad rel. diff |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["microbatching"]:
      if r["model"] == model:
        lines.append(
            f"| {r['config']} | {_mib(r['temp_bytes'])} | {r['temp_ratio_vs_full']:.3f}x |"
            f" {r['step_ms']:.2f} | {r['step_ratio_vs_full']:.2f}x |"
            f" {r['loss_rel_diff_vs_full']:.1e} | {r['grad_rel_diff_vs_full']:.1e} |")
    lines.append("")
  lines += ["## Microbatched vs full batch under each matmul precision", "",
            "| model | k | precision | loss rel. diff | grad rel. diff | HIGHEST dots / dots |",
            "|---|---:|---|---:|---:|---:|"]
  for p in result["precision_check"]:
    dots = "-" if p["dots"] is None else f"{p['dots_highest']} / {p['dots']}"
    lines.append(f"| {p['model']} | {p['k']} | {p['precision']} | {p['loss_rel_diff']:.1e} |"
                 f" {p['grad_rel_diff']:.1e} | {dots} |")
  lines += ["", "## Summary", "", *summary_table(result), ""]
  return "\n".join(lines)


def summary_table(result: dict[str, Any]) -> list[str]:
  """One table of the key numbers (printed last)."""
  meta = result["meta"]
  big, small = max(meta["sizes"]), min(meta["sizes"])
  by = {(r["size"], r["row"]): r for r in result["accumulation"]}
  lines = ["| measurement | value |", "|---|---|",
           f"| device | {meta['device']} ({meta['backend']}) |",
           f"| matmul precision | {result['precision']['meaning']} |",
           f"| copy bandwidth | {result['bandwidth']['copy_GBps']:.0f} GB/s |"]
  for row in ("floor_mid", "plain", "accumulate_mid", "accumulate_emit", "chain_mid",
              "update_and_apply_mid", "update_and_apply_emit", "oa_multisteps_mid",
              "optax_multisteps_mid", "optax_multisteps_emit", "ref_window_sum",
              "ref_protocol"):
    r = by.get((big, row))
    if r is None:
      continue
    conds = "" if r["conditionals"] is None else f"; conditionals: {r['conditionals']}"
    temps = "" if r["temps_ratio"] is None else f"; temps {r['temps_ratio']:.2f}x params"
    if r.get("compiled_passes") is not None:
      temps += f"; {r['compiled_passes']:.1f}P compiled"
    if r.get("ratio_reference") is not None:
      temps += f"; {r['ratio_reference']:.2f}x its reference"
    lines.append(
        f"| {ba.size_label(big)} {r['label']} | {r['time_s'] * 1e3:.3f} ms ="
        f" {ba._x(r['ratio_floor_mid'])} 3P floor, {ba._x(r['ratio_plain'])} plain,"
        f" {ba._x(r['ratio_optax_multisteps'])} optax.MultiSteps{temps}{conds} |")
  for row in ("plain", "accumulate_mid", "update_and_apply_mid", "optax_multisteps_mid"):
    r = by.get((small, row))
    if r is not None:
      lines.append(f"| {ba.size_label(small)} {r['label']} | {r['time_s'] * 1e6:.0f} us per"
                   f" call, enqueue {r['enqueue_s'] * 1e6:.0f} us, {r['arg_leaves']} leaves |")
  for r in result["conditional_cost"][1:]:
    lines.append(f"| tiny step with {r['conditionals']} conditionals |"
                 f" {r['call_s'] * 1e6:.1f} us per call, {r['extra_s'] * 1e6:+.1f} us |")
  for r in result["microbatching"]:
    if r["config"] != "full batch":
      lines.append(f"| {r['model']}: {r['config']} | temps {r['temp_ratio_vs_full']:.3f}x full,"
                   f" time {r['step_ratio_vs_full']:.2f}x full, loss diff"
                   f" {r['loss_rel_diff_vs_full']:.1e} |")
  for p in result["precision_check"]:
    lines.append(f"| {p['model']} k={p['k']} vs full, precision {p['precision']} | loss diff"
                 f" {p['loss_rel_diff']:.1e}, grad diff {p['grad_rel_diff']:.1e} |")
  lines.append(f"| wall time | {meta['wall_s']} s |")
  return lines


# -------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--cpu-smoke", action="store_true",
                  help="run tiny sizes on the CPU (checks the script; not GPU numbers)")
  ap.add_argument("--rounds", type=int, default=None, help="accumulation rounds (default 15)")
  ap.add_argument("--out", type=Path, default=None,
                  help="output folder (default benchmarks/results; --cpu-smoke: a temp dir)")
  args = ap.parse_args(argv)
  require_gpu(args.cpu_smoke)
  t_start = time.perf_counter()
  smoke = args.cpu_smoke

  def log(msg: str) -> None:
    print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)

  prec = precision_setting()
  log(f"device {jax.devices()[0].device_kind} ({jax.default_backend()}); matmul precision:"
      f" {prec['meaning']}")
  phases: dict[str, float] = {}

  # 1. Accumulation train steps.
  t = time.perf_counter()
  sizes = [ba.parse_size(s) for s in (SMOKE_SIZES if smoke else GPU_SIZES)]
  rounds = args.rounds or (3 if smoke else 15)
  copy = ba.CopyTimer(16 * 2**20, reps=1) if smoke else ba.CopyTimer(2**30, reps=8)
  records = accumulation(sizes, rounds, copy, log)
  host = ba.host_overhead("adam", rounds, windows=16)
  enqueue_size = min(sizes)
  enqueue = {"adam": {r["program"]: r["enqueue_s"] for r in records
                      if r["size"] == enqueue_size and r["program"] is not None
                      and r["phase"] in ("mid", "step")}}
  phases["accumulation_s"] = time.perf_counter() - t

  # 1b. What one conditional costs a dispatch-bound step.
  cond_rows = conditional_cost(rounds=5 if smoke else 20, calls=20 if smoke else 200, log=log)

  # 2. In-step microbatching.
  t = time.perf_counter()
  if smoke:
    tf = {"d_model": 64, "heads": 4, "layers": 2, "seq": 32, "vocab": 128, "batch": 16}
    mlp = {"batch": 256, "d_in": 32, "width": 64, "depth": 2, "classes": 10}
    mb_rounds, mb_iters = 2, 1
  else:
    tf = {"d_model": 1024, "heads": 16, "layers": 4, "seq": 512, "vocab": 8192, "batch": 64}
    mlp = {"batch": 8192, "d_in": 1024, "width": 4096, "depth": 3, "classes": 1000}
    mb_rounds, mb_iters = 5, 2
  tf_params = bm.stack_blocks(bm.init_params(jax.random.key(0), vocab=tf["vocab"],
                                             d_model=tf["d_model"], layers=tf["layers"],
                                             seq=tf["seq"]))
  tf_batch = {"tokens": jax.random.randint(jax.random.key(1), (tf["batch"], tf["seq"]), 0,
                                           tf["vocab"])}
  tf_loss = bm.make_loss(heads=tf["heads"], remat=None, layers_impl="scan")
  mlp_params = mlp_init(jax.random.key(2), mlp["d_in"], mlp["width"], mlp["depth"],
                        mlp["classes"])
  mlp_batch = {"x": jax.random.normal(jax.random.key(3), (mlp["batch"], mlp["d_in"])),
               "y": jax.random.randint(jax.random.key(4), (mlp["batch"],), 0, mlp["classes"])}
  mb_rows = microbatching("transformer", tf_loss, tf_params, tf_batch, (4, 16), mb_rounds,
                          mb_iters, log)
  mb_rows += microbatching("mlp", mlp_loss, mlp_params, mlp_batch, (16,), mb_rounds, mb_iters,
                           log)
  phases["microbatching_s"] = time.perf_counter() - t

  # 3. Precision.
  t = time.perf_counter()
  prec_rows = precision_check("transformer", tf_loss, tf_params, tf_batch, 4, mb_rows)
  prec_rows += precision_check("mlp", mlp_loss, mlp_params, mlp_batch, 16, mb_rows)
  phases["precision_s"] = time.perf_counter() - t
  log("precision check done")

  copy_s = statistics.median(copy.samples)
  bar_size = max(sizes)
  tf_n = sum(x.size for x in jax.tree.leaves(tf_params))
  mlp_n = sum(x.size for x in jax.tree.leaves(mlp_params))
  result: dict[str, Any] = {
      "meta": {
          "argv": list(argv if argv is not None else sys.argv[1:]), "cpu_smoke": smoke,
          "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
          "jax": jax.__version__, "optax": optax.__version__, "sizes": sizes,
          "k": ba.K_WINDOW, "leaves": ba.LEAVES, "rounds": rounds,
          "host": f"{platform.machine()} {os.cpu_count()} CPUs",
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "wall_s": None,
      },
      "precision": prec,
      "bandwidth": {"copy_bytes": copy.bytes_moved, "copy_time_s": copy_s,
                    "copy_GBps": copy.bytes_moved / copy_s / 1e9},
      "accumulation": records,
      "host_overhead": host,
      "enqueue_size": enqueue_size,
      "enqueue": enqueue,
      "bar_size": bar_size,
      "bars": ba.evaluate_bars(records, bar_size),
      "setup": {"transformer": {**tf, "params": int(tf_n), "ks": [4, 16]},
                "mlp": {**mlp, "params": int(mlp_n), "ks": [16]}},
      "conditional_cost": cond_rows,
      "microbatching": mb_rows,
      "precision_check": prec_rows,
      "phase_seconds": phases,
  }
  result["meta"]["wall_s"] = round(time.perf_counter() - t_start, 1)
  out = args.out or (Path(tempfile.mkdtemp(prefix="gpu_smoke_")) if smoke
                     else Path(__file__).parent / "results")
  print()
  harness.write(out, "gpu", result, markdown(result))  # its last table is the summary
  return result


if __name__ == "__main__":
  main()
