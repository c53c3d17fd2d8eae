"""Benchmark: the cost of a gradient-accumulation micro-step, against its floor.

For model sizes of 1M, 4M and 16M f32 parameters (8 equal leaves) and inner
optimizers sgd and adam, it measures in one process, interleaved (every
variant once per round, in a rotating order), the median over rounds of:

* ``floor``: ``acc += g`` and a tree of zero updates, no counter, no cond --
  the least a mid-step that follows the optax protocol can do;
* ``plain``: one step of the inner optimizer;
* ``accumulate mid`` / ``accumulate emit (k=1)``: ``oa.accumulate(k, inner)``;
* ``update_and_apply mid`` / ``emit (k=1)``: ``oa.update_and_apply`` (train
  step level only: it returns params);
* ``oa.MultiSteps mid`` and ``optax.MultiSteps mid``;
* ``chain+apply_every``: ``optax.chain(inner, optax.apply_every(k))``, one step;
* ``python loop mid``: the tutorial loop, ``jax.tree.map(jnp.add, acc, g)``
  outside jit (a jitted optimizer step runs every k-th call; only the mid-step
  is timed here: its emitting step is ``plain``).

Two levels, each with its own donation convention (see NOTES.md for why):

* update level: ``f(state, g, p) -> (new_state, updates)`` donating the state
  (state first in the outputs, so donated buffers go back to the state);
* train-step level: ``step(params, state, g) -> (params + updates, state)``
  donating params and state (``update_and_apply`` returns the new params
  itself; the ``floor`` there leaves the params untouched).

Mid-steps are timed with ``k = 2**30`` (the window never closes), emit steps
with ``k = 1``. Reported per row: median time, ratio to the floor and to the
plain step of the same level, and compiled temporaries
(``memory_analysis().temp_size_in_bytes``) over parameter bytes, per level.
The same run measures the machine's copy bandwidth (a jitted copy of a 64 MiB
array, bytes read + written over time) and the bytes a mid-step must move
(read g, read acc, write acc, write zero updates: 4x parameter bytes).

Run::

  python benchmarks/bench_accumulate.py                 # < 6 min on 2 loaded cores
  python benchmarks/bench_accumulate.py --quick         # < 1 min (smoke test)
  python benchmarks/bench_accumulate.py --sizes 4M --rounds 41

Writes ``accumulate.{json,md,png}`` to ``benchmarks/results`` (``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

import optax_accum as oa

Tree = Any
K_MID = 1 << 30
LEAVES = 8

# (key, label) of each row, in table order.
ROWS: list[tuple[str, str]] = [
    ("floor", "floor (acc += g)"),
    ("plain", "plain step"),
    ("accumulate_mid", "oa.accumulate mid"),
    ("accumulate_emit", "oa.accumulate emit (k=1)"),
    ("update_and_apply_mid", "oa.update_and_apply mid"),
    ("update_and_apply_emit", "oa.update_and_apply emit (k=1)"),
    ("oa_multisteps_mid", "oa.MultiSteps mid"),
    ("optax_multisteps_mid", "optax.MultiSteps mid"),
    ("apply_every", "chain(opt, apply_every) step"),
    ("python_loop_mid", "python loop mid (eager tree add)"),
]
OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sgd": lambda: optax.sgd(1e-3),
    "adam": lambda: optax.adam(1e-3),
}


@dataclasses.dataclass
class Timer:
  """One timed program: ``call()`` runs it once and blocks on its result."""

  row: str
  level: str  # "update" or "train"
  call: Callable[[], None]
  temps: int | None  # compiled temporaries in bytes (None: not one program)
  samples: list[float] = dataclasses.field(default_factory=list)


def parse_size(text: str) -> int:
  """``"4M"`` -> 4 * 2**20, ``"512K"`` -> 512 * 2**10, ``"1000"`` -> 1000."""
  text = text.strip().upper()
  scale = {"K": 2**10, "M": 2**20}.get(text[-1:], 1)
  return int(float(text.rstrip("KM")) * scale)


def make_tree(n_params: int, leaves: int = LEAVES, fill: float = 0.01) -> dict[str, jax.Array]:
  """``leaves`` f32 leaves of ``n_params // leaves`` elements each."""
  return {f"w{i:02d}": jnp.full((n_params // leaves,), fill * (i + 1), jnp.float32)
          for i in range(leaves)}


def _zeros(tree: Tree) -> Tree:
  return jax.tree.map(jnp.zeros_like, tree)


def _update_level(tx: optax.GradientTransformation) -> Callable:
  """``f(state, g, p) -> (state, updates)``: state first, for donation."""
  return lambda state, g, p: tx.update(g, state, p)[::-1]


def _train_level(tx: optax.GradientTransformation) -> Callable:
  """``step(p, state, g) -> (p + updates, state)``."""
  def step(p, state, g):
    updates, state = tx.update(g, state, p)
    return optax.apply_updates(p, updates), state
  return step


def _floor_update(acc: Tree, g: Tree, p: Tree) -> tuple[Tree, Tree]:
  del p
  return jax.tree.map(jnp.add, acc, g), _zeros(g)


def _floor_train(p: Tree, acc: Tree, g: Tree) -> tuple[Tree, Tree]:
  return p, jax.tree.map(jnp.add, acc, g)


def _compiled_timer(row: str, level: str, fn: Callable, state: Any, params: Tree,
                    grads: Tree) -> Timer:
  """Compiles ``fn`` with the level's donation and returns a timer for it."""
  if level == "update":
    comp = jax.jit(fn, donate_argnums=(0,)).lower(state, grads, params).compile()
    carry = [state]

    def call() -> None:
      out = comp(carry[0], grads, params)
      jax.block_until_ready(out)  # all outputs: sgd's state is empty
      carry[0] = out[0]
  else:
    comp = jax.jit(fn, donate_argnums=(0, 1)).lower(params, state, grads).compile()
    carry = [jax.tree.map(jnp.copy, params), state]

    def call() -> None:
      carry[0], carry[1] = jax.block_until_ready(comp(carry[0], carry[1], grads))
  return Timer(row, level, call, comp.memory_analysis().temp_size_in_bytes)


def build_timers(n_params: int, opt_name: str) -> list[Timer]:
  """Every (row, level) program of the table for one size and optimizer."""
  params = make_tree(n_params)
  grads = make_tree(n_params, fill=1e-3)
  make_opt = OPTIMIZERS[opt_name]
  timers: list[Timer] = []

  def add(row: str, level: str, fn: Callable, init: Callable[[Tree], Any]) -> None:
    timers.append(_compiled_timer(row, level, fn, init(params), params, grads))

  add("floor", "update", _floor_update, _zeros)
  add("floor", "train", _floor_train, _zeros)
  plain = make_opt()
  add("plain", "update", _update_level(plain), plain.init)
  add("plain", "train", _train_level(plain), plain.init)
  for row, k in (("accumulate_mid", K_MID), ("accumulate_emit", 1)):
    tx = oa.accumulate(k, make_opt())
    add(row, "update", _update_level(tx), tx.init)
    add(row, "train", _train_level(tx), tx.init)
  for row, k in (("update_and_apply_mid", K_MID), ("update_and_apply_emit", 1)):
    tx = oa.accumulate(k, make_opt())
    add(row, "train", lambda p, s, g, tx=tx: oa.update_and_apply(tx, g, s, p), tx.init)
  for row, tx in (
      ("oa_multisteps_mid", oa.MultiSteps(make_opt(), every_k_schedule=K_MID)),
      ("optax_multisteps_mid", optax.MultiSteps(make_opt(), every_k_schedule=K_MID)),
      ("apply_every", optax.chain(make_opt(), optax.apply_every(K_MID))),
  ):
    add(row, "update", _update_level(tx), tx.init)
    add(row, "train", _train_level(tx), tx.init)

  acc = [_zeros(params)]

  def python_loop_mid() -> None:  # what tutorials do between jitted optimizer steps
    acc[0] = jax.tree.map(jnp.add, acc[0], grads)
    jax.block_until_ready(acc[0])

  timers.append(Timer("python_loop_mid", "update", python_loop_mid, None))
  return timers


def copy_timer(n_bytes: int = 64 * 2**20) -> tuple[Timer, int]:
  """A jitted copy of an ``n_bytes`` f32 array; returns it and bytes moved.

  The destination is donated (and kept: ``keep_unused``, else jit prunes the
  unused argument and its donation), so the copy writes into a buffer that
  already exists, as the accumulation steps do. A fresh 64 MiB output would be
  ``mmap``-ed and page-faulted on every call: that measures the allocator
  (~2.5 GB/s here), not the memory system.
  """
  src = jnp.arange(n_bytes // 4, dtype=jnp.float32)
  fn = jax.jit(lambda dst, src: src * 1.0, donate_argnums=(0,), keep_unused=True)
  comp = fn.lower(src, src).compile()
  dst = [jnp.zeros_like(src)]

  def call() -> None:
    dst[0] = comp(dst[0], src)
    jax.block_until_ready(dst[0])

  return Timer("copy", "copy", call, None), 2 * n_bytes


def run_rounds(timers: list[Timer], rounds: int, reps: int, seed: int = 0) -> None:
  """Interleaved rounds: each timer once per round, in a fresh random order.

  A fixed cyclic order (even rotated) always puts the same program after the
  64 MiB copy, which evicts the caches: a systematic bias. Shuffling spreads
  it over all variants.
  """
  rng = random.Random(seed)
  for t in timers:  # warm-up (also allocates the donated carries)
    t.call()
  for _ in range(rounds):
    order = list(timers)
    rng.shuffle(order)
    for t in order:
      t0 = time.perf_counter()
      for _ in range(reps):
        t.call()
      t.samples.append((time.perf_counter() - t0) / reps)


def _median(samples: list[float]) -> float:
  return statistics.median(samples) if samples else float("nan")


def paired_ratio(num: list[float], den: list[float]) -> float:
  """Median over rounds of ``num[r] / den[r]``.

  Both were sampled in the same round, seconds apart, so a burst of load from
  other processes hits both: the per-round ratio is far steadier than the ratio
  of the two medians on a shared machine.
  """
  return _median([a / b for a, b in zip(num, den, strict=True)])


def summarize(timers: list[Timer], n_params: int, opt_name: str) -> list[dict[str, Any]]:
  """One record per (row, level): median time, paired ratios, spread, temps."""
  pbytes = 4 * n_params
  by_key = {(t.row, t.level): t for t in timers}
  out = []
  for t in timers:
    time_s = _median(t.samples)
    q = statistics.quantiles(t.samples, n=4) if len(t.samples) > 1 else [time_s] * 3
    rec: dict[str, Any] = {
        "size": n_params, "param_bytes": pbytes, "optimizer": opt_name,
        "row": t.row, "level": t.level, "time_s": time_s,
        "time_min_s": min(t.samples), "time_q1_s": q[0], "time_q3_s": q[2],
        "ratio_floor": paired_ratio(t.samples, by_key[("floor", t.level)].samples),
        "ratio_plain": paired_ratio(t.samples, by_key[("plain", t.level)].samples),
        "temps_bytes": t.temps,
        "temps_ratio": None if t.temps is None else t.temps / pbytes,
        "rounds": len(t.samples),
    }
    if t.row in ("floor", "accumulate_mid") and t.level == "update":
      rec["bytes_moved"] = 4 * pbytes
      rec["achieved_GBps"] = 4 * pbytes / time_s / 1e9
    out.append(rec)
  return out


def evaluate_bars(records: list[dict[str, Any]], size: int) -> list[dict[str, Any]]:
  """The project's bars at ``size`` params with adam."""
  def rec(row: str, level: str) -> dict[str, Any] | None:
    for r in records:
      if (r["size"], r["optimizer"], r["row"], r["level"]) == (size, "adam", row, level):
        return r
    return None

  bars = []

  def bar(name: str, value: float | None, limit: float, aim: float | None = None) -> None:
    # Temporaries also hold a few scalars (counters, the cond's predicate):
    # a ratio within 1e-3 of the limit counts as at the limit.
    ok = value is not None and value <= limit + (1e-3 if "temps" in name else 0.0)
    bars.append({"bar": name, "value": value, "limit": limit, "aim": aim, "met": ok})

  mid, floor = rec("accumulate_mid", "update"), rec("floor", "update")
  ms = rec("optax_multisteps_mid", "update")
  if mid and floor and ms:
    bar("accumulate mid-step time / floor", mid["ratio_floor"], 1.5, 1.2)
    bar("accumulate mid-step time / optax.MultiSteps mid",
        mid["ratio_floor"] / ms["ratio_floor"], 0.3)
  uaa = rec("update_and_apply_mid", "train")
  if uaa:
    bar("update_and_apply mid time / train-level floor", uaa["ratio_floor"], 1.5, 1.2)
  emit = rec("accumulate_emit", "update")
  if emit:
    bar("accumulate emit (k=1) time / plain adam", emit["ratio_plain"], 1.3)
  uemit = rec("update_and_apply_emit", "train")
  if uemit:
    bar("update_and_apply emit (k=1) time / plain adam train step", uemit["ratio_plain"], 1.3)
  for row, level in (("accumulate_mid", "update"), ("accumulate_emit", "update"),
                     ("update_and_apply_mid", "train"), ("update_and_apply_emit", "train"),
                     ("accumulate_mid", "train"), ("accumulate_emit", "train")):
    r = rec(row, level)
    if r:
      bar(f"temps / param bytes: {row} ({level} level)", r["temps_ratio"], 1.0, 0.0)
  return bars


# ----------------------------------------------------------------- reports
def _fmt_ratio(x: float | None, digits: int = 2) -> str:
  return "-" if x is None else f"{x:.{digits}f}x"


def _size_label(n: int) -> str:
  return f"{n / 2**20:g}M" if n >= 2**20 else f"{n / 2**10:g}K"


def markdown(result: dict[str, Any]) -> str:
  """The results as markdown: bandwidth line, one table per size/optimizer, bars."""
  bw = result["bandwidth"]
  command = " ".join(["python benchmarks/bench_accumulate.py", *result["meta"]["argv"]])
  lines = [
      "# Accumulation micro-step benchmark",
      "",
      f"Generated by `{command}`"
      f" on {result['meta']['machine']} ({result['meta']['cpus']} CPUs, load average"
      f" {result['meta']['loadavg']}), jax {result['meta']['jax']}, optax"
      f" {result['meta']['optax']}. Medians over {result['meta']['rounds']} interleaved rounds;"
      " ratios are medians over rounds of (time / time of the floor or plain step of the"
      " same level in the same round).",
      "",
      f"* Copy bandwidth (jitted copy of 64 MiB, read + write): **{bw['copy_GBps']:.1f} GB/s**.",
      "* Bytes a mid-step must move: read g + read acc + write acc + write zero updates ="
      " **4x parameter bytes**"
      + "".join(f"; {_size_label(s)}: {4 * 4 * s / 2**20:.0f} MiB" for s in result["meta"]["sizes"])
      + ".",
      "",
  ]
  for b in result["achieved"]:
    lines.append(
        f"* {_size_label(b['size'])} {b['optimizer']}: floor moves them at"
        f" {b['floor_GBps']:.1f} GB/s, `oa.accumulate` mid-step at {b['accumulate_GBps']:.1f}"
        f" GB/s ({b['accumulate_GBps'] / bw['copy_GBps']:.2f}x the copy bandwidth).")
  lines.append("")
  by_key = {(r["size"], r["optimizer"], r["row"], r["level"]): r for r in result["records"]}
  for size in result["meta"]["sizes"]:
    for opt in result["meta"]["optimizers"]:
      lines += [
          f"## {_size_label(size)} params ({4 * size / 2**20:.0f} MiB), {opt}",
          "",
          "| variant | update: ms | x floor | x plain | temps / params |"
          " train step: ms | x floor | x plain | temps / params |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
      ]
      for row, label in ROWS:
        cells = [label]
        for level in ("update", "train"):
          r = by_key.get((size, opt, row, level))
          if r is None:
            cells += ["-"] * 4
          else:
            cells += [f"{r['time_s'] * 1e3:.2f}", _fmt_ratio(r["ratio_floor"]),
                      _fmt_ratio(r["ratio_plain"]), _fmt_ratio(r["temps_ratio"])]
        lines.append("| " + " | ".join(cells) + " |")
      lines.append("")
  lines += [f"## Bars ({_size_label(result['bar_size'])} params, adam)", "",
            "| bar | measured | limit | aim | met |", "|---|---:|---:|---:|:---:|"]
  for b in result["bars"]:
    lines.append(f"| {b['bar']} | {_fmt_ratio(b['value'], 3)} | {b['limit']}x |"
                 f" {'' if b['aim'] is None else str(b['aim']) + 'x'} |"
                 f" {'yes' if b['met'] else '**no**'} |")
  lines.append("")
  return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
  """Bars of mid-step time / floor per variant and size; temps per variant."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  sizes = result["meta"]["sizes"]
  opts = result["meta"]["optimizers"]
  by_key = {(r["size"], r["optimizer"], r["row"], r["level"]): r for r in result["records"]}
  mid_rows = [("accumulate_mid", "update", "oa.accumulate"),
              ("oa_multisteps_mid", "update", "oa.MultiSteps"),
              ("optax_multisteps_mid", "update", "optax.MultiSteps"),
              ("apply_every", "update", "apply_every"),
              ("python_loop_mid", "update", "python loop"),
              ("update_and_apply_mid", "train", "update_and_apply\n(train level)")]
  temp_rows = [(row, label) for row, label in ROWS if row != "python_loop_mid"]
  fig, axes = plt.subplots(len(opts), 2, figsize=(15, 4.2 * len(opts)), squeeze=False)
  for i, opt in enumerate(opts):
    ax = axes[i][0]
    x = np.arange(len(mid_rows))
    width = 0.8 / len(sizes)
    for j, size in enumerate(sizes):
      vals = [by_key.get((size, opt, row, level), {}).get("ratio_floor", np.nan)
              for row, level, _ in mid_rows]
      ax.bar(x + (j - (len(sizes) - 1) / 2) * width, vals, width, label=_size_label(size))
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.5, color="r", lw=0.8, ls="--", label="bar 1.5x")
    ax.set_xticks(x, [label for *_, label in mid_rows], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("mid-step time / floor")
    ax.set_title(f"{opt}: mid-step time relative to acc += g (log scale)")
    ax.legend(fontsize=8)
    ax = axes[i][1]
    x = np.arange(len(temp_rows))
    size = sizes[-1]
    for j, level in enumerate(("update", "train")):
      vals = []
      for row, _ in temp_rows:
        r = by_key.get((size, opt, row, level))
        vals.append(np.nan if r is None or r["temps_ratio"] is None else r["temps_ratio"])
      ax.bar(x + (j - 0.5) * 0.4, vals, 0.4, label=f"{level} level")
    ax.axhline(1.0, color="r", lw=0.8, ls="--", label="bar 1.0x")
    ax.set_xticks(x, [label.replace(" (", "\n(") for _, label in temp_rows], fontsize=7,
                  rotation=30, ha="right")
    ax.set_ylabel("compiled temporaries / param bytes")
    ax.set_title(f"{opt}: temporaries ({_size_label(size)} params)")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark and writes the reports; returns the result dict."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--sizes", default="1M,4M,16M", help="comma-separated, e.g. 1M,4M,16M")
  ap.add_argument("--optimizers", default="sgd,adam")
  ap.add_argument("--rounds", type=int, default=None,
                  help="interleaved rounds per size/optimizer (default 15; --quick 3)")
  ap.add_argument("--quick", action="store_true",
                  help="256K params, 3 rounds: a smoke run of every variant (< 1 min)")
  ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
  args = ap.parse_args(argv)
  if args.quick:
    sizes = [parse_size("256K")]
    rounds = args.rounds or 3
  else:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    rounds = args.rounds or 15
  opts = args.optimizers.split(",")
  for opt in opts:
    if opt not in OPTIMIZERS:
      ap.error(f"unknown optimizer {opt!r}; choose from {sorted(OPTIMIZERS)}")
  bar_size = parse_size("4M") if parse_size("4M") in sizes else sizes[len(sizes) // 2]

  t_start = time.perf_counter()
  copy, copy_bytes = copy_timer()
  records: list[dict[str, Any]] = []
  achieved = []
  for size in sizes:
    # Samples of several ms (>= 32 MiB of parameters touched) so timer and
    # dispatch noise stay small.
    reps = max(1, (8 * 2**20) // size)
    for opt in opts:
      t0 = time.perf_counter()
      timers = build_timers(size, opt)
      t1 = time.perf_counter()
      run_rounds([*timers, copy], rounds, reps)
      recs = summarize(timers, size, opt)
      records += recs
      get = {(r["row"], r["level"]): r for r in recs}
      achieved.append({"size": size, "optimizer": opt,
                       "floor_GBps": get[("floor", "update")]["achieved_GBps"],
                       "accumulate_GBps": get[("accumulate_mid", "update")]["achieved_GBps"]})
      print(f"{_size_label(size):>5s} {opt:4s}: compile {t1 - t0:5.1f} s, time"
            f" {time.perf_counter() - t1:5.1f} s; accumulate mid"
            f" {get[('accumulate_mid', 'update')]['ratio_floor']:.2f}x floor, optax.MultiSteps"
            f" {get[('optax_multisteps_mid', 'update')]['ratio_floor']:.2f}x", flush=True)
      del timers
  copy_s = _median(copy.samples)
  result: dict[str, Any] = {
      "meta": {
          "argv": list(argv if argv is not None else os.sys.argv[1:]),
          "sizes": sizes, "optimizers": opts, "rounds": rounds, "leaves": LEAVES,
          "k_mid": K_MID, "jax": jax.__version__, "optax": optax.__version__,
          "machine": f"{platform.machine()} {platform.processor() or platform.system()}",
          "cpus": os.cpu_count(), "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg()),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "wall_s": None,
      },
      "bandwidth": {"copy_bytes": copy_bytes, "copy_time_s": copy_s,
                    "copy_GBps": copy_bytes / copy_s / 1e9,
                    "mid_step_bytes_per_param_byte": 4},
      "achieved": achieved,
      "records": records,
      "bar_size": bar_size,
      "bars": evaluate_bars(records, bar_size),
  }
  result["meta"]["wall_s"] = round(time.perf_counter() - t_start, 1)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "accumulate.json").write_text(json.dumps(result, indent=1))
  (args.out / "accumulate.md").write_text(markdown(result))
  plot(result, args.out / "accumulate.png")
  print(f"copy bandwidth {result['bandwidth']['copy_GBps']:.1f} GB/s; wrote {args.out}/"
        f"accumulate.{{json,md,png}} in {result['meta']['wall_s']} s")
  for b in result["bars"]:
    print(f"  {'met ' if b['met'] else 'MISS'} {b['bar']}: {_fmt_ratio(b['value'], 3)}"
          f" (limit {b['limit']}x)")
  return result


if __name__ == "__main__":
  main()
