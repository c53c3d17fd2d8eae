"""Benchmark: the train-step cost of accumulation, against three anchors.

Train steps (params and state donated, k = 4; NOTES.md says how they are timed):
``oa.accumulate``, ``oa.update_and_apply`` and ``oa.MultiSteps`` against the plain
optimizer, ``optax.MultiSteps`` and the 3P floor; per program, temporaries and
conditionals; the tracked rows at 4M, adam.

  python benchmarks/bench_accumulate.py --rounds 41      # 1M, 4M, 16M; sgd, adam
  python benchmarks/bench_accumulate.py --quick          # 256K, 3 rounds of 2 windows (smoke)
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum as oa
from optax_accum.debug import conditionals

Tree = Any
LEAVES = 8
K_WINDOW = 4
FLOOR_PASSES = 3  # acc += g: read g, read acc, write acc
SIZES, OPTIMIZERS = (2**20, 2**22, 2**24), {"sgd": optax.sgd, "adam": optax.adam}
PROGRAMS: dict[str, str] = {
    "plain": "plain step",
    "accumulate": "oa.accumulate(k, opt): update + apply_updates",
    "update_and_apply": "oa.update_and_apply",
    "oa_multisteps": "oa.MultiSteps: update + apply_updates",
    "optax_multisteps": "optax.MultiSteps: update + apply_updates",
}
# (key, label) of each row, in table order; a row's key is its program and phase.
ROWS: list[tuple[str, str]] = [
    ("floor", "floor: acc += g (3P)"),
    ("plain", "plain step"),
    *[(f"{p}_{phase}", f"{name} {phase}") for p, name in (
        ("accumulate", "oa.accumulate"), ("update_and_apply", "oa.update_and_apply"),
        ("oa_multisteps", "oa.MultiSteps"), ("optax_multisteps", "optax.MultiSteps"))
      for phase in ("mid", "emit")],
]
LABELS = dict(ROWS)
# The rows the project tracks: (name, row, measure, limit or None); issue 29's limits.
TRACKED: list[tuple[str, str, str, float | None]] = [
    ("update_and_apply mid / 3P floor", "update_and_apply_mid", "ratio_floor", 1.15),
    ("update_and_apply emit / plain adam", "update_and_apply_emit", "ratio_plain", 1.30),
    ("protocol (oa.accumulate) mid / 3P floor", "accumulate_mid", "ratio_floor", 4.0),
    ("protocol (oa.accumulate) emit / plain adam", "accumulate_emit", "ratio_plain", 2.5),
    ("optax.MultiSteps mid / 3P floor", "optax_multisteps_mid", "ratio_floor", None),
    ("optax.MultiSteps emit / plain adam", "optax_multisteps_emit", "ratio_plain", None),
]


@dataclasses.dataclass(frozen=True)
class Program:
  """One train step ``step(params, state, grads) -> (params, state)``."""

  key: str
  k: int | None  # the window (None: every call is an optimizer step)
  step: Callable[[Tree, Any, Tree], tuple[Tree, Any]]
  init: Callable[[Tree], Any]


def make_programs(opt_name: str) -> list[Program]:
  """The benchmarked train steps for inner optimizer ``opt_name``, window ``K_WINDOW``."""
  opt, k = OPTIMIZERS[opt_name](1e-3), K_WINDOW
  acc, oms, xms = oa.accumulate(k, opt), oa.MultiSteps(opt, k), optax.MultiSteps(opt, k)
  return [
      Program("plain", None, harness.protocol_step(opt), opt.init),
      Program("accumulate", k, harness.protocol_step(acc), acc.init),
      Program("update_and_apply", k, harness.fast_step(acc), acc.init),
      Program("oa_multisteps", k, harness.protocol_step(oms), oms.init),
      Program("optax_multisteps", k, harness.protocol_step(xms), xms.init),
  ]


def size_label(n: int) -> str:
  return f"{n / 2**20:g}M" if n >= 2**20 else f"{n / 2**10:g}K" if n >= 2**10 else str(n)


def make_tree(n_params: int, leaves: int = LEAVES, fill: float = 0.01) -> dict[str, jax.Array]:
  """``leaves`` f32 leaves of ``n_params // leaves`` elements each."""
  return {f"w{i:02d}": jnp.full((n_params // leaves,), fill * (i + 1), jnp.float32)
          for i in range(leaves)}


@dataclasses.dataclass
class Timer:
  """A compiled program, its donated carry, and its per-phase samples."""

  program: Program
  compiled: Any
  carry: list[Any]
  grads: Tree
  info: dict[str, Any]
  samples: dict[str, list[float]] = dataclasses.field(default_factory=dict)

  def timed(self, calls: int) -> float:
    """Seconds from dispatching ``calls`` calls back to back to their last result."""
    t0 = time.perf_counter()
    for _ in range(calls):
      self.carry = list(self.compiled(self.carry[0], self.carry[1], self.grads))
    jax.block_until_ready(self.carry)
    return time.perf_counter() - t0

  def run_round(self, windows: int) -> None:
    """Each phase's time per call over ``windows`` pairs of windows, calls dispatched back to
    back. A timed run costs one call's latency L (its dispatch, the wait for its result), which
    a loop pays once, so each phase is a difference of runs that cancels L: the first window's
    mid-steps in runs of 1 and k - 2, mid = (t(k - 2) - t(1)) / (k - 3), the second window in
    one run, emit = t_window - t(1) - (k - 2) mid (so a slow, noisy emitting step never enters
    mid); without a window, (t(K_WINDOW) - t(1)) / (K_WINDOW - 1). Needs k >= 4."""
    times: dict[str, list[float]] = {}
    k = self.program.k
    for _ in range(windows):  # (windows start aligned: warm-up)
      if k is None:
        one = self.timed(1)
        times.setdefault("step", []).append((self.timed(K_WINDOW) - one) / (K_WINDOW - 1))
        continue
      t_one, t_more, _ = self.timed(1), self.timed(k - 2), self.timed(1)
      mid = (t_more - t_one) / (k - 3)
      times.setdefault("mid", []).append(mid)
      times.setdefault("emit", []).append(self.timed(k) - t_one - (k - 2) * mid)
    for phase, ts in times.items():
      self.samples.setdefault(phase, []).append(statistics.fmean(ts))


def compile_program(prog: Program, params: Tree, grads: Tree, compiled: Any = None) -> Timer:
  """``prog``'s timer; its program ``compiled``, or compiled here (params and state donated)."""
  state = prog.init(params)
  compiled = compiled or jax.jit(prog.step, donate_argnums=(0, 1)).lower(
      params, state, grads).compile()
  info = {"temps_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
          "conditionals": conditionals(compiled)}
  return Timer(prog, compiled, [jax.tree.map(jnp.copy, params), state], grads, info)


class CopyTimer:
  """A jitted copy of ``n_bytes`` into a donated, kept buffer (a fresh output would be
  page-faulted on every call: that times the allocator); a sample per round, the time per
  copy with one call's latency cancelled: (t(CALLS + 1) - t(1)) / CALLS."""

  CALLS = 4

  def __init__(self, n_bytes: int) -> None:
    self.bytes_moved = 2 * n_bytes  # read + write
    self.samples: list[float] = []
    self.src = jnp.arange(n_bytes // 4, dtype=jnp.float32)
    fn = jax.jit(lambda dst, src: src * 1.0, donate_argnums=(0,), keep_unused=True)
    self.compiled = fn.lower(self.src, self.src).compile()
    self.dst = jax.block_until_ready(jnp.zeros_like(self.src))

  def timed(self, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
      self.dst = self.compiled(self.dst, self.src)
    jax.block_until_ready(self.dst)
    return time.perf_counter() - t0

  def run_round(self, windows: int) -> None:
    one = self.timed(1)
    self.samples.append((self.timed(self.CALLS + 1) - one) / self.CALLS)


def run_rounds(timers: Sequence[Timer], copy: CopyTimer, rounds: int,
               windows: int) -> list[float]:
  """One warm-up window per program, then ``harness.interleaved`` rounds of every
  program (``windows`` windows) and the copy; returns the copy's time per round."""
  for t in timers:
    t.timed(t.program.k or 1)
  copy.timed(1)
  start = len(copy.samples)
  runs = [*timers, copy]  # keyed by position: a Timer is not hashable
  harness.interleaved({i: functools.partial(t.run_round, windows) for i, t in enumerate(runs)},
                      rounds, warmup=0)
  return copy.samples[start:]


def summarize(timers: Sequence[Timer], copies: Mapping[str, Sequence[float]], copy_bytes: int,
              n_params: int, opt_name: str) -> list[dict[str, Any]]:
  """One record per row: time, ratios to the anchors, program facts. ``copies``: per program,
  the copy's time in each of its rounds; programs compare through their rounds' 3P floors."""
  pbytes = 4 * n_params
  by_prog = {t.program.key: t for t in timers}
  special = {"floor": (None, "mid"), "plain": ("plain", "step")}  # the rest: program_phase
  sources = {r: special.get(r, tuple(r.rsplit("_", 1))) for r, _ in ROWS}
  floors = {p: [FLOOR_PASSES * pbytes * c / copy_bytes for c in cs] for p, cs in copies.items()}
  samples = {r: floors["plain"] if p is None else by_prog[p].samples[ph]
             for r, (p, ph) in sources.items()}
  over = {r: [s / f for s, f in zip(samples[r], floors[p or "plain"], strict=True)]
          for r, (p, _) in sources.items()}
  out = []
  for row, (program, phase) in sources.items():
    info = by_prog[program].info if program else None
    anchor = "optax_multisteps_mid" if phase == "mid" else "optax_multisteps_emit"
    out.append({
        "size": n_params, "param_bytes": pbytes, "optimizer": opt_name, "row": row,
        "label": LABELS[row], "program": program, "phase": phase,
        "time_s": harness.median(samples[row]), "ratio_floor": harness.median(over[row]),
        "ratio_plain": harness.paired_ratio(over[row], over["plain"]),
        "ratio_optax_multisteps": harness.paired_ratio(over[row], over[anchor]),
        "rounds": len(samples[row]), "temps_ratio": info and info["temps_bytes"] / pbytes,
        "conditionals": info and info["conditionals"]})
  return out


def tracked(records: Sequence[dict[str, Any]], size: int,
            limits: Mapping[str, float] | None = None) -> list[dict[str, Any]]:
  """The tracked rows from the records at ``size``, adam; ``limits`` replace ``TRACKED``'s."""
  by_row = {r["row"]: r for r in records if (r["size"], r["optimizer"]) == (size, "adam")}
  out = []
  for name, row, measure, limit in TRACKED:
    value, limit = by_row.get(row, {}).get(measure), (limits or {}).get(row, limit)
    out.append({"name": name, "row": row, "measure": measure, "value": value, "limit": limit,
                "size": size, "optimizer": "adam",
                "passed": None if limit is None else value is not None and value <= limit})
  return out


def _x(v: float | None, spec: str = "{:.2f}x") -> str:
  return "-" if v is None else spec.format(v)


def sections(result: dict[str, Any], limits: str = "") -> list[str]:
  """Bandwidth, one table per size and optimizer, tracked rows."""
  meta, bw = result["meta"], result["bandwidth"]
  lines = [f"Copy bandwidth ({bw['copy_bytes'] // 2 // 2**20} MiB into a donated buffer, read +"
           f" write): **{bw['copy_GBps']:.1f} GB/s**; the 3P floor is 3 x parameter bytes over"
           " it, per round.", ""]
  for size in meta["sizes"]:
    for opt in meta["optimizers"]:
      recs = [r for r in result["records"] if (r["size"], r["optimizer"]) == (size, opt)]
      lines += [f"## {size_label(size)} params ({4 * size / 2**20:g} MiB), {opt}", "",
                *harness.table(
                    "row | ms | x 3P floor | x plain | x optax.MultiSteps | temps / params"
                    " | conditionals", "lrrrrrr",
                    [[r["label"], f"{r['time_s'] * 1e3:.3f}", _x(r["ratio_floor"]),
                      _x(r["ratio_plain"]), _x(r["ratio_optax_multisteps"]),
                      _x(r["temps_ratio"]), _x(r["conditionals"], "{}")] for r in recs]), ""]
  heading = f"## Tracked rows ({size_label(result['tracked_size'])} params, adam{limits})"
  return [*lines, heading, "", *harness.table("tracked row | measured | limit |", "lrrc", [
      [b["name"], _x(b["value"], "{:.3f}x"), _x(b["limit"], "{}x"),
       "" if b["passed"] is None else ("PASS" if b["passed"] else "**FAIL**")]
      for b in result["tracked"]]), ""]


def markdown(result: dict[str, Any]) -> str:
  """Setup, then :func:`sections`."""
  meta = result["meta"]
  return "\n".join([
      "# Accumulation train-step benchmark", "",
      f"`python benchmarks/bench_accumulate.py {' '.join(meta['argv'])}` on {meta['machine']}"
      f" ({meta['cpu_count']} CPUs, backend {meta['backend']}, load {meta['loadavg']}),"
      f" jax {meta['jax']}, optax {meta['optax']}, {meta['date']}, {meta['wall_s']} s."
      f" Train step, params and state donated, window k = {meta['k']}; mid and emit rows"
      f" are phases of one program. Medians over {meta['rounds']} interleaved rounds;"
      " ratios: medians of the same-round ratio.", "", *sections(result)])


def plot(result: dict[str, Any]) -> Any:
  """Per optimizer: each row's time over the plain step's, per size."""
  sizes, opts = result["meta"]["sizes"], result["meta"]["optimizers"]
  by_key = {(r["size"], r["optimizer"], r["row"]): r for r in result["records"]}
  rows = [r for r, _ in ROWS if r not in ("floor", "plain")]
  fig, axes = harness.pyplot().subplots(len(opts), 1, figsize=(12, 4.2 * len(opts)),
                                        squeeze=False, dpi=100)
  for ax, opt in zip(axes[:, 0], opts, strict=True):
    x = np.arange(len(rows))
    width = 0.8 / len(sizes)
    for j, size in enumerate(sizes):
      vals = [by_key.get((size, opt, r), {}).get("ratio_plain", np.nan) for r in rows]
      ax.bar(x + (j - (len(sizes) - 1) / 2) * width, vals, width, label=size_label(size))
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x, [LABELS[r] for r in rows], fontsize=8, rotation=30, ha="right")
    ax.set_ylabel(f"time per call, x plain {opt} step")
    ax.set_title(f"{opt}: train step, window k={result['meta']['k']}")
    ax.legend(fontsize=8)
  return fig


def windows_for(size: int) -> int:
  """Whole windows per round: >= ~8M params touched per program per round."""
  return max(1, (8 * 2**20) // (size * K_WINDOW))


def result(sizes: Sequence[int], opts: Sequence[str], rounds: int, copy: CopyTimer,
           records: list[dict[str, Any]], tracked_size: int,
           limits: Mapping[str, float] | None = None) -> dict[str, Any]:
  """The records, the copy bandwidth and the tracked rows (``limits``: :func:`tracked`'s) in a
  result with its meta (the caller adds argv and wall_s)."""
  copy_s = harness.median(copy.samples)
  return {"meta": {"sizes": list(sizes), "optimizers": list(opts), "rounds": rounds,
                   "leaves": LEAVES, "k": K_WINDOW, **harness.machine()},
          "bandwidth": {"copy_bytes": copy.bytes_moved, "copy_time_s": copy_s,
                        "copy_GBps": copy.bytes_moved / copy_s / 1e9},
          "records": records, "tracked_size": tracked_size,
          "tracked": tracked(records, tracked_size, limits) if "adam" in opts else []}


def main(argv: list[str] | None = None) -> None:
  """Runs the benchmark and writes the reports."""
  ap = harness.parser(__doc__, quick="256K params, 3 rounds of 2 windows: a smoke run")
  ap.add_argument("--rounds", type=int, default=None,
                  help="interleaved rounds per size and optimizer (default 15; --quick 3)")
  args = ap.parse_args(argv)
  sizes = [2**18] if args.quick else list(SIZES)
  rounds = args.rounds or (3 if args.quick else 15)
  t_start, copy, records = time.perf_counter(), CopyTimer(64 * 2**20), []
  for size in sizes:
    for opt in OPTIMIZERS:
      params, grads = make_tree(size), make_tree(size, fill=1e-3)
      timers = [compile_program(p, params, grads) for p in make_programs(opt)]
      copy_samples = run_rounds(timers, copy, rounds, 2 if args.quick else windows_for(size))
      records += summarize(timers, {t.program.key: copy_samples for t in timers},
                           copy.bytes_moved, size, opt)
      print(f"{size_label(size):>5s} {opt:4s}: timed", flush=True)
  out = result(sizes, list(OPTIMIZERS), rounds, copy, records, sizes[len(sizes) // 2])  # 4M
  out["meta"].update(argv=list(argv if argv is not None else sys.argv[1:]),
                     wall_s=round(time.perf_counter() - t_start, 1))
  harness.write(args.out, "accumulate", out, markdown(out), plot)


if __name__ == "__main__":
  main()
