"""Bytes all-reduced per accumulation window, read from the compiled HLO.

For k = 8 micro-batches on 8 data-parallel devices, each variant's train step
is lowered and compiled (nothing is run), its all-reduces are listed with
:func:`optax_accum.debug.hlo_collectives`, and each is weighted by how many
times it runs per window:

* on the step's straight-line path: once per call (k calls per window for
  across-step accumulation, 1 call for in-step ``microbatched``);
* in the ``lax.cond``'s emitting branch (branch 1): once per window;
  in the mid-step branch (branch 0): k - 1 times;
* in a ``while`` body (the micro-batch loop): k times per call.

Run (8 host CPU devices are forced; a few seconds)::

    python benchmarks/bench_communication.py

writes ``benchmarks/results/communication.{json,md,png}``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json
import platform
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum as oa
from optax_accum.debug import hlo_collectives
from optax_accum.sharding import per_device_state, shard_map_specs

K = 8
N_DEV = 8
WIDTH = 512  # two 512x512 layers: ~0.5 M params, 2 MiB of f32 gradients
PER_DEV = 4
RESULTS = Path(__file__).resolve().parent / "results"


def init_params() -> dict[str, jax.Array]:
  rng = np.random.default_rng(0)
  return {
      "w1": jnp.asarray(rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH), jnp.float32),
      "b1": jnp.zeros(WIDTH, jnp.float32),
      "w2": jnp.asarray(rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH), jnp.float32),
      "b2": jnp.zeros(WIDTH, jnp.float32),
  }


def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


def bytes_per_window(compiled: Any, calls_per_window: int) -> dict[str, Any]:
  """All-reduce bytes per window, and where the all-reduces sit."""
  total = 0
  where = []
  for c in hlo_collectives(compiled):
    if c.op not in ("all-reduce", "all-reduce-start", "reduce-scatter"):
      continue
    runs = calls_per_window
    for kind, which in c.context:
      if kind == "conditional":
        runs = 1 if which == 1 else calls_per_window - 1
      elif kind == "while" and which == "body":
        runs *= K
    total += c.bytes * runs
    where.append({"op": c.op, "bytes": c.bytes, "context": [list(x) for x in c.context],
                  "runs_per_window": runs})
  return {"bytes_per_window": total, "all_reduces": where}


def main() -> dict[str, Any]:
  assert jax.device_count() >= N_DEV, "set XLA_FLAGS before jax is imported"
  mesh = Mesh(np.array(jax.devices()[:N_DEV]), ("data",))
  params = init_params()
  param_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
  x = jnp.zeros((N_DEV * PER_DEV, WIDTH), jnp.float32)
  y = jnp.zeros((N_DEV * PER_DEV, WIDTH), jnp.float32)
  opt = optax.adam(1e-3)
  rows = []

  # 1. accumulate(axis_name) under shard_map: all-reduce in the emitting branch.
  tx = per_device_state(oa.accumulate(K, opt, axis_name="data"), "data")
  specs = shard_map_specs(tx, params, "data")
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

  @jax.jit
  @partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
           out_specs=(P(), specs))
  def ours_step(p: Any, s: Any, xb: jax.Array, yb: jax.Array) -> Any:
    grads = jax.grad(loss_fn)(lax.pcast(p, "data", to="varying"), xb, yb)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  rows.append(("accumulate(k, opt, axis_name) + shard_map (ours)", "across steps",
               bytes_per_window(ours_step.lower(params, state, x, y).compile(), K)))

  # 2. Naive: pmean of the gradients on every micro-step, then accumulate.
  naive_tx = oa.accumulate(K, opt)

  @jax.jit
  @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
           out_specs=(P(), P()))
  def naive_step(p: Any, s: Any, xb: jax.Array, yb: jax.Array) -> Any:
    grads = lax.pmean(jax.grad(loss_fn)(lax.pcast(p, "data", to="varying"), xb, yb), "data")
    updates, s = naive_tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  rows.append(("naive: pmean every micro-step, then accumulate", "across steps",
               bytes_per_window(
                   naive_step.lower(params, naive_tx.init(params), x, y).compile(), K)))

  # 3. Plain jit, batch sharded, params replicated (GSPMD inserts the all-reduce).
  batch = NamedSharding(mesh, P("data"))
  rep = NamedSharding(mesh, P())
  jit_params = jax.device_put(params, rep)

  @jax.jit
  def jit_step(p: Any, s: Any, xb: jax.Array, yb: jax.Array) -> Any:
    updates, s = naive_tx.update(jax.grad(loss_fn)(p, xb, yb), s, p)
    return optax.apply_updates(p, updates), s

  rows.append(("accumulate(k, opt) under plain jit (auto-sharded)", "across steps",
               bytes_per_window(jit_step.lower(
                   jit_params, jax.device_put(naive_tx.init(params), rep),
                   jax.device_put(x, batch), jax.device_put(y, batch)).compile(), K)))

  notes = []
  try:
    from optax_accum.microbatching import microbatched
  except ImportError:
    microbatched = None
    notes.append("optax_accum.microbatching not present: in-step rows skipped.")
  if microbatched is not None:
    xs = jnp.zeros((N_DEV * PER_DEV * K, WIDTH), jnp.float32)
    ys = jnp.zeros_like(xs)

    def batch_loss(p: Any, b: Any) -> jax.Array:
      return loss_fn(p, b[0], b[1])

    # 4. microbatched(axis_name) under shard_map: one reduction after the loop.
    grad_fn = microbatched(jax.value_and_grad(batch_loss), K, axis_name="data")
    compiled = None
    for check_vma in (True, False):
      try:
        mb_step = jax.jit(jax.shard_map(
            grad_fn, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
            check_vma=check_vma))
        compiled = mb_step.lower(params, (xs, ys)).compile()
        if not check_vma:
          notes.append("microbatched + shard_map needed check_vma=False (see report).")
        break
      except TypeError as e:
        error = e
    if compiled is None:
      raise error
    rows.append(("microbatched(fn, k, axis_name) + shard_map (ours)", "in step",
                 bytes_per_window(compiled, 1)))
    # 5. microbatched under plain jit: the all-reduce lands in the loop.
    mb_jit = jax.jit(microbatched(jax.value_and_grad(batch_loss), K))
    rows.append(("microbatched(fn, k) under plain jit", "in step",
                 bytes_per_window(mb_jit.lower(
                     jit_params, (jax.device_put(xs, batch), jax.device_put(ys, batch))
                 ).compile(), 1)))

  result = {
      "k": K,
      "devices": N_DEV,
      "param_bytes": param_bytes,
      "jax": jax.__version__,
      "platform": f"{platform.machine()} {jax.default_backend()} (compiled HLO only)",
      "notes": notes,
      "rows": [{"variant": name, "accumulation": kind, **data} for name, kind, data in rows],
  }
  RESULTS.mkdir(parents=True, exist_ok=True)
  (RESULTS / "communication.json").write_text(json.dumps(result, indent=2) + "\n")

  lines = [
      f"Bytes all-reduced per window, k = {K} micro-batches, {N_DEV} devices, "
      f"{param_bytes / 2**20:.2f} MiB of f32 gradients (jax {jax.__version__}; "
      "from the compiled HLO; `python benchmarks/bench_communication.py`).",
      "",
      "| variant | accumulation | bytes all-reduced per window | MiB | x gradient size |",
      "|---|---|---:|---:|---:|",
  ]
  for row in result["rows"]:
    b = row["bytes_per_window"]
    lines.append(f"| {row['variant']} | {row['accumulation']} | {b:,} | {b / 2**20:.2f} |"
                 f" {b / param_bytes:.2f} |")
  lines += [""] + [f"Note: {n}" for n in notes]
  (RESULTS / "communication.md").write_text("\n".join(lines).rstrip() + "\n")

  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["variant"] for r in result["rows"]]
    values = [r["bytes_per_window"] / 2**20 for r in result["rows"]]
    colors = ["tab:green" if "(ours)" in n else "tab:red" for n in names]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(names) + 1.2))
    ax.barh(range(len(names)), values, color=colors)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.15 * max(values))
    ax.set_xlabel(f"MiB all-reduced per window (k={K}, {N_DEV} devices)")
    for i, v in enumerate(values):
      ax.text(v, i, f" {v:.2f}", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "communication.png", dpi=120)
  except ImportError:
    pass
  print((RESULTS / "communication.md").read_text())
  return result


if __name__ == "__main__":
  main()
