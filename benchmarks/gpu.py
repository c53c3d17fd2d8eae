"""GPU benchmark: accumulation train steps and in-step microbatching on one GPU.

``bench_accumulate.py``'s train steps, ``bench_microbatched.py``'s comparison, and
microbatched at matmul precision ``"highest"``: ``benchmarks/NOTES.md``, "On a GPU".

  python benchmarks/gpu.py --out DIR     # DIR/gpu.{json,md}: commit as results/gpu.md
  python benchmarks/gpu.py --cpu-smoke   # tiny sizes on the CPU: checks the script
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_accumulate as ba
import bench_microbatched as bm
import harness
import jax
import jax.numpy as jnp

import optax_accum as oa

GPU_SIZES = ("1M", "16M", "256M")
SMOKE_SIZES = ("64K", "256K")
TRANSFORMER = {"d_model": 1024, "heads": 16, "layers": 4, "seq": 512, "vocab": 8192,
               "batch": 64, "ks": [4, 16]}
SMOKE_TRANSFORMER = {"d_model": 64, "heads": 4, "layers": 2, "seq": 32, "vocab": 128,
                     "batch": 16, "ks": [4]}


def precision_meaning() -> str:
  value = jax.config.jax_default_matmul_precision
  if value not in (None, "default", "DEFAULT"):
    return f"set to {value!r}"
  if jax.default_backend() == "gpu":
    return "default: f32 matmuls use TF32 on NVIDIA GPUs (Ampere and later)"
  return f"default (on {jax.default_backend()}: full f32 matmuls)"


def highest_precision_diff(tf: dict[str, Any], params: Any, batch: Any, k: int) -> dict:
  """``oa.microbatched`` against the full batch with every matmul at ``"highest"``."""
  vg = jax.value_and_grad(bm.make_loss(heads=tf["heads"], remat=False))
  with jax.default_matmul_precision("highest"):
    full_lowered = jax.jit(vg).lower(params, batch)
    micro = jax.jit(oa.microbatched(vg, k)).lower(params, batch).compile()
  dots = [ln for ln in full_lowered.as_text().splitlines() if "dot_general" in ln]
  a = micro(params, batch)
  b = full_lowered.compile()(params, batch)
  return {"k": k, "loss_rel_diff": float(jnp.abs(a[0] - b[0]) / jnp.abs(b[0])),
          "grad_rel_diff": harness.rel_diff(a[1], b[1]), "dots": len(dots),
          "dots_highest": sum("HIGHEST" in ln for ln in dots)}


def markdown(result: dict[str, Any]) -> str:
  meta, p = result["meta"], result["highest"]
  return "\n".join([
      "# GPU benchmark" + (" (CPU smoke run: not GPU numbers)" if meta["cpu_smoke"] else ""), "",
      f"`python benchmarks/gpu.py {' '.join(meta['argv'])}` on {meta['device']} (backend"
      f" {meta['backend']}), jax {meta['jax']}, optax {meta['optax']}, {meta['date']},"
      f" {meta['wall_s']} s. Matmul precision: {result['precision']}. Train step, params and"
      f" state donated, window k = {meta['k']}; medians over {meta['rounds']} interleaved"
      " rounds, ratios the median same-round ratio.", "",
      *ba.sections(result, limits="; limits set for XLA:CPU at 4M"),
      "## In-step microbatching: transformer", "",
      ", ".join(f"{k} {v}" for k, v in result["transformer"].items()) + ".", "",
      *bm.table(result["microbatching"]), "",
      "## Microbatched against full batch at matmul precision \"highest\"", "",
      f"k = {p['k']}: loss rel. diff {p['loss_rel_diff']:.1e}, grad rel. diff"
      f" {p['grad_rel_diff']:.1e} ({p['dots_highest']} of {p['dots']} dots lowered as"
      " HIGHEST); at the default precision see the table above.", ""])


def main(argv: list[str] | None = None) -> dict[str, Any]:
  ap = harness.parser(__doc__)
  ap.set_defaults(out=None)  # benchmarks/results, or a temp dir with --cpu-smoke
  ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU, results in"
                  " a temp dir without --out (checks the script; not GPU numbers)")
  ap.add_argument("--rounds", type=int, default=None, help="accumulation rounds (default 15)")
  args = ap.parse_args(argv)
  smoke = args.cpu_smoke
  if not smoke and jax.default_backend() != "gpu":
    raise SystemExit(f"benchmarks/gpu.py needs a GPU; jax.default_backend() is"
                     f" {jax.default_backend()!r}. Pass --cpu-smoke to check the script.")
  t_start = time.perf_counter()

  def log(msg: str) -> None:
    print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)

  log(f"device {jax.devices()[0].device_kind}; matmul precision: {precision_meaning()}")
  sizes = [ba.parse_size(s) for s in (SMOKE_SIZES if smoke else GPU_SIZES)]
  rounds = args.rounds or (3 if smoke else 15)
  copy = ba.CopyTimer(16 * 2**20) if smoke else ba.CopyTimer(2**30)
  # Windows per round: many at 1M (dispatch-bound), 2 at 256M.
  measured = ba.measure(sizes, ["adam"], copy, rounds,
                        lambda size: max(2, min(32, (64 * 2**20) // size)), max(sizes))
  log("accumulation done")

  tf = SMOKE_TRANSFORMER if smoke else TRANSFORMER
  params = bm.init_params(jax.random.key(0), vocab=tf["vocab"], d_model=tf["d_model"],
                          layers=tf["layers"], seq=tf["seq"])
  batch = {"tokens": jax.random.randint(jax.random.key(1), (tf["batch"], tf["seq"]), 0,
                                        tf["vocab"])}
  cfgs = bm.configs(tf["ks"], tf["ks"][0])[: 1 + 2 * len(tf["ks"])]  # full, ours, optax
  mb_rows = bm.measure(cfgs, params, batch, tf["heads"], rounds=2 if smoke else 5,
                       iters=1 if smoke else 2)
  log("microbatching done")
  highest = highest_precision_diff(tf, params, batch, tf["ks"][0])
  log("precision check done")

  result = {**measured, "precision": precision_meaning(), "microbatching": mb_rows,
            "transformer": {**tf, "params": sum(x.size for x in jax.tree.leaves(params))},
            "highest": highest}
  result["meta"].update(argv=list(argv if argv is not None else sys.argv[1:]), cpu_smoke=smoke,
                        wall_s=round(time.perf_counter() - t_start, 1))
  out = args.out or (Path(tempfile.mkdtemp(prefix="gpu_smoke_")) if smoke else harness.RESULTS)
  harness.write(out, "gpu", result, markdown(result))
  return result


if __name__ == "__main__":
  main()
