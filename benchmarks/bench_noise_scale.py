"""Benchmark: what ``track_noise_scale`` costs, and how close its estimate lands.

* Cost: ``bench_accumulate.py``'s train steps (and one computing an MLP's gradient)
  without and with tracking: same-round ratios tracked / untracked, temporaries.
* The estimate: linear regression at ``w = w* + delta`` against the closed form
  ``B_simple``, per ``(d, sigma, b, k)`` and one weighted row.

  python benchmarks/bench_noise_scale.py            # about a minute
  python benchmarks/bench_noise_scale.py --quick    # 256K params, 5 rounds
"""

from __future__ import annotations

import sys
import time
from typing import Any

import bench_accumulate as ba
import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import optax_accum as oa

# (key, label, tracked) of each program.
PROGRAMS = [
    ("accumulate", "oa.accumulate: update + apply_updates", False),
    ("accumulate_tracked", "oa.accumulate(track_noise_scale=True): update + apply_updates", True),
    ("update_and_apply", "oa.update_and_apply", False),
    ("update_and_apply_tracked", "oa.update_and_apply, track_noise_scale=True", True),
    ("mlp_update_and_apply", "MLP gradient + oa.update_and_apply", False),
    ("mlp_update_and_apply_tracked", "MLP gradient + oa.update_and_apply, tracked", True),
]
PAIRS = [(key, f"{key}_tracked") for key, _, tracked in PROGRAMS if not tracked]
MLP_WIDTH, MLP_LAYERS, MLP_BATCH = 1024, 4, 32

DELTA_NORM, SEEDS, WINDOWS, DECAY = 0.5, 8, 400, 0.999
# (d, sigma, b, k), as in tests/test_noise_scale.py.
COMBOS = [(4, 0.1, 2, 4), (8, 0.5, 2, 8), (32, 0.5, 8, 4), (16, 1.75, 16, 16)]
WEIGHTED_SIZES = (1, 2, 5, 8)


def mlp_params(key: jax.Array) -> dict[str, jax.Array]:
  """``MLP_LAYERS`` dense layers of ``MLP_WIDTH``: 2 leaves each."""
  params = {}
  for i, k in enumerate(jax.random.split(key, MLP_LAYERS)):
    params[f"w{i}"] = jax.random.normal(k, (MLP_WIDTH, MLP_WIDTH)) / np.sqrt(MLP_WIDTH)
    params[f"b{i}"] = jnp.zeros((MLP_WIDTH,))
  return params


