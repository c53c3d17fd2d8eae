"""A bfloat16 accumulation buffer: precision and time, against the float32 one.

1. **Error of one window** against a float64 reference, bf16 rounding to nearest
   and stochastically (``accumulator_dtype=jnp.bfloat16``), k = 16 to 1024,
   gradients ``N(1, 0.5^2)``: bias and spread of the error over the mean |reference|.
2. **Mid-step time** of ``update_and_apply``, bf16 over f32 buffer, 4M f32 params,
   interleaved rounds. (Bytes per parameter: ``gpu_hlo.py``'s rows.)

  python benchmarks/bench_narrow_buffer.py                    # results/narrow_buffer.*
  python benchmarks/bench_narrow_buffer.py --quick --out /tmp/nb   # small sizes
"""

from __future__ import annotations

import sys
from typing import Any

import bench_accumulate as ba
import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum as oa


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
  """Rows of table 1: bias and spread of one window's mean, per rounding and k."""
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
  """Table 2: ``update_and_apply`` mid-steps, bf16 buffer over f32 buffer
  (``bench_accumulate``'s compiled, donated train step, timed call by call)."""
  params = {f"w{i}": jnp.full((n // 8,), 0.1) for i in range(8)}
  grads = jax.tree.map(lambda p: p * 0.01, params)
  timers = {}
  for name, dt in (("f32 buffer", None), ("bf16 buffer", jnp.bfloat16)):
    tx = oa.accumulate(1 << 30, optax.adam(1e-3), accumulator_dtype=dt)  # never emits
    timers[name] = ba.compile_program(ba.Program(name, 1 << 30, harness.fast_step(tx), tx.init),
                                      params, grads)
  secs = harness.interleaved({name: lambda t=t: t.timed(1) for name, t in timers.items()}, rounds)
  return {"median_ms": {k: 1e3 * harness.median(v) for k, v in secs.items()},
          "bf16_over_f32": harness.paired_ratio(secs["bf16 buffer"], secs["f32 buffer"])}


def markdown(result: dict[str, Any]) -> str:
  m, t = result["machine"], result["time"]
  return "\n".join([
      "# A bfloat16 accumulation buffer (XLA:CPU)", "",
      f"`{result['command']}`; {m['date']}, jax {m['jax']}, load {m['loadavg']}. Bytes per"
      " parameter: `results/gpu_hlo.md` (`gpu_hlo.py`).", "",
      "## One window's mean against a float64 reference (N(1, 0.5^2) gradients,"
      f" {result['elements']} elements)", "",
      *harness.table("k | rounding | bias (/ mean) | its standard error | spread (/ mean)",
                     "rlrrr", [[r["k"], r["rounding"], f"{r['bias']:+.2e}",
                                f"{r['bias_standard_error']:.1e}", f"{r['spread']:.2e}"]
                               for r in result["errors"]]),
      "", f"## update_and_apply mid-step, XLA:CPU, {result['time_params']} params", "",
      *harness.table("buffer | median ms", "lr",
                     [[k, f"{v:.2f}"] for k, v in t["median_ms"].items()]),
      "", f"bf16 buffer / f32 buffer (paired, same rounds): **{t['bf16_over_f32']:.2f}x**"])


def main() -> None:
  args = harness.parser(__doc__, quick="small sizes").parse_args()
  result: dict[str, Any] = {"machine": harness.machine(), "command": " ".join(sys.argv),
                            "compiler": "XLA:CPU", "elements": 1024 if args.quick else 16384,
                            "time_params": "256K" if args.quick else "4M"}
  result["errors"] = window_errors([16, 64] if args.quick else [16, 64, 256, 1024],
                                   result["elements"])
  result["time"] = mid_step_times((1 << 18) if args.quick else (1 << 22), 3 if args.quick else 31)
  harness.write(args.out, "narrow_buffer", result, markdown(result))


if __name__ == "__main__":
  main()
