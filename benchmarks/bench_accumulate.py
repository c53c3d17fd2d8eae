"""Benchmark: the train-step cost of gradient accumulation, against physical floors.

What is measured (all in one process; nothing here is a hard-coded result):

* Every variant is one jitted train step ``step(params, state, grads) ->
  (params, state)`` with params and state donated, compiled once for a window
  of ``k = 4`` micro-batches. Its calls are timed one by one (blocking on each
  result) and split by phase: the ``k - 1`` mid-steps of a window and its
  emitting step run the *same* program with a runtime predicate.
* Variants: the plain optimizer step; ``oa.accumulate(k, opt)`` through the
  optax protocol (``tx.update`` + ``optax.apply_updates``);
  ``optax.chain(oa.accumulate(k, None), opt)`` (the chain form: the optimizer steps
  on the zero updates of every mid-step, so it is **not** large-batch
  training); ``oa.update_and_apply`` (the fast path); ``oa.MultiSteps`` and
  ``optax.MultiSteps`` through the protocol.
* Floors are not programs: a floor is the bytes a step must move over the copy
  bandwidth measured in the same round (a jitted copy into a donated buffer,
  read + write bytes over time). With P = parameter bytes:

  - train-step mid-step, 3P: read g, read acc, write acc;
  - optax-protocol mid-step, 6P: those 3P, and ``apply_updates`` reads
    params and the updates and writes params (3P). (7P if ``update`` writes
    a tree of zero updates first; ours reads them, masked, from the buffer.)
  - plain step: the optimizer's own bytes, adam 7P (read g, mu, nu, params;
    write mu, nu, params), sgd 3P (read g, params; write params). An emitting
    step does at least this.

  On a CPU the floors are DRAM floors: a working set that fits the last-level
  cache (small sizes) can beat them.
* References are programs, not floors: ``opt`` on the window's sum
  ``(acc + g) / k``, applied, with no accumulation code (an emitting step of
  ``update_and_apply`` does this and nothing else), and the same inside a
  ``lax.cond`` whose updates go through ``acc`` to an ``apply_updates``
  outside (the optax protocol's emitting step). They show what the backend's
  compiler makes of the work an emitting step cannot avoid: XLA:CPU runs
  Adam as three loops per leaf, so the window's sum is read twice (12P
  against plain Adam's 10P; 14P through the protocol).
* Per row: median time over rounds, ratio to its own floor, to the 3P floor,
  to the plain step and to ``optax.MultiSteps`` (mid rows to its mid-step,
  emitting rows to its emitting step). Each ratio is the median over rounds of
  the per-round ratio (the reference ran seconds apart in the same round).
* Per program: compiled temporaries over parameter bytes
  (``compile().memory_analysis()``), bytes aliased, HLO ``conditional`` count,
  number of argument leaves, and per row the compiled passes: the bytes its
  step's kernels read and write over the parameter bytes
  (``optax_accum.debug.step_bytes``; what this backend's program moves, next
  to the floor, which is what any program must move).
* Per-call host overhead: the same programs on a tiny model (8 leaves of 128
  f32), where dispatch dominates, and the enqueue time (until the call
  returns, before blocking) at the smallest size.
* A PASS/FAIL table of the project's bars at 4M params, adam (or the middle
  size if 4M is not run).

Timing protocol (``harness.interleaved``, which every benchmark script uses):
every round runs every program (a few whole windows) and the copy once, in a
fresh seeded random order (a fixed or rotating order would put the same
program after the cache-evicting copy every round); medians over rounds. On a
shared machine the per-round ratios (``harness.paired_ratio``) are far steadier
than ratios of medians.

Run::

  python benchmarks/bench_accumulate.py                  # 1M,4M,16M; sgd, adam
  python benchmarks/bench_accumulate.py --quick          # 256K, 3 rounds (smoke)
  python benchmarks/bench_accumulate.py --sizes 4M --optimizers adam --rounds 21

Writes ``accumulate.{json,md,png}`` to ``benchmarks/results`` (``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import harness
import jax
import jax.numpy as jnp
import optax

import optax_accum as oa
from optax_accum.debug import conditionals, step_bytes

Tree = Any
LEAVES = 8
K_WINDOW = 4
TINY_PARAMS = LEAVES * 128
MID_PASSES = 3  # train-step mid-step: read g, read acc, write acc
PROTOCOL_PASSES = 6  # + apply_updates: read p, read the (masked) updates, write p
PLAIN_PASSES = {"sgd": 3, "adam": 7}  # the optimizer's own parameter-sized passes
OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sgd": lambda: optax.sgd(1e-3),
    "adam": lambda: optax.adam(1e-3),
}

# (key, label) of each program.
PROGRAMS: list[tuple[str, str]] = [
    ("plain", "plain step"),
    ("accumulate", "oa.accumulate(k, opt): update + apply_updates"),
    ("chain", "optax.chain(oa.accumulate(k, None), opt): update + apply_updates"),
    ("update_and_apply", "oa.update_and_apply"),
    ("oa_multisteps", "oa.MultiSteps: update + apply_updates"),
    ("optax_multisteps", "optax.MultiSteps: update + apply_updates"),
    ("ref_window_sum", "reference: opt on a window's sum, applied (no accumulation)"),
    ("ref_protocol", "reference: the same in a lax.cond, updates through the buffer"),
]
REFERENCES = ("ref_window_sum", "ref_protocol")

# (key, label) of each row, in table order.
ROWS: list[tuple[str, str]] = [
    ("floor_mid", "floor: train-step mid (3P)"),
    ("floor_protocol", "floor: optax-protocol mid (6P)"),
    ("floor_plain", "floor: plain step's bytes"),
    ("plain", "plain step"),
    ("accumulate_mid", "oa.accumulate mid"),
    ("accumulate_emit", "oa.accumulate emit"),
    ("chain_mid", "chain(oa.accumulate(k, None), opt) mid (not large-batch)"),
    ("chain_emit", "chain(oa.accumulate(k, None), opt) emit"),
    ("update_and_apply_mid", "oa.update_and_apply mid"),
    ("update_and_apply_emit", "oa.update_and_apply emit"),
    ("oa_multisteps_mid", "oa.MultiSteps mid"),
    ("oa_multisteps_emit", "oa.MultiSteps emit"),
    ("optax_multisteps_mid", "optax.MultiSteps mid"),
    ("optax_multisteps_emit", "optax.MultiSteps emit"),
    ("ref_window_sum", "reference: opt on a window's sum (no accumulation)"),
    ("ref_protocol", "reference: same, in a lax.cond, updates via the buffer"),
]
LABELS = dict(ROWS)


@dataclasses.dataclass(frozen=True)
class RowSpec:
  """Where a row's times come from and what it is compared with."""

  program: str | None  # None: a floor (computed, not run)
  phase: str  # "mid", "emit" or "step" (every call)
  floor: str  # "mid", "protocol" or "plain": the row's own floor
  reference: str | None = None  # the reference row of an emitting row, if any


