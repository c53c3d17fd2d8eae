"""Benchmark: ``cached_microbatched`` against the whole batch and plain ``microbatched``.

Two towers (an MLP over a sequence of tokens, mean-pooled, normalised), CLIP's and SigLIP's
losses: per k, ``harness.compare`` against the whole batch's ``value_and_grad``. Then, at a
fixed micro-batch, by batch: what of them is whole-batch (cached's over plain's)::

  python benchmarks/bench_contrastive.py                   # ~5 minutes on 2 CPU cores
  python benchmarks/bench_contrastive.py --quick --out /tmp/contrastive   # smoke
"""

from __future__ import annotations

import sys
from typing import Any

import harness
import jax
import jax.numpy as jnp

import optax_accum as oa


def init(a: Any) -> dict[str, Any]:
  ks = iter(jax.random.split(jax.random.key(0), 4 * a.layers + 4))
  def dense(n: int, m: int) -> jax.Array:
    return jax.random.normal(next(ks), (n, m)) / n**0.5
  def tower() -> dict[str, Any]:
    return {"in": dense(a.d_in, a.width), "out": dense(a.width, a.emb), "blocks": [
        (dense(a.width, 4 * a.width), dense(4 * a.width, a.width) / 4) for _ in range(a.layers)]}
  return {"towers": [tower(), tower()], "t": jnp.log(10.0), "b": jnp.asarray(-10.0)}


def embed(p: dict[str, Any], batch: jax.Array) -> list[jax.Array]:
  out = []
  for i, tower in enumerate(p["towers"]):
    h = batch[:, i] @ tower["in"]
    for w1, w2 in tower["blocks"]:
      h = h + jax.nn.gelu(h @ w1) @ w2
    e = jnp.mean(h, axis=1) @ tower["out"]
    out.append(e / jnp.linalg.norm(e, axis=-1, keepdims=True))
  return out


def clip(p: dict[str, Any], emb: list[jax.Array], *_: Any) -> jax.Array:
  logits = jnp.exp(p["t"]) * emb[0] @ emb[1].T
  return -(jnp.trace(jax.nn.log_softmax(logits)) + jnp.trace(jax.nn.log_softmax(logits.T))
           ) / (2 * len(logits))


def siglip(p: dict[str, Any], emb: list[jax.Array], *_: Any) -> jax.Array:
  logits = jnp.exp(p["t"]) * emb[0] @ emb[1].T + p["b"]
  return -jnp.sum(jax.nn.log_sigmoid((2 * jnp.eye(len(logits)) - 1) * logits)) / len(logits)


def whole_batch_part(a: Any, params: dict[str, Any], rows: int) -> dict[str, int]:
  """Temporaries at ``rows`` examples in micro-batches of ``--micro``: cached, and plain
  ``microbatched`` (which holds nothing whole-batch)."""
  def temp_bytes(fn: Any) -> int:
    batch = jnp.zeros((rows, 2, a.seq, a.d_in))
    return int(jax.jit(fn).lower(params, batch).compile().memory_analysis().temp_size_in_bytes)
  whole, k = jax.value_and_grad(lambda p, b: clip(p, embed(p, b))), rows // a.micro
  return {"batch": rows, "k": k, "all": temp_bytes(oa.cached_microbatched(embed, clip, k)),
          "plain": temp_bytes(oa.microbatched(whole, k))}


def markdown(r: dict[str, Any]) -> str:
  s, loss = r["setup"], ("loss", lambda x: f"{x['loss']:.4f}")
  return "\n".join([
      f"`python benchmarks/bench_contrastive.py {' '.join(s['argv'])}`: two towers, {s['layers']}"
      f" MLP blocks ({s['width']} wide, x4 inner) over {s['seq']} tokens of {s['d_in']}, pooled"
      f" to {s['emb']}; batch {s['batch']}; {s['backend']} ({s['cpu_count']} cores), jax"
      f" {s['jax']}, {s['date']}; step: the median of {s['rounds']} rounds' same-round ratio.", "",
      *[line for name, rows in r["losses"].items()
        for line in (f"## {name}", "", *harness.compare_table(rows, loss), "")],
      f"## What stays whole-batch (CLIP, micro-batches of {s['micro']})", "",
      *harness.table("batch | k | cached (MiB) | plain microbatched (MiB) | whole-batch part",
                     "rrrrr", [[x["batch"], x["k"], harness.mib(x["all"]), harness.mib(x["plain"]),
                                f"{(x['all'] - x['plain']) / x['all']:.0%}"]
                               for x in r["whole_batch"]])])


def main(argv: list[str] | None = None) -> dict[str, Any]:
  ap = harness.parser(
      __doc__, quick="tiny towers, batch 32, k 1 2 4, 2 rounds: a smoke run", width=128,
      layers=4, seq=16, d_in=32, emb=64, batch=256, micro=32, rounds=5, iters=2,
      ks=[1, 2, 4, 8, 16])
  a = ap.parse_args(argv)
  if a.quick:
    a.width, a.layers, a.seq, a.batch, a.ks, a.rounds = 16, 1, 4, 32, [1, 2, 4], 2
  params, losses = init(a), {}
  batch = jax.random.normal(jax.random.key(1), (a.batch, 2, a.seq, a.d_in))
  for name, loss in (("CLIP", clip), ("SigLIP", siglip)):
    whole = jax.value_and_grad(lambda p, b, loss=loss: loss(p, embed(p, b)))
    cached = [(f"cached_microbatched k={k}", oa.cached_microbatched(embed, loss, k)) for k in a.ks]
    plain = [(f"microbatched k={k} (own negatives)", oa.microbatched(whole, k)) for k in a.ks[1:]]
    losses[name] = harness.compare([("whole batch", whole), *cached, *plain], (params, batch),
                                   a.rounds, a.iters)
  result = {"setup": {**vars(a), "argv": list(argv or []), "out": None, **harness.machine()},
            "losses": losses, "whole_batch": [whole_batch_part(a, params, a.micro * 2**i)
                                              for i in range(3, 5 if a.quick else 9)]}
  harness.write(a.out, "contrastive", result, markdown(result), lambda r: harness.bars(
      [dict(x, config=f"{n}: {x['config']}") for n, rows in r["losses"].items() for x in rows]))
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
