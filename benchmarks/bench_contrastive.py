"""Benchmark: ``cached_microbatched`` against the whole batch and plain ``microbatched``;
the tiled losses (``contrastive.clip_loss``, ``siglip_loss``) against the dense ones.

Two towers (an MLP over tokens, mean-pooled, normalised), CLIP's and SigLIP's losses:
per k, ``harness.compare`` against the whole batch; by batch, what stays whole-batch.
The tiled losses (``--tiled``, or after the above): the temporaries and step time of
``value_and_grad`` of the loss alone, dense and tiled::

  python benchmarks/bench_contrastive.py                   # ~15 minutes on 2 CPU cores
  python benchmarks/bench_contrastive.py --quick --out /tmp/contrastive   # smoke
  python benchmarks/bench_contrastive.py --tiled           # results/contrastive_tiled.*
"""

from __future__ import annotations

import os
import sys
from typing import Any

import harness
import jax
import jax.numpy as jnp

import optax_accum as oa
from optax_accum import contrastive


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
  """:func:`dense_clip` of the towers' embeddings at temperature ``exp(-t)``."""
  return dense_clip(emb[0], emb[1], jnp.exp(-p["t"]))


def siglip(p: dict[str, Any], emb: list[jax.Array], *_: Any) -> jax.Array:
  return dense_siglip(emb[0], emb[1], jnp.exp(-p["t"]), p["b"])


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


def dense_clip(x: jax.Array, y: jax.Array, t: jax.Array) -> jax.Array:
  s = x @ y.T / t
  return -(jnp.trace(jax.nn.log_softmax(s, axis=1)) + jnp.trace(jax.nn.log_softmax(s, axis=0))
           ) / (2 * len(s))


def dense_siglip(x: jax.Array, y: jax.Array, t: jax.Array, b: jax.Array) -> jax.Array:
  s = x @ y.T / t + b
  return -jnp.sum(jax.nn.log_sigmoid((2 * jnp.eye(len(s)) - 1) * s)) / len(s)


TILED = {"CLIP": (dense_clip, contrastive.clip_loss, (0.07,)),
         "SigLIP": (dense_siglip, contrastive.siglip_loss, (0.1, -10.0))}


def tiled_losses(a: Any) -> list[dict[str, Any]]:
  """Per loss and batch: compiled temporaries, dense and tiled, their step times and the
  tiled's difference from the dense."""
  rows = []
  for name, (dense, tiled, scalars) in TILED.items():
    argnums = tuple(range(2 + len(scalars)))
    for batch in a.sizes:
      shapes = [jax.ShapeDtypeStruct((batch, a.dim), jnp.float32)] * 2 + [
          jax.ShapeDtypeStruct((), jnp.float32)] * len(scalars)
      compiled = {k: jax.jit(jax.value_and_grad(f, argnums=argnums)).lower(*shapes).compile()
                  for k, f in (("dense", dense), ("tiled", tiled))}
      row = {"loss": name, "batch": batch, **{f"{k}_temp_bytes": int(
          c.memory_analysis().temp_size_in_bytes) for k, c in compiled.items()}}
      rows.append(row)
      kx, ky = jax.random.split(jax.random.key(2))  # unit rows, y near x
      x = jax.random.normal(kx, (batch, a.dim))
      unit = lambda v: v / jnp.linalg.norm(v, axis=1, keepdims=True)
      args = unit(x), unit(x + jax.random.normal(ky, (batch, a.dim))), *map(jnp.float32, scalars)
      runs = {k: (lambda c=c, args=args: jax.block_until_ready(c(*args)))
              for k, c in compiled.items()
              if k == "tiled" or row["dense_temp_bytes"] <= a.max_dense_gib * 2**30}
      secs = harness.interleaved(runs, a.rounds)
      row["tiled_s"] = harness.median(secs["tiled"])
      if "dense" in runs:
        (value, grads), (ref, ref_grads) = (compiled[k](*args) for k in ("tiled", "dense"))
        row.update(dense_s=harness.median(secs["dense"]),
                   time_ratio=harness.paired_ratio(secs["tiled"], secs["dense"]),
                   loss_rel_diff=abs(float(value) - float(ref)) / abs(float(ref)),
                   grad_rel_diff=harness.rel_diff(grads, ref_grads))
      print(row, flush=True)
  return rows