ROW_SPECS: dict[str, RowSpec] = {
    "floor_mid": RowSpec(None, "mid", "mid"),
    "floor_protocol": RowSpec(None, "mid", "protocol"),
    "floor_plain": RowSpec(None, "emit", "plain"),
    "plain": RowSpec("plain", "step", "plain"),
    "accumulate_mid": RowSpec("accumulate", "mid", "protocol"),
    "accumulate_emit": RowSpec("accumulate", "emit", "plain", "ref_protocol"),
    "chain_mid": RowSpec("chain", "mid", "protocol"),
    "chain_emit": RowSpec("chain", "emit", "plain"),
    "update_and_apply_mid": RowSpec("update_and_apply", "mid", "mid"),
    "update_and_apply_emit": RowSpec("update_and_apply", "emit", "plain", "ref_window_sum"),
    "oa_multisteps_mid": RowSpec("oa_multisteps", "mid", "protocol"),
    "oa_multisteps_emit": RowSpec("oa_multisteps", "emit", "plain", "ref_protocol"),
    "optax_multisteps_mid": RowSpec("optax_multisteps", "mid", "protocol"),
    "optax_multisteps_emit": RowSpec("optax_multisteps", "emit", "plain"),
    "ref_window_sum": RowSpec("ref_window_sum", "step", "plain"),
    "ref_protocol": RowSpec("ref_protocol", "step", "plain"),
}


def floor_passes(floor: str, opt_name: str) -> int:
  """Parameter-sized passes (units of P) a step of this kind must make."""
  return {"mid": MID_PASSES, "protocol": PROTOCOL_PASSES}.get(floor) or PLAIN_PASSES[opt_name]


# ----------------------------------------------------------------- programs
@dataclasses.dataclass(frozen=True)
class Program:
  """One train step ``step(params, state, grads) -> (params, state)``."""

  key: str
  k: int | None  # the window (None: every call is an optimizer step)
  step: Callable[[Tree, Any, Tree], tuple[Tree, Any]]
  init: Callable[[Tree], Any]


def _standard_step(tx: Any) -> Callable[[Tree, Any, Tree], tuple[Tree, Any]]:
  """``tx.update`` followed by ``optax.apply_updates``: the optax protocol."""
  def step(params: Tree, state: Any, grads: Tree) -> tuple[Tree, Any]:
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step


def _window_updates(opt: optax.GradientTransformation, k: int, acc: Tree, grads: Tree,
                    opt_state: Any, params: Tree) -> tuple[Tree, Any]:
  """``opt.update`` on the window's mean ``(acc + g) / k``."""
  return opt.update(jax.tree.map(lambda a, g: (a + g) / k, acc, grads), opt_state, params)


