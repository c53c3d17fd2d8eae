"""The benchmark for one GPU or TPU: train steps, a transformer too large for one step, its k.

Sizes come from the device's memory; what does not fit is a row, never a crash (NOTES.md).

  python benchmarks/accelerator.py --out DIR    # DIR/<backend>.{json,md,png}
  python benchmarks/accelerator.py --cpu-smoke  # tiny sizes on the CPU: checks the script
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_accumulate as ba
import bench_microbatched as bm
import harness
import jax
import jax.numpy as jnp
import numpy as np

import optax_accum as oa

HEADROOM = 0.9  # programs are sized within this fraction of the device's memory
TRANSFORMER = {"d_model": 1024, "heads": 16, "layers": 4, "seq": 512, "vocab": 8192, "batch": 64}
SMOKE = {"d_model": 32, "heads": 2, "layers": 1, "seq": 16, "vocab": 64, "batch": 512}
LIMITS = {"update_and_apply_mid": 1.15, "accumulate_mid": 1.7, "update_and_apply_emit": 1.15}
PRECISION = {"tpu": "bf16 passes for f32 matmuls", "gpu": "TF32 (NVIDIA)", "cpu": "full f32"}


def gib(n_bytes: float | None) -> str:
  return "?" if n_bytes is None else f"{n_bytes / 2**30:.3g}"


def oom_bytes(error: Exception) -> int | None:
  """The bytes an out-of-memory error names (TPU compiler: "Used 23.65G of 15.48G hbm", "HLO
  temporaries (16.00G)"; allocators: "allocate 1.00G", "allocate N bytes"), None if none;
  other errors are raised."""
  if not any(marker in str(error).lower() for marker in ("resource_exhausted", "out of memory")):
    raise error
  m = re.search(r"(?:Used |allocate |reserve |temporaries \()([\d.]+)([KMGT]?)", str(error))
  if m is None:
    print("out of memory, no size named:", str(error)[:300], flush=True)
  return None if m is None else int(float(m[1]) * 1024 ** " KMGT".index(m[2] or " "))


def compile_fit(fn: Callable[..., Any], args: Any, donate: tuple[int, ...] = ()) -> dict:
  """``fn`` compiled on ``args`` and its peak; no program where the compiler ran out of memory."""
  try:
    compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
  except Exception as e:  # XlaRuntimeError, whose module moves between jax versions
    return {"compiled": None, "peak": oom_bytes(e)}
  return {"compiled": compiled, "peak": harness.peak_bytes(compiled),
          "temp": compiled.memory_analysis().temp_size_in_bytes}


def accumulation(limit: int, rounds: int, windows: int,
                 log: Callable[[str], None]) -> dict[str, Any]:
  """The train steps at the largest power-of-two size whose most demanding program fits, and
  at 1/16 and 1/256 of it: one program at a time (its carry freed before the next is built)
  with the copy (its 3P floor) in the same rounds, so that only its state is resident; at
  most ``windows`` windows a round."""
  budget, programs, probed = HEADROOM * limit, ba.make_programs("adam"), {}
  copy = ba.CopyTimer(min(2**30, limit // 32) // 4 * 4)

  def need(size: int) -> float:  # held while timing: the largest peak, params, copy buffers
    if size not in probed:
      probed[size] = {p.key: compile_fit(p.step, jax.eval_shape(lambda p=p: (
          ba.make_tree(size), p.init(ba.make_tree(size)), ba.make_tree(size))), (0, 1))
          for p in programs}
    peaks = [fit["peak"] if fit["compiled"] else math.inf for fit in probed[size].values()]
    return max(peaks) + 4 * size + copy.bytes_moved

  largest = 2 ** round(math.log2(budget / 40))  # a guess, so that two sizes compile: 40 B a param
  while need(largest) <= budget and need(2 * largest) <= budget:
    largest *= 2
  while need(largest) > budget:
    largest //= 2
  key, fit = max(probed[2 * largest].items(), key=lambda kv: kv[1]["peak"] or math.inf)
  sizing = [f"{ba.size_label(2 * largest)} params: does not fit: {ba.PROGRAMS[key]}'s compiled"
            f" peak {gib(fit['peak'])} GiB + params + copy buffers > {gib(budget)} GiB"]
  records = []
  for size in (largest // 256, largest // 16, largest):
    timers, copies, _ = [], {}, need(size)  # (compiles its programs, on shapes)
    try:
      params, grads = ba.make_tree(size), ba.make_tree(size, fill=1e-3)
      for p in programs:
        timers.append(ba.compile_program(p, params, grads, probed[size][p.key]["compiled"]))
        copies[p.key] = ba.run_rounds(timers[-1:], copy, rounds,
                                      max(2, min(windows, 2**26 // size)))
        timers[-1].carry = []  # frees its params and state
    except Exception as e:
      sizing.append(f"{ba.size_label(size)} params: out of memory at run time"
                    f" ({gib(oom_bytes(e))} GiB asked)")
      continue
    records += ba.summarize(timers, copies, copy.bytes_moved, size, "adam")
    log(f"{ba.size_label(size)} params timed")
  timed = sorted({r["size"] for r in records})
  result = ba.result(timed, ["adam"], rounds, copy, records, largest, LIMITS)
  ours = [r["ratio_optax_multisteps"] for r in records if r["size"] == largest
          and r["program"] in ("accumulate", "update_and_apply", "oa_multisteps")]
  result["tracked"].append({"name": "slowest oa row / optax.MultiSteps, same phase", "limit": 1.0,
                            "value": max(ours, default=None), "passed": max(ours, default=2) <= 1})
  return {**result, "sizing": sizing}


def transformer(tf: dict[str, int], limit: int, iters: int, log: Callable[[str], None]) -> dict:
  """The global batch doubled from ``tf["batch"]`` until its full step needs more than twice
  ``limit`` (k / 2 is then microbatched too); rows at k = 1, k / 2 and k, the smallest k whose
  compiled peak is within :data:`HEADROOM` of ``limit`` (every candidate compiled: the peaks
  need not fall as k grows)."""
  params = jax.jit(functools.partial(bm.init_params, vocab=tf["vocab"], d_model=tf["d_model"],
                                     layers=tf["layers"], seq=tf["seq"]))(jax.random.key(0))
  vg, batch = jax.value_and_grad(bm.make_loss(heads=tf["heads"], remat=False)), tf["batch"]
  while (full := compile_fit(vg, (params, {"tokens": jax.ShapeDtypeStruct(
      (batch, tf["seq"]), jnp.int32)})))["peak"] is not None and full["peak"] <= 2 * limit:
    batch *= 2
  log(f"transformer: global batch {batch}, full step {gib(full['peak'])} GiB")
  data = {"tokens": jax.random.randint(jax.random.key(1), (batch, tf["seq"]), 0, tf["vocab"])}
  micro, args = functools.cache(lambda k: oa.microbatched(vg, k)), (params, data)
  fits = {1: full} | {j: compile_fit(micro(j), args) for j in (2**i for i in range(1, 7))
                      if batch % j == 0}  # (k = 1: the full step, compiled above)
  peaks = {j: fit["peak"] for j, fit in fits.items()}
  k = min((j for j, fit in fits.items() if fit["compiled"] and fit["peak"] <= HEADROOM * limit),
          default=None)
  log(f"compiled peaks (GiB): {', '.join(f'k={j} {gib(p)}' for j, p in peaks.items())}; k = {k}")
  if k is None:
    raise SystemExit(f"transformer: no k in {list(fits)} fits within {gib(limit)} GiB.")
  half = k // 2
  # The reference: the float64 mean of plain jax.value_and_grad on k slices, at "highest".
  with jax.default_matmul_precision("highest"):
    parts = [jax.jit(vg)(params, {"tokens": t}) for t in jnp.split(data["tokens"], k)]
  mean = lambda *xs: np.mean(np.asarray(xs, np.float64), axis=0).astype(np.float32)
  ref = float(mean(*[v for v, _ in parts])), jax.tree.map(mean, *[g for _, g in parts])
  del parts

  def row(name: str, k: int, fit: dict[str, Any]) -> dict[str, Any]:
    """``fit``'s program, run if it fits: its step time, loss and gradient against ``ref``."""
    row = {"config": name, "k": k, "peak": fit["peak"], "temp": fit.get("temp"), "ran": False}
    if fit["compiled"] is None or fit["peak"] > limit:
      by = "" if fit["compiled"] else " (the compiler)"
      return {**row, "status": f"does not fit{by}: {gib(fit['peak'])} GiB needed"}
    try:
      loss, grads = fit["compiled"](*args)
      row.update(loss_diff=abs(float(loss) / ref[0] - 1), grad_diff=harness.rel_diff(grads, ref[1]))
      del loss, grads
      secs = harness.interleaved({0: lambda: jax.block_until_ready(fit["compiled"](*args))}, iters)
    except Exception as e:
      return {**row, "status": f"out of memory at run time ({gib(oom_bytes(e))} GiB asked)"}
    return {**row, "ran": True, "status": "ran", "step_ms": 1e3 * harness.median(secs[0])}

  rows = [row("full batch", 1, full)]
  rows += [row(f"microbatched k={j}", j, fits[j]) for j in sorted({max(2, half), k})]
  k_high = 2 * k if batch % (2 * k) == 0 else k  # ("highest" holds more)
  with jax.default_matmul_precision("highest"):
    rows.append(row(f'k={k_high}, matmuls "highest"', k_high, compile_fit(micro(k_high), args)))
  ran = {r["k"]: r["ran"] for r in rows[:-1]}
  verdict = ("exact: k ran, k / 2 did not" if ran[k] and not ran[max(1, half)] else
             "one power of two on the safe side: k / 2 ran too" if ran[k] else
             "**wrong**: the chosen k did not run")
  return {"config": tf, "batch": batch, "rows": rows, "k": k, "peaks": peaks, "verdict": verdict,
          "params": sum(x.size for x in jax.tree.leaves(params))}


def markdown(result: dict[str, Any]) -> str:
  meta, tf = result["meta"], result["transformer"]
  return "\n".join([
      f"# {meta['backend'].upper()} benchmark" + (" (a smoke run)" if meta["smoke"] else ""), "",
      f"`python benchmarks/accelerator.py {' '.join(meta['argv'])}` on {meta['device']},"
      f" jax {meta['jax']}, optax {meta['optax']}, {meta['date']}, {meta['wall_s']} s. Memory"
      f" {gib(meta['memory_limit'])} GiB, programs planned within {HEADROOM} of it. Matmul"
      f" precision: {result['precision']}.", "",
      f"## Train steps: adam, k = 4, donated, one program at a time with its copy, {meta['rounds']}"
      " rounds", "", *[f"- {line}" for line in result["sizing"]], "",
      *ba.sections(result, limits="; issue 62's limits"),
      "## A transformer too large for one step, trained microbatched", "",
      f"`bench_microbatched.py`'s model ({json.dumps(tf['config'])[1:-1]}), {tf['params']:,}"
      f" params; its value and gradient at global batch {tf['batch']}, the first power of two"
      " from the config's whose full step needs over twice the memory. Reference: the float64"
      " mean of `jax.value_and_grad` on slices of the chosen k's micro-batch size at matmul"
      " precision \"highest\".", "", *harness.table(
          "config | status | peak (GiB) | temporaries (GiB) | step (ms) | loss rel. diff |"
          " max rel. grad diff", "llrrrrr",
          [[r["config"], r["status"], gib(r["peak"]), gib(r["temp"]),
            *(f"{r[c]:{f}}" if c in r else "-" for c, f in (
                ("step_ms", ".1f"), ("loss_diff", ".1e"), ("grad_diff", ".1e")))]
           for r in tf["rows"]]), "",
      f"## The compiled peaks against the chip: {tf['verdict']}", "",
      f"k = {tf['k']}, the smallest whose compiled peak is within {HEADROOM} of the memory;"
      " peaks (GiB): " + ", ".join(f"k={k} {gib(p)}" for k, p in tf["peaks"].items()), ""])


def main(argv: list[str] | None = None) -> dict[str, Any]:
  ap = harness.parser(__doc__)
  ap.set_defaults(out=None)  # benchmarks/results, or a temp dir with --cpu-smoke
  ap.add_argument("--cpu-smoke", "--quick", dest="smoke", action="store_true", help="tiny sizes"
                  " within --memory-gib (default 1/64), 2 rounds of 2 windows: checks the script")
  ap.add_argument("--memory-gib", type=float, help="in place of the device's bytes_limit")
  args = ap.parse_args(argv)
  if args.smoke:  # checks the script, not its numbers: XLA:CPU compiles twice as fast unoptimized
    os.environ["XLA_FLAGS"] = os.getenv("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
  t_start, backend = time.perf_counter(), jax.default_backend()
  memory_gib = args.memory_gib or (1 / 64 if args.smoke else None)
  limit = int(memory_gib * 2**30) if memory_gib else (
      jax.devices()[0].memory_stats() or {}).get("bytes_limit")
  if not limit:
    raise SystemExit(f"{jax.devices()[0]} reports no bytes_limit: pass --memory-gib.")
  out = args.out or (Path(tempfile.mkdtemp()) if args.smoke else harness.RESULTS)
  precision = jax.config.jax_default_matmul_precision or "default: " + PRECISION.get(backend, "?")

  def log(msg: str) -> None:
    print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)

  log(f"{jax.devices()[0].device_kind}: {gib(limit)} GiB; matmul precision {precision}")
  rounds, windows = (2, 2) if args.smoke else (15, 32)
  result = {**accumulation(limit, rounds, windows, log), "precision": precision}
  result["meta"].update(argv=sys.argv[1:] if argv is None else argv, smoke=args.smoke,
                        memory_limit=limit)
  out.mkdir(parents=True, exist_ok=True)
  (out / f"{backend}.json").write_text(json.dumps(result, indent=1) + "\n")  # partial
  result["transformer"] = transformer(SMOKE if args.smoke else TRANSFORMER, limit,
                                      1 if args.smoke else 3, log)
  result["meta"]["wall_s"] = round(time.perf_counter() - t_start, 1)
  harness.write(out, backend, result, markdown(result), ba.plot)
  return result


if __name__ == "__main__":
  main()