def tiled_checks(rows: list[dict[str, Any]]) -> list[str]:
  """The targets: linear growth, 0.1x the dense at 16,384 (or the middle size), 1.5x time."""
  lines = []
  for name in TILED:
    mine = [r for r in rows if r["loss"] == name]
    growth = mine[-1]["tiled_temp_bytes"] / mine[-2]["tiled_temp_bytes"]
    share = mine[1]["tiled_temp_bytes"] / mine[1]["dense_temp_bytes"]
    timed = [r["time_ratio"] for r in mine if "time_ratio" in r]
    lines.append(
        f"- {name}: temporaries x{growth:.2f} from B = {mine[-2]['batch']:,} to"
        f" {mine[-1]['batch']:,} (target <= 2.2: {'met' if growth <= 2.2 else 'MISSED'});"
        f" {share:.4f}x the dense at {mine[1]['batch']:,} (target <= 0.1:"
        f" {'met' if share <= 0.1 else 'MISSED'})" + (
            f"; time at most {max(timed):.2f}x the dense where it runs (target <= 1.5:"
            f" {'met' if max(timed) <= 1.5 else 'MISSED'})" if timed else "") + ".")
  return lines


def tiled_markdown(r: dict[str, Any]) -> str:
  s, rows = r["setup"], r["rows"]
  def cells(x: dict[str, Any]) -> list[Any]:
    return [x["loss"], f"{x['batch']:,}", harness.mib(x["dense_temp_bytes"]),
            harness.mib(x["tiled_temp_bytes"]),
            f"{x['tiled_temp_bytes'] / x['dense_temp_bytes']:.4f}x",
            f"{x['dense_s']:.2f}" if "dense_s" in x else "not run (compiled only)",
            f"{x['tiled_s']:.2f}", f"{x['time_ratio']:.2f}x" if "time_ratio" in x else "-",
            f"{x['grad_rel_diff']:.1e}" if "grad_rel_diff" in x else "-"]
  head = ("loss | B | dense temporaries (MiB) | tiled (MiB) | tiled / dense | dense step (s) |"
          " tiled step (s) | tiled / dense time | max rel. grad diff")
  return "\n".join([
      f"`python benchmarks/bench_contrastive.py {' '.join(s['argv'])}`: `value_and_grad` of the"
      f" loss alone, [B, {s['dim']}] float32 embeddings, default tiles; {s['where']}, jax"
      f" {s['jax']}, {s['date']}; step: the median of {s['rounds']} rounds, the ratio the median"
      " of same-round ratios.", "", *harness.table(head, "lrrrrrrrr", [cells(x) for x in rows]),
      "", *tiled_checks(rows)])


def tiled_plot(r: dict[str, Any]) -> Any:
  fig, axes = harness.pyplot().subplots(1, len(TILED), figsize=(11, 4), dpi=110)
  for ax, name in zip(axes, TILED, strict=True):
    mine = [x for x in r["rows"] if x["loss"] == name]
    for kind, color in (("dense", "tab:red"), ("tiled", "tab:blue")):
      ax.loglog([x["batch"] for x in mine], [x[f"{kind}_temp_bytes"] / 2**20 for x in mine],
                "o-", color=color, label=kind)
    ax.set_title(f"{name}: value_and_grad temporaries")
    ax.set_xlabel("batch B")
    ax.set_ylabel("MiB")
    ax.legend()
  return fig


def main_tiled(a: Any, argv: list[str] | None) -> dict[str, Any]:
  result = {"setup": {**vars(a), "argv": list(argv or []), "out": None, **harness.machine(),
                      "where": f"XLA:CPU ({os.cpu_count()} cores)"}, "rows": tiled_losses(a)}
  harness.write(a.out, "contrastive_tiled", result, tiled_markdown(result), tiled_plot)
  return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
  # The tiled losses' batch sizes and embedding dim; the dense one runs where its temporaries
  # are at most max_dense_gib.
  ap = harness.parser(
      __doc__, quick="tiny towers, batch 32, k 1 2 4, 2 rounds: a smoke run", width=128,
      layers=4, seq=16, d_in=32, emb=64, batch=256, micro=32, rounds=5, iters=2,
      ks=[1, 2, 4, 8, 16], sizes=[4096, 16384, 32768], dim=256, max_dense_gib=8.0)
  ap.add_argument("--tiled", action="store_true", help="the tiled losses only")
  a = ap.parse_args(argv)
  if a.quick:
    a.width, a.layers, a.seq, a.batch, a.ks, a.rounds = 16, 1, 4, 32, [1, 2, 4], 2
    a.sizes, a.dim = [256, 1024, 2048], 32
  if a.tiled:
    return main_tiled(a, argv)
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
  return {**result, "tiled": main_tiled(a, argv)}


if __name__ == "__main__":
  main(sys.argv[1:])