def _window_sum_reference(opt: optax.GradientTransformation, k: int) -> Program:
  """``opt`` on ``(acc + g) / k``, applied: an emitting step's work, no accumulation.

  State ``(opt_state, acc)``; ``acc`` is read, never written. Every call is an
  optimizer step, with no counter, conditional or buffer update: what an
  emitting step of ``update_and_apply`` computes, in the fewest passes the
  backend's compiler finds for it.
  """
  def step(params: Tree, state: Any, grads: Tree) -> tuple[Tree, Any]:
    opt_state, acc = state
    updates, opt_state = _window_updates(opt, k, acc, grads, opt_state, params)
    return optax.apply_updates(params, updates), (opt_state, acc)
  return Program("ref_window_sum", None, step,
                 lambda p: (opt.init(p), jax.tree.map(jnp.zeros_like, p)))


def _protocol_reference(opt: optax.GradientTransformation, k: int) -> Program:
  """The window-sum step inside a ``lax.cond``, its updates written into ``acc``.

  ``params + where(on, acc, 0)`` outside the conditional, as the optax protocol
  must do when ``update`` steps inside a conditional and ``apply_updates``
  runs after it: an emitting step of ``oa.accumulate`` + ``apply_updates``
  with nothing else (``on`` is a runtime flag, always true, so XLA keeps the
  conditional).
  """
  def step(params: Tree, state: Any, grads: Tree) -> tuple[Tree, Any]:
    opt_state, acc, on = state

    def emit(operands: tuple[Any, Tree]) -> tuple[Any, Tree]:
      opt_state, acc = operands
      updates, opt_state = _window_updates(opt, k, acc, grads, opt_state, params)
      return opt_state, updates

    opt_state, acc = jax.lax.cond(on, emit, lambda operands: operands, (opt_state, acc))
    params = jax.tree.map(lambda p, u: p + jnp.where(on, u, jnp.zeros((), u.dtype)),
                          params, acc)
    return params, (opt_state, acc, on)
  return Program("ref_protocol", None, step,
                 lambda p: (opt.init(p), jax.tree.map(jnp.zeros_like, p), jnp.bool_(True)))


def make_programs(opt_name: str, k: int = K_WINDOW,
                  keys: Sequence[str] | None = None,
                  references: bool = False) -> list[Program]:
  """The benchmarked train steps for inner optimizer ``opt_name``, window ``k``.

  ``references=True`` adds the two reference computations of an emitting step
  (:func:`_window_sum_reference`, :func:`_protocol_reference`).
  """
  make = OPTIMIZERS[opt_name]
  plain = make()
  acc = oa.accumulate(k, make())
  chain = optax.chain(oa.accumulate(k, None), make())
  uaa = oa.accumulate(k, make())
  oms = oa.MultiSteps(make(), k)
  xms = optax.MultiSteps(make(), k)
  progs = [
      Program("plain", None, _standard_step(plain), plain.init),
      Program("accumulate", k, _standard_step(acc), acc.init),
      Program("chain", k, _standard_step(chain), chain.init),
      Program("update_and_apply", k, lambda p, s, g: oa.update_and_apply(uaa, g, s, p),
              uaa.init),
      Program("oa_multisteps", k, _standard_step(oms), oms.init),
      Program("optax_multisteps", k, _standard_step(xms), xms.init),
  ]
  if references:
    progs += [_window_sum_reference(make(), k), _protocol_reference(make(), k)]
  return [p for p in progs if keys is None or p.key in keys]


def parse_size(text: str) -> int:
  """``"4M"`` -> 4 * 2**20, ``"512K"`` -> 512 * 2**10, ``"1000"`` -> 1000."""
  text = text.strip().upper()
  scale = {"K": 2**10, "M": 2**20}.get(text[-1:], 1)
  return int(float(text.rstrip("KM")) * scale)


