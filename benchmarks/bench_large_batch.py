"""check_large_batch's host memory and time on a large MLP: a few gradient copies at any k.

An MLP of ``--params`` float32 parameters, 64 rows, ``debug.check_large_batch`` at k = 2
and 8, each in a fresh process: numpy's peak (``tracemalloc``), the resident set's peak
above its level before the check, the process's peak; the time against one gradient.

  python benchmarks/bench_large_batch.py                 # 1e7 params: results/large_batch.*
  python benchmarks/bench_large_batch.py --params 1e8    # results/large_batch_1e08.*
  python benchmarks/bench_large_batch.py --quick --out /tmp/x
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import harness
import jax
import jax.numpy as jnp
import numpy as np

from optax_accum.debug import check_large_batch

ROWS, D_IN = 64, 256
KS = (2, 8)


def peak_rss_during(run: Callable[[], Any]) -> tuple[Any, int]:
  """``run()``'s result and the peak resident set above the level before it."""
  start, peak, done = harness.rss(), [0], threading.Event()

  def sample() -> None:
    while not done.is_set():
      peak[0] = max(peak[0], harness.rss())
      time.sleep(0.005)

  thread = threading.Thread(target=sample, daemon=True)
  thread.start()
  try:
    out = run()
  finally:
    done.set()
    thread.join()
  return out, max(peak[0], harness.rss()) - start


def mlp(params_target: float) -> tuple[dict[str, jax.Array], int]:
  """Square tanh layers of one width, about ``params_target`` parameters."""
  width = 256
  while (width * 2) ** 2 * 8 <= params_target:
    width *= 2
  layers = max(1, round(params_target / width**2))
  rng = np.random.default_rng(0)
  params = {"in": jnp.asarray(rng.normal(size=(D_IN, width)) / np.sqrt(D_IN), jnp.float32)}
  for i in range(layers):
    params[f"h{i}"] = jnp.asarray(rng.normal(size=(width, width)) / np.sqrt(width), jnp.float32)
  return params, sum(int(p.size) for p in params.values())


def loss(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
  h = jnp.tanh(x @ params["in"])
  for i in range(len(params) - 1):
    h = jnp.tanh(h @ params[f"h{i}"])
  return jnp.mean((h[:, :1] - y) ** 2)


def measure_one(params_target: float, k: int) -> dict[str, Any]:
  """One check at ``k`` in this process, right after one gradient of the whole batch."""
  params, n_params = mlp(params_target)
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(ROWS, D_IN)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(ROWS, 1)), jnp.float32)
  fn = jax.jit(jax.value_and_grad(loss))
  calls = harness.interleaved({"call": lambda: jax.block_until_ready(fn(params, x, y))}, 3)
  one_call = harness.median(calls["call"])  # 3 calls after one that compiles
  check = check_large_batch(fn, k, batch_argnums=(1, 2))
  tracemalloc.start()
  t0 = time.perf_counter()
  report, above = peak_rss_during(lambda: check(params, x, y))
  seconds = time.perf_counter() - t0
  numpy_peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  return {"k": k, "params": n_params, "layers": len(params), "cause": report.cause,
          "seconds": seconds, "one_call_s": one_call, "vs_one_call": seconds / one_call,
          "numpy_peak_bytes": numpy_peak, "numpy_bytes_per_param": numpy_peak / n_params,
          "rss_above_bytes": above, "rss_bytes_per_param": above / n_params,
          "process_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
          "max_relative_error": report.max_relative_error, "tolerance": report.tolerance}


def measure(params_target: float) -> dict[str, Any]:
  """Each k in a fresh process: no allocation of one run is reused by the next."""
  records = []
  for k in KS:
    proc = subprocess.run([sys.executable, __file__, "--one", str(k), "--params",
                           str(params_target)], capture_output=True, text=True, check=False)
    if proc.returncode:
      raise SystemExit(proc.stderr[-3000:])
    records.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    r = records[-1]
    print(f"k={k}: {r['cause']}, {r['seconds']:.1f} s, numpy {r['numpy_bytes_per_param']:.1f}"
          f" B/param, resident set +{r['rss_bytes_per_param']:.1f} B/param", flush=True)
  return {"params": records[0]["params"], "layers": records[0]["layers"], "rows": ROWS,
          "records": records, "meta": harness.machine()}


def markdown(result: dict[str, Any], argv: str) -> str:
  p = result["params"]
  lines = [
      "# check_large_batch: host memory and time", "",
      f"`python benchmarks/bench_large_batch.py {argv}` on {result['meta']['device']}"
      f" ({result['meta']['backend']}, jax {result['meta']['jax']}, load"
      f" {result['meta']['loadavg']}, {result['meta']['date']}): an MLP of {p:,} float32"
      f" params ({result['layers']} matrices), {result['rows']} rows. One call of the jitted"
      f" value-and-grad on the whole batch: {result['records'][0]['one_call_s']:.3f} s. Each k"
      " runs in a fresh process that takes that gradient, then runs the check once (its"
      " compilations included). Bytes per parameter: numpy's peak during the check (what it"
      " keeps on the host), the resident set's peak above its level before the check, and"
      " the process's peak resident set (the model, its gradients and the check).", "",
      *harness.table(
          "k | verdict | numpy peak (B/param) | resident set + (B/param) | process peak"
          " (MiB) | time (s) | time / one call", "rlrrrrr",
          [(r["k"], r["cause"], f"{r['numpy_bytes_per_param']:.1f}",
            f"{r['rss_bytes_per_param']:.1f}", harness.mib(r["process_peak_rss_bytes"]),
            f"{r['seconds']:.1f}", f"{r['vs_one_call']:.1f}x") for r in result["records"]])]
  return "\n".join(lines)


def plot(result: dict[str, Any]) -> Any:
  fig, ax = harness.pyplot().subplots(figsize=(5, 3), dpi=120)
  recs = result["records"]
  for dx, key, label in ((-0.2, "numpy", "numpy peak"), (0.2, "rss", "resident set +")):
    ax.bar([i + dx for i in range(len(recs))], [r[f"{key}_bytes_per_param"] for r in recs], 0.4,
           label=label)
  ax.set_xticks(range(len(recs)), [f"k = {r['k']}" for r in recs])
  ax.set_ylabel("host bytes per parameter")
  ax.set_title(f"check_large_batch, {result['params']:,} params")
  ax.legend()
  return fig


def main() -> None:
  ap = harness.parser(__doc__, quick="1e5 params (checks the script)", params=1e7)
  ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: one k
  args = ap.parse_args()
  if args.one:
    print(json.dumps(measure_one(args.params, args.one)))
    return
  result = measure(1e5 if args.quick else args.params)
  argv = "--quick" if args.quick else f"--params {args.params:g}"
  stem = "large_batch" if args.quick or args.params == 1e7 else f"large_batch_{args.params:.0e}"
  harness.write(args.out, stem.replace("+", ""), result, markdown(result, argv), plot)


if __name__ == "__main__":
  main()
