"""Benchmark: in-step microbatching, rematerialisation and bf16, side by side.

A small decoder-only transformer (token + position embedding, ``--layers``
pre-norm attention + MLP blocks, untied output projection, next-token
cross-entropy) at a fixed global batch. For each configuration it reports

* ``temp_bytes``: compiled temporaries of the jitted value-and-grad step,
  ``jax.jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes``
  (deterministic for a given XLA build);
* ``step_ratio``: step time relative to the full-batch step, measured in the
  same process with interleaved rounds (``harness.interleaved``: every
  configuration once per round, in a fresh seeded random order, so the full
  batch does not always run first), median over rounds of the per-round ratio;
* the largest global batch whose temporaries fit a fixed budget (the
  full-batch temporaries at the default global batch), for each trick.

Run (default under ~3 minutes on 2 CPU cores)::

  python benchmarks/bench_microbatched.py
  python benchmarks/bench_microbatched.py --d-model 512 --layers 6 --seq 256 \\
      --batch 256 --rounds 10          # bigger
  python benchmarks/bench_microbatched.py --quick --out /tmp/mb   # smoke, seconds

Writes ``benchmarks/results/microbatched.{json,md,png}`` (``--out``).
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import jax
import jax.numpy as jnp
import numpy as np

from optax_accum.microbatching import microbatched
from optax_accum.precision import Policy, mixed_precision

Params = dict[str, Any]

REMAT_POLICIES = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
}


# ----------------------------------------------------------------- the model
def init_params(key: jax.Array, *, vocab: int, d_model: int, layers: int, seq: int,
                mlp_ratio: int = 4) -> Params:
  keys = iter(jax.random.split(key, 4 + 4 * layers))
  def dense(k, fan_in, fan_out):
    return jax.random.normal(k, (fan_in, fan_out), jnp.float32) / math.sqrt(fan_in)
  params: Params = {
      "embed": jax.random.normal(next(keys), (vocab, d_model), jnp.float32) * 0.02,
      "pos": jax.random.normal(next(keys), (seq, d_model), jnp.float32) * 0.02,
      "ln_f": jnp.ones((d_model,), jnp.float32),
      "out": dense(next(keys), d_model, vocab),
      "blocks": [],
  }
  for _ in range(layers):
    params["blocks"].append({
        "ln1": jnp.ones((d_model,), jnp.float32),
        "qkv": dense(next(keys), d_model, 3 * d_model),
        "proj": dense(next(keys), d_model, d_model),
        "ln2": jnp.ones((d_model,), jnp.float32),
        "fc1": dense(next(keys), d_model, mlp_ratio * d_model),
        "fc2": dense(next(keys), mlp_ratio * d_model, d_model),
    })
  return params


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def block(p: Params, x: jax.Array, *, heads: int) -> jax.Array:
  b, s, d = x.shape
  h = _rms_norm(x, p["ln1"])
  q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
  q, k, v = (t.reshape(b, s, heads, d // heads) for t in (q, k, v))
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads)
  mask = jnp.tril(jnp.ones((s, s), jnp.bool_))
  logits = jnp.where(mask, logits, jnp.asarray(-1e4, logits.dtype))
  attn = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(x.dtype)
  y = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, s, d)
  x = x + y @ p["proj"]
  h = _rms_norm(x, p["ln2"])
  return x + jax.nn.gelu(h @ p["fc1"]) @ p["fc2"]


def stack_blocks(params: Params) -> Params:
  """Blocks as one pytree with a leading layer axis (for ``lax.scan``)."""
  return {**params, "blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *params["blocks"])}


def make_loss(*, heads: int, remat: str | None, layers_impl: str = "scan",
              remat_where: str = "block") -> Callable[[Params, dict], jax.Array]:
  """Mean next-token cross-entropy.

  ``layers_impl="scan"`` runs the blocks with ``lax.scan`` over stacked params
  (``stack_blocks``), ``"unrolled"`` with a Python loop over a list.
  ``remat`` names a checkpoint policy; ``remat_where="block"`` puts
  ``jax.checkpoint`` around each block (the scan body), ``"loss"`` around the
  whole loss (the wrong place, kept to show it).
  """
  blk = functools.partial(block, heads=heads)
  if remat is not None and remat_where == "block":
    # The right place: around each block, inside the loss (and so inside
    # value_and_grad and inside microbatched).
    blk = jax.checkpoint(blk, policy=REMAT_POLICIES[remat])

  def loss_fn(params: Params, batch: dict) -> jax.Array:
    tokens = batch["tokens"]
    x = params["embed"][tokens] + params["pos"][None, : tokens.shape[1]]
    if layers_impl == "scan":
      x, _ = jax.lax.scan(lambda x, p: (blk(p, x), None), x, params["blocks"])
    else:
      for p in params["blocks"]:
        x = blk(p, x)
    logits = (_rms_norm(x, params["ln_f"]) @ params["out"]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits[:, :-1])
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.mean(nll)

  if remat is not None and remat_where == "loss":
    return jax.checkpoint(loss_fn, policy=REMAT_POLICIES[remat])
  return loss_fn


# --------------------------------------------------------------- the configs
def make_grad_fn(cfg: dict, args: argparse.Namespace) -> Callable:
  loss = make_loss(heads=args.heads, remat=args.remat_policy if cfg["remat"] else None,
                   layers_impl=cfg.get("layers_impl", args.layers_impl),
                   remat_where=cfg.get("remat_where", "block"))
  if cfg["bf16"]:
    loss = mixed_precision(loss, Policy.from_string("params=f32,compute=bf16,output=f32"))
  fn = jax.value_and_grad(loss)
  if cfg["k"] > 1:
    fn = microbatched(fn, cfg["k"])
  return jax.jit(fn)


def config_name(cfg: dict) -> str:
  parts = ["full batch" if cfg["k"] == 1 else f"microbatched k={cfg['k']}"]
  if cfg["remat"]:
    parts.append("remat")
  if cfg["bf16"]:
    parts.append("bf16")
  return " + ".join(parts)


def batch_shapes(batch: int, seq: int) -> dict:
  return {"tokens": jax.ShapeDtypeStruct((batch, seq), jnp.int32)}


def memory(fn: Callable, params: Params, batch: int, seq: int) -> dict[str, int]:
  p_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  compiled = fn.lower(p_shapes, batch_shapes(batch, seq)).compile()
  m = compiled.memory_analysis()
  return {"temp_bytes": int(m.temp_size_in_bytes),
          "argument_bytes": int(m.argument_size_in_bytes),
          "output_bytes": int(m.output_size_in_bytes)}


def largest_batch(cfg: dict, args: argparse.Namespace, params: Params, budget: int,
                  step: int, limit: int, start: int) -> tuple[int, int, int]:
  """Largest multiple of ``step`` (<= limit) whose temporaries fit ``budget``.

  Temporaries are close to affine in the batch, so the search interpolates
  (secant/regula falsi on measured compiles) instead of bisecting, and stops
  when a fitting batch and a non-fitting one are ``step`` apart. Every
  reported number is a measured compile. Returns ``(largest that fits,
  smallest that does not, compiles)``.
  """
  fn = make_grad_fn(cfg, args)
  cache: dict[int, int] = {}
  def temp(b: int) -> int:
    if b not in cache:
      cache[b] = memory(fn, params, b, args.seq)["temp_bytes"]
    return cache[b]
  b = max(step, start // step * step)
  temp(b), temp(2 * b)
  for _ in range(40):
    fit = [x for x in cache if cache[x] <= budget]
    over = [x for x in cache if cache[x] > budget]
    lo, hi = max(fit, default=0), min(over, default=None)
    if hi is not None and hi - lo <= step:
      return lo, hi, len(cache)
    if lo >= limit:
      return lo, lo + step, len(cache)
    # Interpolate between the bracket (or extrapolate from the two largest).
    pts = sorted(cache)
    a, c = (lo, hi) if (lo and hi is not None) else (pts[-2], pts[-1])
    slope = (cache[c] - cache[a]) / (c - a)
    guess = a + (budget - cache[a]) / slope if slope > 0 else 2 * c
    nxt = int(guess) // step * step
    upper = limit if hi is None else hi - step
    nxt = min(max(nxt, lo + step), upper)
    if nxt in cache:  # interpolation stalled: take one step from the side it favours
      nxt = lo + step if cache[nxt] > budget else min(nxt + step, upper)
    temp(nxt)
  raise RuntimeError(f"largest-batch search did not converge for {config_name(cfg)}")


# ----------------------------------------------------------------------- run
def run_steps(fn: Callable, params: Params, batch: dict[str, jax.Array], n: int) -> None:
  """``n`` calls of ``fn(params, batch)``, blocking on the last."""
  out = None
  for _ in range(n):
    out = fn(params, batch)
  jax.block_until_ready(out)


def main(argv: list[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--d-model", type=int, default=128)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--seq", type=int, default=64)
  ap.add_argument("--vocab", type=int, default=512)
  ap.add_argument("--batch", type=int, default=64, help="global batch (examples)")
  ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8, 16])
  ap.add_argument("--trick-k", type=int, default=8, help="k combined with remat/bf16")
  ap.add_argument("--remat-policy", default="nothing_saveable", choices=sorted(REMAT_POLICIES))
  ap.add_argument("--layers-impl", default="scan", choices=["scan", "unrolled"],
                  help="blocks in a lax.scan over stacked params, or a Python loop")
  ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
  ap.add_argument("--iters", type=int, default=3, help="steps per config per round")
  ap.add_argument("--fit-limit", type=int, default=4096, help="largest batch tried")
  ap.add_argument("--skip-fit", action="store_true", help="skip the largest-batch search")
  ap.add_argument("--quick", action="store_true",
                  help="tiny model (d_model 32, 1 block, seq 16, batch 16, k 2 4), 2 rounds,"
                       " no largest-batch search: a smoke run")
  ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
  args = ap.parse_args(argv)
  if args.quick:
    args.d_model, args.heads, args.layers, args.seq, args.vocab = 32, 2, 1, 16, 64
    args.batch, args.ks, args.trick_k, args.rounds, args.iters = 16, [2, 4], 2, 2, 1
    args.skip_fit = True
  t_start = time.perf_counter()

  unrolled_params = init_params(jax.random.key(0), vocab=args.vocab, d_model=args.d_model,
                                layers=args.layers, seq=args.seq)
  scan_params = stack_blocks(unrolled_params)
  params = scan_params if args.layers_impl == "scan" else unrolled_params
  n_params = sum(x.size for x in jax.tree.leaves(params))
  grad_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))  # one f32 gradient buffer
  batch = {"tokens": jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0, args.vocab)}

  configs = [{"k": 1, "remat": False, "bf16": False}]
  configs += [{"k": k, "remat": False, "bf16": False} for k in args.ks]
  for k in (1, args.trick_k):
    configs += [{"k": k, "remat": True, "bf16": False}, {"k": k, "remat": False, "bf16": True},
                {"k": k, "remat": True, "bf16": True}]

  phases: dict[str, float] = {}
  t_phase = time.perf_counter()
  rows = []
  fns = []
  ref_loss, ref_grads = None, None
  for cfg in configs:
    fn = make_grad_fn(cfg, args)
    mem = memory(fn, params, args.batch, args.seq)
    loss, grads = fn(params, batch)
    jax.block_until_ready(grads)
    if ref_loss is None:
      ref_loss, ref_grads = loss, grads
    err = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
              for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True))
    rows.append({"config": config_name(cfg), **cfg, **mem,
                 "loss": float(loss), "grad_rel_err_vs_full": err})
    fns.append(fn)

  phases["compile_and_first_run_s"] = time.perf_counter() - t_phase
  t_phase = time.perf_counter()
  # Interleaved timing (harness.interleaved): one round times every config
  # (``iters`` steps, blocking once at the end), in a fresh seeded random order,
  # so no config always runs first or right after the same one; ratios pair the
  # same round. A warm-up round (after the first calls above) is not recorded.
  secs = harness.interleaved({i: functools.partial(run_steps, fn, params, batch, args.iters)
                              for i, fn in enumerate(fns)}, args.rounds)
  times = [[s / args.iters for s in secs[i]] for i in range(len(fns))]
  for i, row in enumerate(rows):
    row["step_ms_median"] = 1e3 * statistics.median(times[i])
    row["step_ratio"] = harness.paired_ratio(times[i], times[0])

  phases["timing_s"] = time.perf_counter() - t_phase
  t_phase = time.perf_counter()
  full_temp = rows[0]["temp_bytes"]
  for row in rows:
    k = row["k"]
    row["temp_ratio_vs_full"] = row["temp_bytes"] / full_temp
    if k > 1 and not row["remat"] and not row["bf16"]:
      bound = 1.3 * full_temp / k + grad_bytes
      row["temp_bound"] = bound
      row["temp_target_met"] = row["temp_bytes"] <= bound
      if k <= 8:
        row["time_target_met"] = row["step_ratio"] <= 1.15

  # Where jax.checkpoint goes (memory only, full batch).
  placement = []
  for impl, remat, where, policy in [
      ("unrolled", False, "block", None), ("unrolled", True, "block", args.remat_policy),
      ("scan", False, "block", None), ("scan", True, "block", args.remat_policy),
      ("scan", True, "block", "dots_with_no_batch_dims_saveable"),
      ("scan", True, "loss", args.remat_policy)]:
    cfg = {"k": 1, "remat": remat, "bf16": False, "layers_impl": impl, "remat_where": where}
    ns = argparse.Namespace(**{**vars(args), "remat_policy": policy or args.remat_policy})
    mem = memory(make_grad_fn(cfg, ns), scan_params if impl == "scan" else unrolled_params,
                 args.batch, args.seq)
    placement.append({"layers": impl, "checkpoint": f"around each {where}" if remat else "none",
                      "policy": policy if remat else "", "temp_bytes": mem["temp_bytes"]})

  phases["remat_placement_s"] = time.perf_counter() - t_phase
  t_phase = time.perf_counter()
  fit = []
  if not args.skip_fit:
    budget = full_temp
    tricks = [{"k": 1, "remat": False, "bf16": False}, {"k": 1, "remat": True, "bf16": False},
              {"k": 1, "remat": False, "bf16": True}, {"k": 1, "remat": True, "bf16": True},
              {"k": args.trick_k, "remat": False, "bf16": False},
              {"k": args.trick_k, "remat": True, "bf16": True}]
    for cfg in tricks:
      best, fails, compiles = largest_batch(cfg, args, params, budget, step=max(8, cfg["k"]),
                                            limit=args.fit_limit, start=args.batch)
      fit.append({"config": config_name(cfg), **cfg, "largest_batch": best,
                  "smallest_tried_that_does_not_fit": fails,
                  "hit_search_limit": fails > args.fit_limit, "compiles": compiles})

  phases["fit_search_s"] = time.perf_counter() - t_phase
  result = {
      "setup": {"d_model": args.d_model, "heads": args.heads, "layers": args.layers,
                "seq": args.seq, "vocab": args.vocab, "global_batch": args.batch,
                "params": int(n_params), "grad_buffer_bytes": int(grad_bytes),
                "remat_policy": args.remat_policy, "layers_impl": args.layers_impl,
                "rounds": args.rounds,
                "iters": args.iters, **harness.machine()},
      "rows": rows,
      "remat_placement": placement,
      "fit_budget_bytes": full_temp,
      "largest_batch_within_budget": fit,
      "phase_seconds": phases,
      "wall_seconds": time.perf_counter() - t_start,
  }
  harness.write(Path(args.out), "microbatched", result, markdown(result), plot)
  print(f"wall {result['wall_seconds']:.0f}s")
  return result


def _mib(b: float) -> str:
  return f"{b / 2**20:.2f}"


def markdown(result: dict) -> str:
  s = result["setup"]
  lines = [
      f"Small transformer: d_model {s['d_model']}, {s['layers']} blocks, {s['heads']} heads,"
      f" ({s['layers_impl']} over layers), seq {s['seq']}, vocab {s['vocab']},"
      f" {s['params']:,} params (one f32 gradient buffer"
      f" = {_mib(s['grad_buffer_bytes'])} MiB), global batch {s['global_batch']};"
      f" {s['backend']} ({s['device']}, {s['cpu_count']} cores), jax {s['jax']};"
      f" remat policy `{s['remat_policy']}`; timing: median of {s['rounds']} interleaved"
      " rounds, ratio to the full-batch step of the same round.",
      "",
      "| config | temporaries (MiB) | vs full | target (MiB) | step (ms) | step vs full |"
      " max rel. grad diff vs full |",
      "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in result["rows"]:
    target = ""
    if "temp_bound" in r:
      target = f"≤ {_mib(r['temp_bound'])} {'met' if r['temp_target_met'] else '**missed**'}"
    time_note = ""
    if "time_target_met" in r:
      time_note = " met" if r["time_target_met"] else " **missed**"
    lines.append(
        f"| {r['config']} | {_mib(r['temp_bytes'])} | {r['temp_ratio_vs_full']:.2f}x | {target}"
        f" | {r['step_ms_median']:.1f} | {r['step_ratio']:.2f}x{time_note}"
        f" | {r['grad_rel_err_vs_full']:.1e} |")
  lines += [
      "",
      "Where `jax.checkpoint` goes (full batch, compiled temporaries):",
      "",
      "| layers | checkpoint | policy | temporaries (MiB) |",
      "|---|---|---|---:|",
  ]
  for p in result["remat_placement"]:
    lines.append(f"| {p['layers']} | {p['checkpoint']} | {p['policy']} |"
                 f" {_mib(p['temp_bytes'])} |")
  if result["largest_batch_within_budget"]:
    lines += [
        "",
        f"Largest global batch whose temporaries fit {_mib(result['fit_budget_bytes'])} MiB"
        " (the full-batch temporaries above):",
        "",
        "| trick | largest global batch that fits (smallest tried that does not) |",
        "|---|---:|",
    ]
    for f in result["largest_batch_within_budget"]:
      more = " (search limit)" if f["hit_search_limit"] else (
          f" (< {f['smallest_tried_that_does_not_fit']})")
      lines.append(f"| {f['config']} | {f['largest_batch']}{more} |")
  return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = result["rows"]
  names = [r["config"] for r in rows]
  fig, axes = plt.subplots(1, 2, figsize=(13, 5))
  y = np.arange(len(rows))
  axes[0].barh(y, [r["temp_bytes"] / 2**20 for r in rows], color="tab:blue")
  for r, yy in zip(rows, y, strict=True):
    if "temp_bound" in r:
      axes[0].plot([r["temp_bound"] / 2**20] * 2, [yy - 0.4, yy + 0.4], color="tab:red")
  axes[0].set_yticks(y, names)
  axes[0].invert_yaxis()
  axes[0].set_xlabel("compiled temporaries (MiB); red: target bound")
  axes[1].barh(y, [r["step_ratio"] for r in rows], color="tab:orange")
  axes[1].axvline(1.15, color="tab:red", ls="--", lw=1)
  axes[1].set_yticks(y, [])
  axes[1].invert_yaxis()
  axes[1].set_xlabel("step time / full-batch step (median); red: 1.15x")
  s = result["setup"]
  fig.suptitle(f"value_and_grad of a {s['layers']}-block transformer, d={s['d_model']},"
               f" seq={s['seq']}, global batch {s['global_batch']} ({s['backend']})")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


if __name__ == "__main__":
  main()