def make_tree(n_params: int, leaves: int = LEAVES, fill: float = 0.01) -> dict[str, jax.Array]:
  """``leaves`` f32 leaves of ``n_params // leaves`` elements each."""
  return {f"w{i:02d}": jnp.full((n_params // leaves,), fill * (i + 1), jnp.float32)
          for i in range(leaves)}


# -------------------------------------------------------------------- timers
@dataclasses.dataclass
class Timer:
  """A compiled program, its donated carry, and its per-phase samples."""

  program: Program
  compiled: Any
  carry: list[Any]
  grads: Tree
  info: dict[str, Any]
  calls: int = 0
  samples: dict[str, list[float]] = dataclasses.field(default_factory=dict)
  enqueue: dict[str, list[float]] = dataclasses.field(default_factory=dict)

  def phase(self) -> str:
    k = self.program.k
    if k is None:
      return "step"
    return "emit" if self.calls % k == k - 1 else "mid"

  def call(self) -> tuple[str, float, float]:
    """One step; returns (phase, time to return, time to result)."""
    phase = self.phase()
    t0 = time.perf_counter()
    out = self.compiled(self.carry[0], self.carry[1], self.grads)
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    t2 = time.perf_counter()
    self.carry = list(out)
    self.calls += 1
    return phase, t1 - t0, t2 - t0

  def run_round(self, windows: int) -> None:
    """``windows`` whole windows; appends each phase's mean call time."""
    times: dict[str, list[float]] = {}
    enq: dict[str, list[float]] = {}
    for _ in range(windows * (self.program.k or K_WINDOW)):
      phase, t_enq, t_all = self.call()
      times.setdefault(phase, []).append(t_all)
      enq.setdefault(phase, []).append(t_enq)
    for phase, ts in times.items():
      self.samples.setdefault(phase, []).append(statistics.fmean(ts))
      self.enqueue.setdefault(phase, []).append(statistics.fmean(enq[phase]))


def compile_program(prog: Program, params: Tree, grads: Tree) -> Timer:
  """Compiles ``prog`` (params and state donated) and returns its timer."""
  state = prog.init(params)
  compiled = jax.jit(prog.step, donate_argnums=(0, 1)).lower(params, state, grads).compile()
  mem = compiled.memory_analysis()
  info = {
      "temps_bytes": int(mem.temp_size_in_bytes),
      "alias_bytes": int(mem.alias_size_in_bytes),
      "conditionals": conditionals(compiled),
      "arg_leaves": len(jax.tree.leaves((params, state, grads))),
      "step_bytes": step_bytes(compiled),
  }
  carry = [jax.tree.map(jnp.copy, params), state]
  return Timer(prog, compiled, carry, grads, info)


@dataclasses.dataclass
class CopyTimer:
  """A jitted copy of ``n_bytes`` into a donated buffer; one sample per round.

  The destination is donated (and kept: ``keep_unused``, else jit prunes the
  unused argument and its donation), so the copy writes into a buffer that
  already exists, as the train steps do. A fresh output would be ``mmap``-ed
  and page-faulted on every call on a CPU: that measures the allocator.
  """

  n_bytes: int
  reps: int = 1
  samples: list[float] = dataclasses.field(default_factory=list)

  def __post_init__(self) -> None:
    self.src = jnp.arange(self.n_bytes // 4, dtype=jnp.float32)
    fn = jax.jit(lambda dst, src: src * 1.0, donate_argnums=(0,), keep_unused=True)
    self.compiled = fn.lower(self.src, self.src).compile()
    self.dst = jnp.zeros_like(self.src)

  def call(self) -> float:
    t0 = time.perf_counter()
    self.dst = jax.block_until_ready(self.compiled(self.dst, self.src))
    return time.perf_counter() - t0

  def run_round(self, windows: int = 0) -> None:
    del windows
    self.samples.append(statistics.fmean(self.call() for _ in range(self.reps)))

  @property
  def bytes_moved(self) -> int:
    return 2 * self.n_bytes  # read + write


def run_rounds(timers: Sequence[Timer], copy: CopyTimer, rounds: int, windows: int,
               seed: int = 0) -> list[float]:
  """Interleaved rounds (``harness.interleaved``); returns the copy's time of each round.

  Warm-up: one window per program (compiles are done; this allocates the
  donated carries and touches every page) and two copies. Then each round runs
  every program (``windows`` whole windows) and the copy once, in a fresh
  seeded random order; each records its own samples.
  """
  for t in timers:
    for _ in range(t.program.k or 1):
      t.call()
  copy.call()
  copy.call()
  start = len(copy.samples)
  # Keyed by position: a Timer (an eq dataclass) is not hashable.
  runs = [*timers, copy]
  harness.interleaved({i: functools.partial(t.run_round, windows) for i, t in enumerate(runs)},
                      rounds, seed=seed, warmup=0)
  return copy.samples[start:]


# ------------------------------------------------------------------ summary


def _quartiles(xs: Sequence[float]) -> tuple[float, float]:
  if len(xs) < 2:
    return (xs[0], xs[0]) if xs else (float("nan"), float("nan"))
  q = statistics.quantiles(xs, n=4)
  return q[0], q[2]


def row_samples(timers: dict[str, Timer], copy_samples: Sequence[float], copy_bytes: int,
                row: str, n_params: int, opt_name: str) -> list[float]:
  """Per-round times of a row: measured, or bytes / same-round bandwidth."""
  spec = ROW_SPECS[row]
  if spec.program is None:
    floor_bytes = floor_passes(spec.floor, opt_name) * 4 * n_params
    return [floor_bytes * c / copy_bytes for c in copy_samples]
  return timers[spec.program].samples[spec.phase]


def summarize(timers: Sequence[Timer], copy_samples: Sequence[float], copy_bytes: int,
              n_params: int, opt_name: str,
              rows: Sequence[str] | None = None) -> list[dict[str, Any]]:
  """One record per row: times, paired ratios, floors, program facts."""
  pbytes = 4 * n_params
  by_prog = {t.program.key: t for t in timers}
  rows = [r for r, _ in ROWS if ROW_SPECS[r].program in (None, *by_prog)] if rows is None else rows
  samples = {r: row_samples(by_prog, copy_samples, copy_bytes, r, n_params, opt_name)
             for r in rows}
  ms_ref = {"mid": "optax_multisteps_mid", "emit": "optax_multisteps_emit",
            "step": "optax_multisteps_emit"}
  out = []
  for row in rows:
    spec = ROW_SPECS[row]
    s = samples[row]
    floor_name = {"mid": "floor_mid", "protocol": "floor_protocol",
                  "plain": "floor_plain"}[spec.floor]
    floor_s = row_samples(by_prog, copy_samples, copy_bytes, floor_name, n_params, opt_name)
    mid_floor_s = row_samples(by_prog, copy_samples, copy_bytes, "floor_mid", n_params, opt_name)
    q1, q3 = _quartiles(s)
    rec: dict[str, Any] = {
        "size": n_params, "param_bytes": pbytes, "optimizer": opt_name, "row": row,
        "label": LABELS[row], "program": spec.program, "phase": spec.phase,
        "floor": spec.floor, "floor_passes": floor_passes(spec.floor, opt_name),
        "floor_bytes": floor_passes(spec.floor, opt_name) * pbytes,
        "time_s": harness.median(s), "time_q1_s": q1, "time_q3_s": q3, "time_min_s": min(s),
        "ratio_floor": harness.paired_ratio(s, floor_s),
        "ratio_floor_mid": harness.paired_ratio(s, mid_floor_s),
        "ratio_plain": harness.paired_ratio(s, samples["plain"]) if "plain" in samples else None,
        "ratio_optax_multisteps": (harness.paired_ratio(s, samples[ms_ref[spec.phase]])
                                   if ms_ref[spec.phase] in samples else None),
        "reference": spec.reference if spec.reference in samples else None,
        "ratio_reference": (harness.paired_ratio(s, samples[spec.reference])
                            if spec.reference in samples else None),
        "rounds": len(s),
    }
    if spec.program is not None:
      t = by_prog[spec.program]
      rec.update(t.info)
      rec["temps_ratio"] = t.info["temps_bytes"] / pbytes
      moved = t.info["step_bytes"]["emit" if spec.phase == "emit" else "mid"]
      rec["compiled_passes"] = moved / pbytes
      rec["alias_ratio"] = t.info["alias_bytes"] / pbytes
      rec["enqueue_s"] = harness.median(t.enqueue[spec.phase])
    else:
      rec.update({"temps_bytes": None, "temps_ratio": None, "alias_bytes": None,
                  "alias_ratio": None, "conditionals": None, "arg_leaves": None,
                  "enqueue_s": None, "step_bytes": None, "compiled_passes": None})
    out.append(rec)
  return out


def host_overhead(opt_name: str, rounds: int, windows: int, seed: int = 1,
                  keys: Sequence[str] | None = None) -> list[dict[str, Any]]:
  """Per-call time of each program on a tiny model, where dispatch dominates.

  A warm-up window per program, then interleaved rounds of ``windows`` windows each.
  """
  params = make_tree(TINY_PARAMS)
  grads = make_tree(TINY_PARAMS, fill=1e-3)
  timers = [compile_program(p, params, grads) for p in make_programs(opt_name, keys=keys)]
  for t in timers:
    for _ in range(t.program.k or 1):
      t.call()
  harness.interleaved({i: functools.partial(t.run_round, windows) for i, t in enumerate(timers)},
                      rounds, seed=seed, warmup=0)
  out = []
  for t in timers:
    rec: dict[str, Any] = {"optimizer": opt_name, "program": t.program.key,
                           "params": TINY_PARAMS, "arg_leaves": t.info["arg_leaves"]}
    for phase in t.samples:
      rec[f"{phase}_call_s"] = harness.median(t.samples[phase])
      rec[f"{phase}_enqueue_s"] = harness.median(t.enqueue[phase])
    out.append(rec)
  return out


# ---------------------------------------------------------------------- bars
BARS: list[tuple[str, str, str, float]] = [
    # (name, row, measure, limit)
    ("protocol mid-step (oa.accumulate + apply_updates) / 3P floor",
     "accumulate_mid", "ratio_floor_mid", 2.6),
    ("protocol emit (oa.accumulate + apply_updates) / plain adam",
     "accumulate_emit", "ratio_plain", 1.5),
    ("update_and_apply mid-step / 3P floor", "update_and_apply_mid", "ratio_floor_mid", 1.15),
    ("update_and_apply emit / plain adam", "update_and_apply_emit", "ratio_plain", 1.15),
    ("temporaries / params, standard path (oa.accumulate + apply_updates)",
     "accumulate_mid", "temps_ratio", 1.0),
    ("temporaries / params, update_and_apply (~0)", "update_and_apply_mid", "temps_ratio", 0.05),
]


def evaluate_bars(records: Sequence[dict[str, Any]], size: int,
                  opt_name: str = "adam") -> list[dict[str, Any]]:
  """The project's bars from the measured records at ``size``, ``opt_name``."""
  by_row = {r["row"]: r for r in records if (r["size"], r["optimizer"]) == (size, opt_name)}
  bars = []
  for name, row, measure, limit in BARS:
    rec = by_row.get(row)
    value = None if rec is None else rec.get(measure)
    # Temporaries also hold a few scalars (counters, the predicate): a ratio
    # within 1e-3 of the limit counts as at the limit.
    slack = 1e-3 if measure == "temps_ratio" else 0.0
    ref = by_row.get(rec.get("reference") or "") if rec is not None else None
    bars.append({"bar": name, "row": row, "measure": measure, "value": value,
                 "limit": limit, "size": size, "optimizer": opt_name,
                 "passed": value is not None and value <= limit + slack,
                 "reference": None if ref is None else ref["row"],
                 "reference_value": None if ref is None else ref.get(measure),
                 "ratio_reference": None if ref is None else rec.get("ratio_reference")})
  return bars


# ------------------------------------------------------------------- reports
def _x(v: float | None, digits: int = 2) -> str:
  return "-" if v is None else f"{v:.{digits}f}x"


def size_label(n: int) -> str:
  if n >= 2**20:
    return f"{n / 2**20:g}M"
  return f"{n / 2**10:g}K" if n >= 2**10 else str(n)


def rows_table(records: Sequence[dict[str, Any]]) -> list[str]:
  """Markdown table of the records of one size and optimizer."""
  lines = [
      "| variant | floor | compiled passes | ms | x its floor | x 3P floor | x plain |"
      " x optax.MultiSteps | x reference | temps / params | conditionals |",
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in records:
    conds = "-" if r["conditionals"] is None else str(r["conditionals"])
    passes = r.get("compiled_passes")
    lines.append(
        f"| {r['label']} | {r['floor_passes']}P | {'-' if passes is None else f'{passes:.1f}P'} |"
        f" {r['time_s'] * 1e3:.3f} |"
        f" {_x(r['ratio_floor'])} | {_x(r['ratio_floor_mid'])} | {_x(r['ratio_plain'])} |"
        f" {_x(r['ratio_optax_multisteps'])} | {_x(r.get('ratio_reference'))} |"
        f" {_x(r['temps_ratio'])} | {conds} |")
  return lines


def bars_table(bars: Sequence[dict[str, Any]]) -> list[str]:
  """The bars; an emitting bar also shows its reference computation's value."""
  lines = ["| bar | measured | limit | result | the reference, same measure | measured /"
           " reference |", "|---|---:|---:|:---:|---:|---:|"]
  for b in bars:
    lines.append(f"| {b['bar']} | {_x(b['value'], 3)} | {b['limit']}x |"
                 f" {'PASS' if b['passed'] else '**FAIL**'} |"
                 f" {_x(b.get('reference_value'), 3)} | {_x(b.get('ratio_reference'), 3)} |")
  return lines


def host_table(host: Sequence[dict[str, Any]], enqueue: dict[str, float] | None,
               enqueue_size: int | None) -> list[str]:
  head = "| program | argument leaves | tiny: mid / step us | tiny: emit us | tiny: enqueue us |"
  sep = "|---|---:|---:|---:|---:|"
  if enqueue:
    head += f" enqueue us at {size_label(enqueue_size or 0)} (mid) |"
    sep += "---:|"
  lines = [head, sep]
  labels = dict(PROGRAMS)
  for h in host:
    mid = h.get("mid_call_s", h.get("step_call_s"))
    emit = h.get("emit_call_s")
    enq = h.get("mid_enqueue_s", h.get("step_enqueue_s"))
    line = (f"| {labels[h['program']]} | {h['arg_leaves']} | {mid * 1e6:.1f} |"
            f" {'-' if emit is None else f'{emit * 1e6:.1f}'} | {enq * 1e6:.1f} |")
    if enqueue:
      e = enqueue.get(h["program"])
      line += f" {'-' if e is None else f'{e * 1e6:.1f}'} |"
    lines.append(line)
  return lines


def markdown(result: dict[str, Any]) -> str:
  """The results as markdown: setup, bandwidth, one table per size/optimizer, bars."""
  meta, bw = result["meta"], result["bandwidth"]
  command = " ".join(["python benchmarks/bench_accumulate.py", *meta["argv"]])
  lines = [
      "# Accumulation train-step benchmark",
      "",
      f"Generated by `{command}` on {meta['machine']} ({meta['cpus']} CPUs, backend"
      f" {meta['backend']}, load average {meta['loadavg']}), jax {meta['jax']}, optax"
      f" {meta['optax']}, {meta['date']}. Train step `step(params, state, grads) ->"
      f" (params, state)`, params and state donated, window k = {meta['k']}; mid and emit"
      " rows are the phases of the same compiled program. Times: medians over"
      f" {meta['rounds']} interleaved rounds (fresh random order per round); ratios: medians"
      " over rounds of the per-round ratio.",
      "",
      f"* Copy bandwidth (jitted copy of {bw['copy_bytes'] // 2 // 2**20} MiB into a donated"
      f" buffer, read + write, median over all rounds): **{bw['copy_GBps']:.1f} GB/s**.",
      "* Floors = bytes / that bandwidth, per round. P = parameter bytes. Train-step mid 3P"
      " (read g, acc; write acc); optax-protocol mid 6P (+ apply_updates reads params and"
      " the updates, writes params); plain step: adam 7P (read g, mu, nu, params;"
      " write mu, nu, params), sgd 3P. Emitting rows use the plain step's floor.",
      "* Compiled passes: the bytes the row's compiled step reads and writes over P"
      " (`optax_accum.debug.step_bytes`, no cache reuse between kernels): what this"
      " backend's program moves, where the floor is what any program must move.",
      "* `chain(oa.accumulate(k, None), opt)` steps the optimizer on the zero updates of every"
      " mid-step: it is not large-batch training for a stateful optimizer.",
      "* References (programs, not floors; every call is a step): `opt` on the window's"
      " sum `(acc + g) / k`, applied, with no accumulation code (what an emitting step of"
      " `update_and_apply` computes), and the same inside a `lax.cond` with the updates"
      " written into `acc` and applied outside (what the optax protocol's emitting step"
      " must do once `update` steps inside a conditional). `x reference` compares an"
      " emitting row with its reference in the same round. As programs they are noisy"
      " and can run slower than the row they serve.",
      "",
  ]
  for size in meta["sizes"]:
    for opt in meta["optimizers"]:
      recs = [r for r in result["records"] if (r["size"], r["optimizer"]) == (size, opt)]
      lines += [f"## {size_label(size)} params ({4 * size / 2**20:g} MiB), {opt}", "",
                *rows_table(recs), ""]
  lines += ["## Per-call host overhead", "",
            f"Tiny model ({TINY_PARAMS} f32 params in {LEAVES} leaves): the time of one"
            " blocked call, where dispatch dominates, and the enqueue time (until the call"
            " returns). Argument leaves: params + state + grads.", ""]
  for opt in meta["optimizers"]:
    host = [h for h in result["host_overhead"] if h["optimizer"] == opt]
    enq = result["enqueue"].get(opt)
    lines += [f"### {opt}", "", *host_table(host, enq, result["enqueue_size"]), ""]
  bsize = result["bar_size"]
  note = "" if bsize == parse_size("4M") else " (not 4M: the bars are set at 4M)"
  lines += [f"## Bars ({size_label(bsize)} params, adam{note})", "", *bars_table(result["bars"]),
            ""]
  return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
  """Per optimizer: time / 3P floor per row and size (log); temporaries per program."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  sizes, opts = result["meta"]["sizes"], result["meta"]["optimizers"]
  by_key = {(r["size"], r["optimizer"], r["row"]): r for r in result["records"]}
  rows = [r for r, _ in ROWS]
  fig, axes = plt.subplots(len(opts), 2, figsize=(16, 4.6 * len(opts)), squeeze=False,
                           gridspec_kw={"width_ratios": [3, 1.2]})
  for i, opt in enumerate(opts):
    ax = axes[i][0]
    x = np.arange(len(rows))
    width = 0.8 / len(sizes)
    for j, size in enumerate(sizes):
      vals = [by_key.get((size, opt, r), {}).get("ratio_floor_mid", np.nan) for r in rows]
      ax.bar(x + (j - (len(sizes) - 1) / 2) * width, vals, width, label=size_label(size))
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x, [LABELS[r].replace(" (", "\n(") for r in rows], fontsize=7, rotation=35,
                  ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("time / 3P floor (bytes / copy bandwidth)")
    ax.set_title(f"{opt}: train step, window k={result['meta']['k']} (log scale)")
    ax.legend(fontsize=8)
    ax = axes[i][1]
    size = sizes[-1]
    progs = [k for k, _ in PROGRAMS]
    vals = []
    for p in progs:
      rec = next((r for r in result["records"] if (r["size"], r["optimizer"], r["program"])
                  == (size, opt, p)), None)
      vals.append(np.nan if rec is None else rec["temps_ratio"])
    ax.barh(np.arange(len(progs)), vals, color="tab:purple")
    ax.axvline(1.0, color="r", lw=0.8, ls="--")
    ax.set_yticks(np.arange(len(progs)), progs, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("compiled temporaries / param bytes")
    ax.set_title(f"{opt}: temporaries ({size_label(size)})")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


# ---------------------------------------------------------------------- main
def measure_size(size: int, opt_name: str, copy: CopyTimer, rounds: int, windows: int,
                 keys: Sequence[str] | None = None) -> tuple[list[dict[str, Any]], float]:
  """Compiles and times every program at one size; returns records, compile s."""
  params = make_tree(size)
  grads = make_tree(size, fill=1e-3)
  t0 = time.perf_counter()
  programs = make_programs(opt_name, keys=keys, references=True)
  timers = [compile_program(p, params, grads) for p in programs]
  compile_s = time.perf_counter() - t0
  copy_samples = run_rounds(timers, copy, rounds, windows)
  recs = summarize(timers, copy_samples, copy.bytes_moved, size, opt_name)
  del timers
  return recs, compile_s


def windows_for(size: int) -> int:
  """Whole windows per round: >= ~8M params touched per program per round."""
  return max(1, (8 * 2**20) // (size * K_WINDOW))


def main(argv: list[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark and writes the reports; returns the result dict."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--sizes", default="1M,4M,16M", help="comma-separated, e.g. 1M,4M,16M")
  ap.add_argument("--optimizers", default="sgd,adam")
  ap.add_argument("--rounds", type=int, default=None,
                  help="interleaved rounds per size/optimizer (default 15; --quick 3)")
  ap.add_argument("--quick", action="store_true",
                  help="256K params, 3 rounds: a smoke run of every row (about a minute)")
  ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
  args = ap.parse_args(argv)
  sizes = [parse_size("256K")] if args.quick else [parse_size(s) for s in args.sizes.split(",")]
  rounds = args.rounds or (3 if args.quick else 15)
  opts = args.optimizers.split(",")
  for opt in opts:
    if opt not in OPTIMIZERS:
      ap.error(f"unknown optimizer {opt!r}; choose from {sorted(OPTIMIZERS)}")
  bar_size = parse_size("4M") if parse_size("4M") in sizes else sizes[len(sizes) // 2]

  t_start = time.perf_counter()
  copy = CopyTimer(64 * 2**20)
  records: list[dict[str, Any]] = []
  for size in sizes:
    for opt in opts:
      t0 = time.perf_counter()
      recs, compile_s = measure_size(size, opt, copy, rounds, windows_for(size))
      records += recs
      get = {r["row"]: r for r in recs}
      print(f"{size_label(size):>5s} {opt:4s}: compile {compile_s:5.1f} s, total"
            f" {time.perf_counter() - t0:5.1f} s; x 3P floor: accumulate mid"
            f" {get['accumulate_mid']['ratio_floor_mid']:.2f}x, update_and_apply mid"
            f" {get['update_and_apply_mid']['ratio_floor_mid']:.2f}x, optax.MultiSteps mid"
            f" {get['optax_multisteps_mid']['ratio_floor_mid']:.2f}x", flush=True)
  t0 = time.perf_counter()
  host = [h for opt in opts for h in host_overhead(opt, rounds, windows=16)]
  enqueue_size = min(sizes)
  enqueue = {opt: {r["program"]: r["enqueue_s"] for r in records
                   if (r["size"], r["optimizer"]) == (enqueue_size, opt)
                   and r["program"] is not None and r["phase"] in ("mid", "step")}
             for opt in opts}
  print(f"host overhead: {time.perf_counter() - t0:.1f} s", flush=True)
  copy_s = harness.median(copy.samples)
  result: dict[str, Any] = {
      "meta": {
          "argv": list(argv if argv is not None else sys.argv[1:]),
          "sizes": sizes, "optimizers": opts, "rounds": rounds, "leaves": LEAVES,
          "k": K_WINDOW, "jax": jax.__version__, "optax": optax.__version__,
          "backend": jax.default_backend(),
          "machine": f"{platform.machine()} {platform.processor() or platform.system()}",
          "cpus": os.cpu_count(), "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg()),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "wall_s": None,
      },
      "bandwidth": {"copy_bytes": copy.bytes_moved, "copy_time_s": copy_s,
                    "copy_GBps": copy.bytes_moved / copy_s / 1e9,
                    "floor_passes": {"mid": MID_PASSES, "protocol": PROTOCOL_PASSES,
                                     **{f"plain_{k}": v for k, v in PLAIN_PASSES.items()}}},
      "records": records,
      "host_overhead": host,
      "enqueue_size": enqueue_size,
      "enqueue": enqueue,
      "bar_size": bar_size,
      "bars": evaluate_bars(records, bar_size) if "adam" in opts else [],
  }
  result["meta"]["wall_s"] = round(time.perf_counter() - t_start, 1)
  harness.write(args.out, "accumulate", result, markdown(result), plot)
  print(f"copy bandwidth {result['bandwidth']['copy_GBps']:.1f} GB/s;"
        f" {result['meta']['wall_s']} s")
  print(f"\nBars ({size_label(bar_size)} params, adam):")
  print("\n".join(bars_table(result["bars"])))
  return result


if __name__ == "__main__":
  main()
