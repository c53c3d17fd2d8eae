"""Benchmark: the k that ``plan_k`` plans, against the compiled peak of every candidate.

An MLP, the demo's transformer, and the same with ``jax.checkpoint``, in step and
across steps: every candidate k compiled, a limit between two neighbouring peaks, and
``plan_k`` under it against the brute-force answer. Nothing runs.

  python benchmarks/bench_plan_k.py                              # ~3 minutes, 2 CPU cores
  python benchmarks/bench_plan_k.py --quick --out /tmp/plan_k   # smoke, seconds
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import jax
import jax.numpy as jnp
import optax

import optax_accum as oa
from optax_accum.planning import compiled_peak_bytes

MakeStep = Callable[[int], Callable[..., Any]]


def mlp_case(args: argparse.Namespace) -> dict[str, Any]:
  """A ReLU MLP (``--mlp-layers`` x ``--mlp-width``, scalar head), squared error, Adam."""
  d, layers, batch = args.mlp_width, args.mlp_layers, args.mlp_batch
  f32 = jnp.float32
  layer = {"w": jax.ShapeDtypeStruct((d, d), f32), "b": jax.ShapeDtypeStruct((d,), f32)}
  params = {"hidden": [dict(layer) for _ in range(layers)],
            "head": jax.ShapeDtypeStruct((d,), f32)}
  data = {"x": jax.ShapeDtypeStruct((batch, d), f32), "y": jax.ShapeDtypeStruct((batch,), f32)}

  def loss(p: Any, b: dict[str, jax.Array]) -> jax.Array:
    h = b["x"]
    for layer in p["hidden"]:
      h = jax.nn.relu(h @ layer["w"] + layer["b"])
    return jnp.mean((h @ p["head"] - b["y"]) ** 2)

  opt, vg = optax.adam(1e-3), jax.value_and_grad(loss)

  def make_step(k: int, across: bool) -> Callable[..., Any]:
    """In step: ``microbatched`` and the optax protocol; across: ``update_and_apply``."""
    grad_fn = vg if across else oa.microbatched(vg, k)
    apply = harness.fast_step(oa.accumulate(k, opt)) if across else harness.protocol_step(opt)

    def step(p, state, b):
      value, grads = grad_fn(p, b)
      return *apply(p, state, grads), value
    return step

  return _case(f"MLP {layers} x {d}", batch, params, data,
               (functools.partial(make_step, across=False), opt.init),
               (functools.partial(make_step, across=True), oa.accumulate(2, opt).init))


def transformer_case(args: argparse.Namespace, remat: bool) -> dict[str, Any]:
  """The demo's CharTransformer and token-weighted loss (its microbatched and accumulate arms)."""
  from flax import nnx
  sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
  import demo  # examples/demo.py

  cfg = demo.Config(k=1, batch_size=args.tf_batch, seq_len=args.tf_seq, d_model=args.tf_d_model,
                    layers=args.tf_layers, heads=args.tf_heads)

  class Checkpointed(demo.CharTransformer):
    """The demo's model with ``jax.checkpoint`` around each block in a ``lax.scan``
    (XLA:CPU saved nothing from it around unrolled blocks, nor from ``nnx.remat``)."""

    def __call__(self, tokens: jax.Array) -> jax.Array:
      x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
      mask = nnx.make_causal_mask(tokens)
      graphdef = nnx.graphdef(self.blocks[0])
      stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b) for b in self.blocks])

      @jax.checkpoint
      def body(x: jax.Array, state: Any) -> tuple[jax.Array, None]:
        return nnx.merge(graphdef, state)(x, mask), None

      x, _ = jax.lax.scan(body, x, stacked)
      return self.head(self.ln_f(x))

  cls = Checkpointed if remat else demo.CharTransformer
  model = nnx.eval_shape(lambda: cls(seq_len=cfg.seq_len, d_model=cfg.d_model,
                                     layers=cfg.layers, heads=cfg.heads, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(model)
  loss_terms = demo.make_loss_terms(graphdef)
  base = optax.adam(cfg.lr)
  batch = demo.batch_types(cfg)

  def arm(name: str) -> MakeStep:
    return lambda k: demo.build_step(name, loss_terms, base, k)[1]

  name = "demo transformer" + (" + jax.checkpoint (scan)" if remat else "")
  return _case(f"{name} (d {cfg.d_model}, {cfg.layers} blocks, seq {cfg.seq_len})",
               cfg.batch_size, params, batch, (arm("microbatched"), base.init),
               (arm("accumulate"), demo.build_step("accumulate", loss_terms, base, 2)[0].init))


def _case(model: str, global_batch: int, params: Any, batch: Any, in_step: tuple[MakeStep, Any],
          across: tuple[MakeStep, Any]) -> dict[str, Any]:
  """A case's modes, each ``(make_step, (params, state, batch))`` from its (make_step, init)."""
  return {"model": model, "global_batch": global_batch,
          "params": int(sum(math.prod(x.shape) for x in jax.tree.leaves(params))),
          "modes": {mode: (make, (params, jax.eval_shape(init, params), batch))
                    for mode, (make, init) in (("in-step", in_step), ("across steps", across))}}


def sweep(make_step: MakeStep, args: tuple[Any, ...], ks: list[int], global_batch: int,
          across: bool) -> list[dict[str, Any]]:
  """Every candidate compiled here, independently of the planner (across steps: on the
  batch, the last argument, cut to ``global_batch // k`` rows as the planner does)."""
  rows = []
  for k in ks:
    micro = jax.tree.map(lambda s, k=k: jax.ShapeDtypeStruct(
        (global_batch // k, *s.shape[1:]), s.dtype, sharding=s.sharding), args[-1])
    call_args = (*args[:-1], micro) if across else args
    compiled = jax.jit(make_step(k)).lower(*call_args).compile()
    m = compiled.memory_analysis()
    rows.append({"k": k, "micro_batch_size": global_batch // k,
                 "peak_bytes": compiled_peak_bytes(compiled),
                 "xla_peak_memory_in_bytes": int(m.peak_memory_in_bytes),
                 **{f"{n}_bytes": int(getattr(m, f"{n}_size_in_bytes"))
                    for n in ("argument", "output", "temp", "alias")}})
  return rows


def pick_limit(rows: list[dict[str, Any]]) -> float:
  """Halfway between the peaks of two neighbours near the middle, the larger one first."""
  n = len(rows)
  for i in sorted(range(1, n), key=lambda i: abs(i - n / 2)):
    hi, lo = rows[i - 1]["peak_bytes"], rows[i]["peak_bytes"]
    if hi > lo:
      return (hi + lo) / 2
  return rows[-1]["peak_bytes"]  # (flat peaks: every candidate fits)


def run_case(case: dict[str, Any], mode: str) -> dict[str, Any]:
  """The sweep over every divisor of the global batch, and ``plan_k`` against it."""
  make_step, args = case["modes"][mode]
  across = mode == "across steps"
  ks = [d for d in range(1, case["global_batch"] + 1) if case["global_batch"] % d == 0]
  rows = sweep(make_step, args, ks, case["global_batch"], across)
  limit = int(pick_limit(rows))
  brute = min((r["k"] for r in rows if r["peak_bytes"] <= limit), default=None)
  made: list[int] = []

  def counting(k: int) -> Callable[..., Any]:
    made.append(k)
    return make_step(k)

  t0 = time.perf_counter()
  plan = oa.plan_k(counting, *args, batch_argnums=len(args) - 1, memory_limit=limit,
                   across_steps=across, candidates=ks)
  search_s = time.perf_counter() - t0
  print(f"{case['model']}, {mode}:\n{plan}\n", flush=True)
  return {
      "model": case["model"], "mode": mode, "global_batch": case["global_batch"],
      "params": case["params"], "candidates": ks, "sweep": rows,
      "sweep_monotone": all(a["peak_bytes"] >= b["peak_bytes"]
                            for a, b in itertools.pairwise(rows)),
      "memory_limit": limit,
      "planned_k": plan.k, "planned_peak_bytes": plan.peak_bytes,
      "planned_micro_batch_size": plan.micro_batch_size,
      "brute_force_k": brute, "agrees": plan.k == brute,
      "compiles": len(made), "compile_bound": math.ceil(math.log2(len(ks))) + 1,
      "compiled_ks": sorted(made), "plan_monotone": plan.monotone, "search_s": search_s,
  }


def main(argv: list[str] | None = None) -> None:
  ap = harness.parser(__doc__, quick="tiny sizes (MLP 2 x 32, batch 64; transformer d 16, 1"
                      " block, seq 16, batch 8): a smoke run", mlp_width=256, mlp_layers=4,
                      mlp_batch=4096, tf_batch=32, tf_seq=64, tf_d_model=64, tf_layers=2,
                      tf_heads=4)  # tf_batch: the demo's --batch-size
  args = ap.parse_args(argv)
  if args.quick:
    args.mlp_width, args.mlp_layers, args.mlp_batch = 32, 2, 64
    args.tf_batch, args.tf_seq, args.tf_d_model, args.tf_layers, args.tf_heads = 8, 16, 16, 1, 2
  t_start = time.perf_counter()
  cases = [mlp_case(args), transformer_case(args, remat=False),
           transformer_case(args, remat=True)]
  results = [run_case(case, mode) for case in cases for mode in case["modes"]]
  result = {"setup": {**harness.machine(), "optimizer": "adam",
                      "peak": "argument + output + temp - alias (memory_analysis, per device)"},
            "rows": results, "wall_seconds": time.perf_counter() - t_start}
  harness.write(args.out, "plan_k", result, markdown(result))


def markdown(result: dict[str, Any]) -> str:
  s = result["setup"]
  lines = [
      f"`plan_k` against the compiled peak of every candidate; {s['backend']} ({s['device']},"
      f" {s['cpu_count']} cores), jax {s['jax']}, Adam. Peak per device: {s['peak']}. The limit"
      " is halfway between two neighbouring candidates' peaks; *brute force* is the smallest"
      " candidate within it in the full sweep; *compiles* are the search's (bound"
      " ceil(log2 n) + 1), *search* its wall time (building, lowering and compiling).", "",
      *harness.table(
        "model | mode | global batch | candidates | limit (MiB) | planned k (peak MiB) |"
        " brute force k | compiles (bound) | search (s) | sweep monotone", "llrlrrrrrl",
        [[r["model"], r["mode"], f"{r['global_batch']:,}",
          f"{len(r['candidates'])}: {r['candidates'][0]}..{r['candidates'][-1]}",
          harness.mib(r["memory_limit"]),
          f"{r['planned_k']} ({harness.mib(r['planned_peak_bytes'])})",
          f"{r['brute_force_k']}{'' if r['agrees'] else ' **differs**'}",
          f"{r['compiles']} ({r['compile_bound']})", f"{r['search_s']:.1f}",
          "yes" if r["sweep_monotone"] else "**no**"] for r in result["rows"]]),
      "", "Compiled peak of every candidate (MiB; **bold**: planned, *italics*: compiled"
      " by the search; XLA's `peak_memory_in_bytes` in brackets):", ""]
  for r in result["rows"]:
    cells = []
    for row in r["sweep"]:
      mark = "**" if row["k"] == r["planned_k"] else "*" if row["k"] in r["compiled_ks"] else ""
      cells.append(f"{mark}{row['k']}: {harness.mib(row['peak_bytes'])}{mark}"
                   f" [{harness.mib(row['xla_peak_memory_in_bytes'])}]")
    lines.append(f"- {r['model']}, {r['mode']} (limit {harness.mib(r['memory_limit'])}):"
                 f" {', '.join(cells)}")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
