"""A bfloat16 accumulation buffer: memory, precision and time, against the float32 one.

Three measurements, each against its anchors in the same run:

1. **Bytes per parameter** of one compiled train step (Adam, k = 4, params and
   state donated, grads an argument): plain Adam, ``optax.MultiSteps``,
   ``accumulate`` with the default and the bfloat16 buffer; f32 and bf16
   params; the optax protocol (update + ``apply_updates``) and
   ``update_and_apply``. From ``compiled.memory_analysis()``: argument +
   output - alias + temporaries, over the parameter count. On XLA:CPU, and on
   the H200 compiler when run from the gpu venv with ``--h200``.
2. **Error of one window** against a float64 reference, for a bfloat16 buffer
   rounding to nearest (what a plain narrow sum does) and rounding
   stochastically (``accumulator_dtype=jnp.bfloat16``), at k = 16, 64, 256,
   1024: gradients ``N(1, 0.5^2)`` per element; bias = mean error over the mean
   |reference|, spread = standard deviation of the error over it.
3. **Mid-step time** of ``update_and_apply`` with the bf16 buffer over the f32
   buffer, XLA:CPU, 4M f32 params, interleaved rounds in one process.

Run::

  python benchmarks/bench_narrow_buffer.py                    # XLA:CPU: all three
  /tmp/gpuvenv/bin/python benchmarks/bench_narrow_buffer.py --h200   # bytes only
  python benchmarks/bench_narrow_buffer.py --quick            # small sizes (tests)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

if "--h200" in sys.argv:
  os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
  os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum as oa

sys.path.insert(0, str(Path(__file__).parent))
import harness

RESULTS = Path(__file__).parent / "results"


def h200_sharding() -> Any:
  """A replicated sharding on a deviceless one-H200 topology (gpu_hlo.py's)."""
  import gpu_hlo
  return gpu_hlo.target(None)[0]


def bytes_per_param(sharding: Any, n: int) -> list[dict[str, Any]]:
  """Rows of table 1: one compiled train step per optimizer, dtype and path."""
  rows = []
  for dtype in (jnp.float32, jnp.bfloat16):
    params = {"w": jnp.zeros((n // 2,), dtype), "v": jnp.zeros((n // 2048, 1024), dtype)}
    count = sum(x.size for x in jax.tree.leaves(params))
    abstract = lambda t: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), t)
    programs = [("plain Adam", optax.adam(1e-3), "protocol"),
                ("optax.MultiSteps", optax.MultiSteps(optax.adam(1e-3), 4), "protocol")]
    for buffer in ("default", "bfloat16"):
      for path in ("protocol", "update_and_apply"):
        dt = None if buffer == "default" else jnp.bfloat16
        programs.append((f"accumulate, {buffer} buffer",
                         oa.accumulate(4, optax.adam(1e-3), accumulator_dtype=dt), path))
    for name, tx, path in programs:
      def step(p: Any, s: Any, g: Any, tx: Any = tx, path: str = path) -> Any:
        if path == "update_and_apply":
          return oa.update_and_apply(tx, g, s, p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s
      state = jax.eval_shape(tx.init, params)
      compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
          abstract(params), abstract(state), abstract(params)).compile()
      m = compiled.memory_analysis()
      peak = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
              + m.temp_size_in_bytes)
      rows.append({"program": name, "path": path, "params": jnp.dtype(dtype).name,
                   "bytes_per_param": peak / count,
                   "temps_per_param_bytes": m.temp_size_in_bytes / (count * dtype(0).nbytes)})
  return rows


def _round_to_nearest_window(grads: np.ndarray) -> np.ndarray:
  """The mean of a bf16 sum rounded to nearest after every add (float32 adds)."""
  add = jax.jit(lambda acc, g: (acc.astype(jnp.float32) + g).astype(jnp.bfloat16))
  acc = jnp.zeros(grads.shape[1], jnp.bfloat16)
  for g in grads:
    acc = add(acc, jnp.asarray(g))
  return np.asarray(acc, np.float64) / len(grads)


def _stochastic_window(grads: np.ndarray) -> np.ndarray:
  """What ``accumulate(k, identity, accumulator_dtype=bfloat16)`` emits."""
  tx = oa.accumulate(len(grads), optax.identity(), accumulator_dtype=jnp.bfloat16)
  params = {"w": jnp.zeros(grads.shape[1])}
  state, update = tx.init(params), jax.jit(tx.update)
  for g in grads:
    out, state = update({"w": jnp.asarray(g)}, state, params)
  return np.asarray(out["w"], np.float64)


def window_errors(ks: list[int], n: int) -> list[dict[str, Any]]:
  """Rows of table 2: bias and spread of one window's mean, per rounding and k."""
  rows = []
  rng = np.random.default_rng(0)
  for k in ks:
    grads = (0.5 * rng.normal(size=(k, n)) + 1.0).astype(np.float32)
    ref = grads.astype(np.float64).mean(axis=0)
    scale = np.abs(ref).mean()
    for rounding, window in (("to nearest", _round_to_nearest_window),
                             ("stochastic", _stochastic_window)):
      err = window(grads) - ref
      rows.append({"k": k, "rounding": rounding, "bias": err.mean() / scale,
                   "spread": err.std() / scale,
                   "bias_standard_error": err.std() / np.sqrt(n) / scale})
  return rows


def mid_step_times(n: int, rounds: int) -> dict[str, Any]:
  """Table 3: ``update_and_apply`` mid-steps, bf16 buffer over f32 buffer."""
  params = {f"w{i}": jnp.full((n // 8,), 0.1) for i in range(8)}
  grads = jax.tree.map(lambda p: p * 0.01, params)
  runs = {}
  for name, dt in (("f32 buffer", None), ("bf16 buffer", jnp.bfloat16)):
    tx = oa.accumulate(1 << 30, optax.adam(1e-3), accumulator_dtype=dt)  # never emits
    step = jax.jit(lambda p, s, g, tx=tx: oa.update_and_apply(tx, g, s, p),
                   donate_argnums=(0, 1))
    box = {"p": jax.tree.map(jnp.copy, params), "s": tx.init(params)}

    def run(step: Any = step, box: dict[str, Any] = box) -> None:
      box["p"], box["s"] = step(box["p"], box["s"], grads)
      jax.block_until_ready(box["s"].acc_grads)
    runs[name] = run
  secs = harness.interleaved(runs, rounds)
  return {"median_ms": {k: 1e3 * harness.median(v) for k, v in secs.items()},
          "bf16_over_f32": harness.paired_ratio(secs["bf16 buffer"], secs["f32 buffer"])}


def markdown(result: dict[str, Any]) -> str:
  lines = [f"# A bfloat16 accumulation buffer ({result['compiler']})", "",
           f"`{result['command']}`; {result['machine']['date']}, jax {result['machine']['jax']},"
           f" load {result['machine']['loadavg']}.", "",
           "## Bytes per parameter of one compiled train step (Adam, k = 4)", "",
           "| program | path | params | bytes / param | temporaries / params |",
           "|---|---|---|---:|---:|"]
  for r in result["bytes"]:
    lines.append(f"| {r['program']} | {r['path']} | {r['params']} | {r['bytes_per_param']:.2f}"
                 f" | {r['temps_per_param_bytes']:.2f}x |")
  if result.get("errors"):
    lines += ["", "## One window's mean against a float64 reference (N(1, 0.5^2) gradients,"
              f" {result['elements']} elements)", "",
              "| k | rounding | bias (/ mean) | its standard error | spread (/ mean) |",
              "|---:|---|---:|---:|---:|"]
    for r in result["errors"]:
      lines.append(f"| {r['k']} | {r['rounding']} | {r['bias']:+.2e} |"
                   f" {r['bias_standard_error']:.1e} | {r['spread']:.2e} |")
  if result.get("time"):
    t = result["time"]
    lines += ["", f"## update_and_apply mid-step, XLA:CPU, {result['time_params']} params", "",
              "| buffer | median ms |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in t["median_ms"].items()]
    lines += ["", f"bf16 buffer / f32 buffer (paired, same rounds): **{t['bf16_over_f32']:.2f}x**"]
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--h200", action="store_true", help="bytes on the H200 compiler only")
  parser.add_argument("--quick", action="store_true", help="small sizes")
  parser.add_argument("--out", type=Path, default=RESULTS)
  args = parser.parse_args()
  n = 1 << (16 if args.quick else 20)
  result: dict[str, Any] = {"machine": harness.machine(), "command": " ".join(sys.argv)}
  if args.h200:
    result["compiler"] = "H200 compiler, deviceless"
    result["bytes"] = bytes_per_param(h200_sharding(), n)
  else:
    result["compiler"] = "XLA:CPU"
    result["bytes"] = bytes_per_param(jax.sharding.SingleDeviceSharding(jax.devices()[0]), n)
    result["elements"] = 1024 if args.quick else 16384
    result["errors"] = window_errors([16, 64] if args.quick else [16, 64, 256, 1024],
                                     result["elements"])
    result["time_params"] = "256K" if args.quick else "4M"
    result["time"] = mid_step_times((1 << 18) if args.quick else (1 << 22),
                                    3 if args.quick else 31)
  stem = "narrow_buffer_h200" if args.h200 else "narrow_buffer"
  harness.write(args.out, stem, result, markdown(result))


if __name__ == "__main__":
  main()
