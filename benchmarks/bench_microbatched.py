"""Benchmark: ``microbatched`` against the full batch, optax's ``microbatch``, remat and bf16.

A small decoder-only transformer at a fixed global batch; per configuration of its
value-and-grad (``harness.compare``) the temporaries against the bound
``1.3 x full / k + one gradient``, the step time and the gradient difference.

  python benchmarks/bench_microbatched.py                   # ~3 minutes on 2 CPU cores
  python benchmarks/bench_microbatched.py --quick --out /tmp/mb   # smoke, seconds
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import harness
import jax
import jax.numpy as jnp
import optax.microbatching

from optax_accum import Policy, microbatched, mixed_precision

Params = dict[str, Any]


def init_params(key: jax.Array, *, vocab: int, d_model: int, layers: int, seq: int) -> Params:
  """Embeddings, output projection and ``layers`` blocks stacked on a leading axis."""
  keys = iter(jax.random.split(key, 3 + 4 * layers))

  def dense(fan_in: int, fan_out: int) -> jax.Array:
    return jax.random.normal(next(keys), (fan_in, fan_out), jnp.float32) / math.sqrt(fan_in)

  blocks = [{"ln1": jnp.ones((d_model,)), "qkv": dense(d_model, 3 * d_model),
             "proj": dense(d_model, d_model), "ln2": jnp.ones((d_model,)),
             "fc1": dense(d_model, 4 * d_model), "fc2": dense(4 * d_model, d_model)}
            for _ in range(layers)]
  return {"embed": jax.random.normal(next(keys), (vocab, d_model)) * 0.02,
          "pos": jax.random.normal(next(keys), (seq, d_model)) * 0.02,
          "ln_f": jnp.ones((d_model,)), "out": dense(d_model, vocab),
          "blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)}


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def block(p: Params, x: jax.Array, *, heads: int) -> jax.Array:
  b, s, d = x.shape
  q, k, v = jnp.split(_rms_norm(x, p["ln1"]) @ p["qkv"], 3, axis=-1)
  q, k, v = (t.reshape(b, s, heads, d // heads) for t in (q, k, v))
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads)
  logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, jnp.asarray(-1e4, logits.dtype))
  attn = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(x.dtype)
  x = x + jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, s, d) @ p["proj"]
  return x + jax.nn.gelu(_rms_norm(x, p["ln2"]) @ p["fc1"]) @ p["fc2"]


def make_loss(*, heads: int, remat: bool) -> Callable[[Params, dict], jax.Array]:
  """Mean next-token cross-entropy; ``remat``: ``jax.checkpoint`` around each block."""
  blk = functools.partial(block, heads=heads)
  if remat:
    blk = jax.checkpoint(blk, policy=jax.checkpoint_policies.nothing_saveable)

  def loss_fn(params: Params, batch: dict) -> jax.Array:
    tokens = batch["tokens"]
    x = params["embed"][tokens] + params["pos"][None, : tokens.shape[1]]
    x, _ = jax.lax.scan(lambda x, p: (blk(p, x), None), x, params["blocks"])
    logits = (_rms_norm(x, params["ln_f"]) @ params["out"]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
  return loss_fn


def configs(ks: list[int], trick_k: int) -> list[dict[str, Any]]:
  """Full batch first; then each k with ours and optax's; then remat / bf16 alone and
  with ``microbatched`` at ``trick_k``."""
  out = [{"k": 1, "impl": "full", "remat": False, "bf16": False}]
  out += [{"k": k, "impl": impl, "remat": False, "bf16": False}
          for k in ks for impl in ("ours", "optax")]
  for k, impl in ((1, "full"), (trick_k, "ours")):
    out += [{"k": k, "impl": impl, "remat": r, "bf16": b}
            for r, b in ((True, False), (False, True), (True, True))]
  return out


def config_name(cfg: dict[str, Any]) -> str:
  names = {"full": "full batch", "ours": f"microbatched k={cfg['k']}",
           "optax": f"optax microbatch k={cfg['k']}"}
  return " + ".join([names[cfg["impl"]], *[t for t in ("remat", "bf16") if cfg[t]]])


def grad_fn(cfg: dict[str, Any], heads: int, batch_size: int) -> Callable:
  loss = make_loss(heads=heads, remat=cfg["remat"])
  if cfg["bf16"]:
    loss = mixed_precision(loss, Policy.from_string("params=f32,compute=bf16,output=f32"))
  fn = jax.value_and_grad(loss)
  if cfg["impl"] == "ours":
    fn = microbatched(fn, cfg["k"])
  elif cfg["impl"] == "optax":
    fn = optax.microbatching.microbatch(
        fn, argnums=1, microbatch_size=batch_size // cfg["k"],
        accumulator=optax.microbatching.AccumulationType.MEAN)
  return fn


def markdown(result: dict[str, Any]) -> str:
  def bound(r: dict[str, Any]) -> str:
    if "temp_bound" not in r:
      return ""
    met = "met" if r["temp_bytes"] <= r["temp_bound"] else "**missed**"
    return f"{harness.mib(r['temp_bound'])} {met}"
  s = result["setup"]
  return "\n".join([
      f"`python benchmarks/bench_microbatched.py {' '.join(s['argv'])}`: transformer d_model"
      f" {s['d_model']}, {s['layers']} blocks (scan), {s['heads']} heads, seq {s['seq']}, vocab"
      f" {s['vocab']}, {s['params']:,} params (one f32 gradient ="
      f" {harness.mib(s['grad_bytes'])} MiB),"
      f" global batch {s['global_batch']}; {s['backend']} ({s['device']}, {s['cpu_count']}"
      f" cores), jax {s['jax']}, {s['date']}; timing: median of {s['rounds']} interleaved"
      " rounds, ratio to the full-batch step of the same round.", "",
      *harness.compare_table(result["rows"], ("bound 1.3 full / k + 1 gradient (MiB)", bound)),
      ""])


def main(argv: list[str] | None = None) -> None:
  # batch: the global batch (examples); trick_k: the k combined with remat and bf16; rounds:
  # interleaved timing rounds, iters steps per config each.
  ap = harness.parser(__doc__, quick="d_model 32, 1 block, seq 16, batch 16, k 2 and 4, 2 rounds:"
                      " a smoke run", d_model=128, heads=4, layers=2, seq=64, vocab=512, batch=64,
                      ks=[2, 4, 8, 16], trick_k=8, rounds=5, iters=3)
  args = ap.parse_args(argv)
  if args.quick:
    args.d_model, args.heads, args.layers, args.seq, args.vocab = 32, 2, 1, 16, 64
    args.batch, args.ks, args.trick_k, args.rounds, args.iters = 16, [2, 4], 2, 2, 1
  t0 = time.perf_counter()
  params = init_params(jax.random.key(0), vocab=args.vocab, d_model=args.d_model,
                       layers=args.layers, seq=args.seq)
  batch = {"tokens": jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0,
                                        args.vocab)}
  cfgs, n = configs(args.ks, args.trick_k), sum(x.size for x in jax.tree.leaves(params))
  rows = harness.compare([(config_name(c), grad_fn(c, args.heads, args.batch)) for c in cfgs],
                         (params, batch), args.rounds, args.iters)
  for row, cfg in zip(rows, cfgs, strict=True):  # (the full batch, cfgs[0], first)
    row.update(cfg)
    if row["k"] > 1 and not (row["remat"] or row["bf16"]):
      row["temp_bound"] = 1.3 * rows[0]["temp_bytes"] / row["k"] + 4 * n  # + one gradient
  result = {"setup": {"argv": list(argv or []), "d_model": args.d_model, "heads": args.heads,
                      "layers": args.layers, "seq": args.seq, "vocab": args.vocab,
                      "global_batch": args.batch, "params": int(n), "grad_bytes": int(4 * n),
                      "rounds": args.rounds, "iters": args.iters, **harness.machine()},
            "rows": rows, "wall_seconds": time.perf_counter() - t0}
  harness.write(args.out, "microbatched", result, markdown(result),
                lambda r: harness.bars(r["rows"]))


if __name__ == "__main__":
  main(sys.argv[1:])
