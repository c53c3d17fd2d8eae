"""Bytes reduced across devices per accumulation window, read from the compiled HLO.

k = 8 micro-batches on 8 devices: each variant's train step compiled (nothing runs), its
collectives (``debug.hlo_collectives``) weighted by how often they run per window.

    python benchmarks/bench_communication.py        # 8 host CPU devices, seconds
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import contextlib
import platform
from functools import partial
from typing import Any

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum as oa
from optax_accum.debug import hlo_collectives
from optax_accum.sharding import (
  broadcast_like,
  defer_reduction,
  per_device_state,
  shard_map_specs,
)

K = 8
N_DEV = 8
WIDTH = 512  # two 512x512 layers: ~0.5 M params, 2 MiB of f32 gradients
PER_DEV = 4
REDUCTIONS = ("all-reduce", "all-reduce-start", "reduce-scatter")
GATHERS = ("all-gather", "all-gather-start")
# Plain jit, Explicit mesh: every param replicated, or sharded over "data" (ZeRO-3).
LAYOUTS = {
    "replicated": {"w1": P(), "b1": P(), "w2": P(), "b2": P()},
    "FSDP": {"w1": P("data", None), "b1": P("data"), "w2": P("data", None), "b2": P("data")},
}


def init_params() -> dict[str, jax.Array]:
  """Two ``WIDTH x WIDTH`` layers with biases: ``w1, b1, w2, b2``."""
  rng = np.random.default_rng(0)
  layer = lambda: jnp.asarray(rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH), jnp.float32)
  return {name: layer() if name[0] == "w" else jnp.zeros(WIDTH, jnp.float32)
          for name in ("w1", "b1", "w2", "b2")}


def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
  z = x @ params["w1"]
  h = jnp.tanh(z + broadcast_like(params["b1"], z))
  o = h @ params["w2"]
  return jnp.mean((o + broadcast_like(params["b2"], o) - y) ** 2)


def bytes_per_window(compiled: Any, calls_per_window: int) -> dict[str, Any]:
  """Reduced and all-gathered bytes per window, and where the reductions sit."""
  total = gathered = 0
  where = []
  for c in hlo_collectives(compiled):
    runs = calls_per_window
    for kind, which in c.context:
      if kind == "conditional":
        runs = 1 if which == 1 else calls_per_window - 1
      elif kind == "while" and which == "body":
        runs *= K
    if c.op in GATHERS:
      gathered += c.bytes * runs
    elif c.op in REDUCTIONS:
      total += c.bytes * runs
      where.append({"op": c.op, "bytes": c.bytes, "context": [list(x) for x in c.context],
                    "runs_per_window": runs})
  return {"bytes_per_window": total, "gathered_per_window": gathered, "all_reduces": where}


def explicit_mesh() -> Mesh:
  return jax.make_mesh((N_DEV,), ("data",), axis_types=(AxisType.Explicit,),
                       devices=jax.devices()[:N_DEV])


def plain_jit_rows(params: Any, x: jax.Array, y: jax.Array,
                   opt: optax.GradientTransformation) -> list[tuple[str, str, dict[str, Any]]]:
  """Ours (defer_reduction + axis_name) and naive, replicated and FSDP, on an Explicit mesh."""
  mesh = explicit_mesh()

  def step(tx: Any, ours: bool, p: Any, s: Any, xb: jax.Array, yb: jax.Array) -> Any:
    # Ours: unreduced gradients. Naive: FSDP params all-gathered (their
    # gradient is then all-reduced on every call), replicated ones as they are.
    local = defer_reduction(p, "data") if ours else jax.tree.map(
        lambda a: jax.reshard(a, P()), p)
    grads = jax.grad(loss_fn)(local, xb, yb)
    return oa.update_and_apply(tx, grads, s, p)

  rows = []
  with jax.set_mesh(mesh):
    xb, yb = jax.device_put(x, P("data")), jax.device_put(y, P("data"))
    for layout, specs in LAYOUTS.items():
      placed = {name: jax.device_put(v, specs[name]) for name, v in params.items()}
      for ours in (True, False):
        tx = oa.accumulate(K, opt, axis_name="data") if ours else oa.accumulate(K, opt)
        compiled = jax.jit(partial(step, tx, ours)).lower(placed, tx.init(placed), xb, yb).compile()
        name = ("accumulate(k, opt, axis_name) + defer_reduction, plain jit (ours)" if ours
                else "naive: jax.grad(params), accumulate(k, opt), plain jit")
        rows.append((f"{name}, {layout}", "across steps", bytes_per_window(compiled, K)))
  return rows


def plot(result: dict[str, Any]) -> Any:
  names = [r["variant"] for r in result["rows"]]
  values = [r["bytes_per_window"] / 2**20 for r in result["rows"]]
  fig, ax = harness.pyplot().subplots(figsize=(9, 0.6 * len(names) + 1.2), dpi=120)
  ax.barh(range(len(names)), values,
          color=["tab:green" if "(ours)" in n else "tab:red" for n in names])
  ax.set_yticks(range(len(names)), names, fontsize=8)
  ax.invert_yaxis()
  ax.set_xlim(0, 1.15 * max(values))
  ax.set_xlabel(f"MiB reduced across devices per window (k={K}, {N_DEV} devices)")
  for i, v in enumerate(values):
    ax.text(v, i, f" {v:.2f}", va="center", fontsize=8)
  return fig


def main(argv: list[str] | None = None) -> None:
  args = harness.parser(__doc__).parse_args(argv)
  assert jax.device_count() >= N_DEV, "set XLA_FLAGS before jax is imported"
  mesh = Mesh(np.array(jax.devices()[:N_DEV]), ("data",))
  params = init_params()
  param_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
  x = y = jnp.zeros((N_DEV * PER_DEV, WIDTH), jnp.float32)
  opt = optax.adam(1e-3)
  rows = []

  def shard_mapped(tx: Any, specs: Any, reduce: Any) -> Any:
    """A jitted ``shard_map``ped train step: ``reduce`` of the per-device gradients."""
    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
             out_specs=(P(), specs))
    def step(p: Any, s: Any, xb: jax.Array, yb: jax.Array) -> Any:
      grads = reduce(jax.grad(loss_fn)(lax.pcast(p, "data", to="varying"), xb, yb))
      return harness.protocol_step(tx)(p, s, grads)
    return step

  # 1. accumulate(axis_name) under shard_map: all-reduce in the emitting branch. 2. Naive: pmean
  # of the gradients on every micro-step, then accumulate. 3. Plain jit, batch sharded, params
  # replicated (GSPMD inserts the all-reduce).
  tx = per_device_state(oa.accumulate(K, opt, axis_name="data"), "data")
  naive_tx = oa.accumulate(K, opt)
  specs = shard_map_specs(tx, params, "data")
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
  batch, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  for name, step, inputs in (
      ("accumulate(k, opt, axis_name) + shard_map (ours)", shard_mapped(tx, specs, lambda g: g),
       (params, state, x, y)),
      ("naive: pmean every micro-step, then accumulate", shard_mapped(
          naive_tx, P(), lambda g: lax.pmean(g, "data")), (params, naive_tx.init(params), x, y)),
      ("accumulate(k, opt) under plain jit (auto-sharded)", jax.jit(
          lambda p, s, xb, yb: harness.protocol_step(naive_tx)(p, s, jax.grad(loss_fn)(p, xb, yb))),
       jax.device_put((params, naive_tx.init(params), x, y), (rep, rep, batch, batch)))):
    rows.append((name, "across steps", bytes_per_window(step.lower(*inputs).compile(), K)))
  rows += plain_jit_rows(params, x, y, opt)

  # 4-7. microbatched: one reduction after the loop under shard_map with axis_name, and
  # under plain jit on an Explicit mesh (the batch's type says where it is split); under
  # plain jit with Auto axes it lands in the loop, unless axis_name="data" moves it after.
  def grad_fn(**kw: Any) -> Any:
    return oa.microbatched(jax.value_and_grad(lambda p, b: loss_fn(p, *b)), K, **kw)

  xs = jnp.zeros((N_DEV * PER_DEV * K, WIDTH), jnp.float32)
  for name, fn, on in (
      ("microbatched(fn, k, axis_name) + shard_map (ours)", jax.shard_map(
          grad_fn(axis_name="data"), mesh=mesh, in_specs=(P(), P("data")), out_specs=P()), None),
      ("microbatched(fn, k) under plain jit, Auto axes (naive)", grad_fn(), mesh),
      ("microbatched(fn, k, axis_name) under plain jit, Auto axes (ours)",
       grad_fn(axis_name="data"), mesh),
      ("microbatched(fn, k) under plain jit, Explicit axes (ours)", grad_fn(), explicit_mesh())):
    with contextlib.nullcontext() if on is None else jax.set_mesh(on):
      inputs = ((params, (xs, xs)) if on is None else
                (jax.device_put(params, P()), jax.device_put((xs, xs), P("data"))))
      rows.append((name, "in step", bytes_per_window(jax.jit(fn).lower(*inputs).compile(), 1)))

  result = {
      "k": K, "devices": N_DEV, "param_bytes": param_bytes, "jax": jax.__version__,
      "platform": f"{platform.machine()} {jax.default_backend()} (compiled HLO only)",
      "rows": [{"variant": name, "accumulation": kind, **data} for name, kind, data in rows]}
  by_name = {r["variant"]: r["bytes_per_window"] for r in result["rows"]}
  result["plain_jit_naive_over_ours"] = {
      layout: by_name[f"naive: jax.grad(params), accumulate(k, opt), plain jit, {layout}"]
      / by_name[f"accumulate(k, opt, axis_name) + defer_reduction, plain jit (ours), {layout}"]
      for layout in LAYOUTS}
  lines = [
      f"Bytes reduced across devices (all-reduce, reduce-scatter) per window, k = {K}"
      f" micro-batches, {N_DEV} devices, {param_bytes / 2**20:.2f} MiB of f32 gradients"
      f" (jax {jax.__version__}; from the compiled HLO;"
      " `python benchmarks/bench_communication.py`).",
      "",
      *harness.table(
          "variant | accumulation | bytes reduced per window | MiB | x gradient size"
          " | MiB all-gathered per window", "llrrrr",
          [[r["variant"], r["accumulation"], f"{r['bytes_per_window']:,}",
            harness.mib(r["bytes_per_window"]), f"{r['bytes_per_window'] / param_bytes:.2f}",
            harness.mib(r["gathered_per_window"])] for r in result["rows"]]),
  ]
  ratios = result["plain_jit_naive_over_ours"]
  lines += ["", "Plain jit on an Explicit mesh, naive / ours, bytes reduced per window: "
            + ", ".join(f"{layout} {r:.2f}x" for layout, r in ratios.items()) + "."]
  ops = sorted({c["op"] for r in result["rows"] for c in r["all_reduces"]})
  lines += ["", f"Reduction ops in these programs ({jax.default_backend()} backend):"
            f" {', '.join(ops)}."]
  if "reduce-scatter" not in ops:
    lines[-1] += (" The FSDP window's reduce-scatter to the params' sharding is lowered as an"
                  " all-reduce of the whole buffer (then a slice).")
  lines += ["", "FSDP all-gathers the params for the forward pass on every micro-step, in"
            " both paths (the last column)."]
  harness.write(args.out, "communication", result, "\n".join(lines).rstrip() + "\n", plot)


if __name__ == "__main__":
  main()