def mlp_loss(params: dict[str, jax.Array], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
  x, y = batch
  for i in range(MLP_LAYERS):
    x = x @ params[f"w{i}"] + params[f"b{i}"]
    x = jnp.tanh(x) if i < MLP_LAYERS - 1 else x
  return jnp.mean((x - y) ** 2)


def measure_cost(size: int, rounds: int) -> dict[str, Any]:
  """Times and temporaries of the programs at ``size`` params (and of the MLP steps)."""
  kp, kx, ky = jax.random.split(jax.random.key(0), 3)
  mlp = mlp_params(kp)
  batch = (jax.random.normal(kx, (MLP_BATCH, MLP_WIDTH)),
           jax.random.normal(ky, (MLP_BATCH, MLP_WIDTH)))
  params, grads = ba.make_tree(size), ba.make_tree(size, fill=1e-3)
  timers = {}
  for key, _, tracked in PROGRAMS:
    tx = oa.accumulate(ba.K_WINDOW, optax.adam(1e-3), track_noise_scale=tracked)
    if key.startswith("accumulate"):
      step = harness.protocol_step(tx)
    elif key.startswith("update_and_apply"):
      step = harness.fast_step(tx)
    else:  # the MLP's gradient computed in the step
      step = lambda p, s, b, tx=tx: oa.update_and_apply(tx, jax.grad(mlp_loss)(p, b), s, p)
    timers[key] = ba.compile_program(ba.Program(key, ba.K_WINDOW, step, tx.init),
                                     *((mlp, batch) if key.startswith("mlp") else (params, grads)))
  copy = ba.CopyTimer(64 * 2**20)
  ba.run_rounds(list(timers.values()), copy, rounds, ba.windows_for(size))
  pbytes = 4 * size
  mlp_bytes = 4 * sum(x.size for x in jax.tree.leaves(mlp))
  programs = {}
  for key, label, tracked in PROGRAMS:
    t = timers[key]
    pbytes_here = mlp_bytes if key.startswith("mlp") else pbytes
    programs[key] = {
        "label": label, "tracked": tracked,
        "mid_s": harness.median(t.samples["mid"]), "emit_s": harness.median(t.samples["emit"]),
        "temps_bytes": t.info["temps_bytes"], "temps_ratio": t.info["temps_bytes"] / pbytes_here,
        "param_bytes": pbytes_here, "conditionals": t.info["conditionals"]}
  pairs = [{"untracked": base, "tracked": tracked,
            **{f"{phase}_ratio": harness.paired_ratio(timers[tracked].samples[phase],
                                                      timers[base].samples[phase])
               for phase in ("mid", "emit")},
            "extra_temps_ratio": (programs[tracked]["temps_bytes"] - programs[base]["temps_bytes"])
            / programs[base]["param_bytes"]} for base, tracked in PAIRS]
  return {"size": size, "param_bytes": pbytes, "mlp_param_bytes": mlp_bytes, "rounds": rounds,
          "programs": programs, "pairs": pairs}


def simulate(d: int, sigma: float, sizes: tuple[int, ...], weighted: bool) -> np.ndarray:
  """``noise_scale`` (micro-batches) after ``WINDOWS`` windows, one per seed."""
  rng = np.random.default_rng(d)
  w_star = rng.normal(size=d)
  delta = rng.normal(size=d)
  delta *= DELTA_NORM / np.linalg.norm(delta)
  params = {"w": jnp.asarray(w_star + delta, jnp.float32)}
  w_star = jnp.asarray(w_star, jnp.float32)
  k, b_max = len(sizes), max(sizes)
  sizes_arr = jnp.asarray(sizes, jnp.float32)
  tx = oa.accumulate(k, optax.sgd(0.0), reduction="weighted" if weighted else "mean",
                     track_noise_scale=DECAY)

  def grad(key: jax.Array, size: jax.Array) -> jax.Array:
    kx, ke = jax.random.split(key)
    x = jax.random.normal(kx, (b_max, d))
    y = x @ w_star + sigma * jax.random.normal(ke, (b_max,))
    real = (jnp.arange(b_max) < size).astype(jnp.float32)
    return jax.grad(lambda v: 0.5 * jnp.sum(real * (x @ v - y) ** 2) / size)(params["w"])

  def one_seed(key: jax.Array) -> jax.Array:
    def body(state: Any, inp: tuple[jax.Array, jax.Array]) -> tuple[Any, None]:
      i, key = inp
      size = sizes_arr[i % k]
      kw = {"weight": size} if weighted else {}
      return tx.update({"w": grad(key, size)}, state, params, **kw)[1], None

    n = WINDOWS * k
    state = lax.scan(body, tx.init(params), (jnp.arange(n), jax.random.split(key, n)))[0]
    return oa.noise_scale(state)

  return np.asarray(jax.jit(jax.vmap(one_seed))(jax.random.split(jax.random.key(0), SEEDS)))


def closed_form_table() -> list[dict[str, Any]]:
  """Estimate vs ``B_simple`` for every combo, and the weighted row."""
  rows = []
  cases = [*((d, s, (b,) * k, False) for d, s, b, k in COMBOS), (8, 0.5, WEIGHTED_SIZES, True)]
  for d, sigma, sizes, weighted in cases:
    b = sum(sizes) / len(sizes)
    est = simulate(d, sigma, sizes, weighted) * b
    truth = d + 1 + sigma**2 * d / DELTA_NORM**2  # B_simple: tr(Sigma) / |G|^2 at w* + delta
    rows.append({
        "d": d, "sigma": sigma, "b": b, "k": len(sizes), "weighted": weighted,
        "sizes": list(sizes), "b_simple": truth, "estimate_mean": float(est.mean()),
        "estimate_sd": float(est.std(ddof=1)), "rel_error": float(est.mean() / truth - 1),
        "max_seed_rel_error": float(np.max(np.abs(est / truth - 1))),
        "seeds": SEEDS, "windows": WINDOWS, "decay": DECAY,
    })
  return rows


def markdown(result: dict[str, Any]) -> str:
  meta, cost = result["meta"], result["cost"]

  def estimate(r: dict[str, Any]) -> list[Any]:
    b = f"{r['b']:g}" + (f" (weighted {r['sizes']})" if r["weighted"] else "")
    return [r["d"], r["sigma"], b, r["k"], f"{r['b_simple']:.1f}", f"{r['estimate_mean']:.1f}",
            f"{r['rel_error']:+.1%}", f"{r['estimate_sd'] / r['b_simple']:.1%}",
            f"{r['max_seed_rel_error']:.1%}"]
  return "\n".join([
      "# Gradient noise scale: cost and accuracy", "",
      f"`python benchmarks/bench_noise_scale.py {' '.join(meta['argv'])}` on {meta['machine']}"
      f" ({meta['cpu_count']} CPUs, load {meta['loadavg']}), jax {meta['jax']},"
      f" optax {meta['optax']}; {meta['wall_s']} s.", "",
      f"## Cost: {ba.size_label(cost['size'])} params, adam, k = {ba.K_WINDOW}, train step,"
      " donated", "",
      f"Medians over {cost['rounds']} interleaved rounds; ratios are medians of the per-round"
      " ratio tracked / untracked (same round, seconds apart). Bars: mid-step within 1.1x,"
      " extra temporaries within 0.05x the param bytes.", "",
      "The MLP rows compute the gradient of a"
      f" {MLP_LAYERS}-layer MLP ({MLP_WIDTH} wide, {cost['mlp_param_bytes'] / 4 / 2**20:.1f}M"
      f" params) on a batch of {MLP_BATCH} inside the step.", "",
      *harness.table("program | mid-step ms | emit ms | temporaries / params", "lrrr", [
          [p["label"], f"{1e3 * p['mid_s']:.2f}", f"{1e3 * p['emit_s']:.2f}",
           f"{p['temps_ratio']:.3f}x"] for p in cost["programs"].values()]), "",
      *harness.table("tracked vs untracked | mid-step | emit | extra temporaries / params",
                     "lrrr", [[q["untracked"], f"{q['mid_ratio']:.3f}x",
                               f"{q['emit_ratio']:.3f}x", f"{q['extra_temps_ratio']:+.4f}x"]
                              for q in cost["pairs"]]), "",
      "## Estimate vs closed form", "",
      f"Linear regression at w = w* + delta, |delta| = {DELTA_NORM}, inner learning rate 0;"
      " B_simple = d + 1 + sigma^2 d / |delta|^2 examples. Estimate = noise_scale x b"
      f" (b: examples per micro-batch, the average for the weighted row); {SEEDS} seeds x"
      f" {WINDOWS} windows, decay {DECAY}.", "",
      *harness.table("d | sigma | b | k | B_simple | estimate (mean of seeds) | rel. error"
                     " | single-seed sd | worst seed", "r" * 9,
                     map(estimate, result["closed_form"])),
  ]) + "\n"


def main(argv: list[str] | None = None) -> None:
  """Runs the benchmark and writes the reports."""
  ap = harness.parser(__doc__, quick="256K params, 5 rounds")
  ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 41)")
  args = ap.parse_args(argv)
  size = 2**18 if args.quick else 2**22
  rounds = args.rounds or (5 if args.quick else 41)

  start = time.perf_counter()
  cost = measure_cost(size, rounds)
  table = closed_form_table()
  result = {"meta": {"argv": list(argv if argv is not None else sys.argv[1:]),
                     **harness.machine(), "wall_s": round(time.perf_counter() - start, 1)},
            "cost": cost, "closed_form": table}
  harness.write(args.out, "noise_scale", result, markdown(result))


if __name__ == "__main__":
  main()
