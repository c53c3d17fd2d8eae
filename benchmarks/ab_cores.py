"""This checkout's core against earlier revisions, timed in the same interleaved rounds.

Each ``--against`` revision's ``optax_accum/`` is extracted with ``git
archive`` into a temporary folder and renamed (``optax_accum_<rev>``), so
every version runs in this one process, on the same buffers' sizes, in the
same shuffled rounds (``bench_accumulate.run_rounds``). Per program (adam,
k = 4, f32 params in 8 leaves; params and state donated) and phase, it
reports the median over rounds of this checkout's time over each revision's.

Usage: ``python benchmarks/ab_cores.py --against ad41e14 adb6c94 --out benchmarks/results``
(0.2.0 and the previous stop).
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path
from typing import Any

import bench_accumulate as ba
import harness
import optax

import optax_accum

ROOT = Path(__file__).resolve().parent.parent
K = 4
PROGRAMS = ("protocol", "update_and_apply", "weighted", "noise")


def extract(rev: str, into: Path) -> Any:
  """``optax_accum/`` at ``rev``, importable as ``optax_accum_<rev>``."""
  name = "optax_accum_" + re.sub(r"\W", "_", rev)
  archive = subprocess.run(["git", "archive", rev, "optax_accum"], cwd=ROOT, check=True,
                           capture_output=True).stdout
  with tarfile.open(fileobj=BytesIO(archive)) as tar:
    tar.extractall(into / "src", filter="data")
  (into / "src" / "optax_accum").rename(into / name)
  for path in (into / name).rglob("*.py"):
    path.write_text(re.sub(r"\boptax_accum\b", name, path.read_text()))
  return importlib.import_module(name)


def programs(pkg: Any, tag: str) -> list[ba.Program]:
  out = []
  for kind, options, call in (("protocol", {}, {}),
                              ("weighted", {"reduction": "weighted"}, {"weight": 2.0}),
                              ("noise", {"track_noise_scale": True}, {})):
    tx = pkg.accumulate(K, optax.adam(1e-3), **options)

    def step(p: Any, s: Any, g: Any, tx: Any = tx, call: dict[str, Any] = call) -> Any:
      updates, s = tx.update(g, s, p, **call)
      return optax.apply_updates(p, updates), s

    out.append(ba.Program(f"{tag} {kind}", K, step, tx.init))
  tx = pkg.accumulate(K, optax.adam(1e-3))
  out.append(ba.Program(f"{tag} update_and_apply", K,
                        lambda p, s, g, tx=tx: pkg.update_and_apply(tx, g, s, p), tx.init))
  return out


def markdown(result: dict[str, Any]) -> str:
  revs = result["against"]
  lines = [
      "# This core against earlier ones (same interleaved rounds)",
      "",
      f"`python benchmarks/ab_cores.py --against {' '.join(revs)}`: adam, k = {K},"
      f" {result['params'] / 2**20:.0f}M f32 params in 8 leaves, {result['rounds']} rounds,"
      f" {result['machine']['backend']} ({result['machine']['cpu_count']} CPUs, load"
      f" {result['machine']['loadavg']}). Median over rounds of this checkout's time over"
      " the revision's (below 1: faster now).",
      "",
      "| program | phase | " + " | ".join(f"now / {r}" for r in revs) + " | now (ms) |",
      "|---|---|" + "---:|" * len(revs) + "---:|",
  ]
  for row in result["rows"]:
    lines.append(f"| {row['program']} | {row['phase']} | "
                 + " | ".join(f"{row['ratios'][r]:.3f}" for r in revs)
                 + f" | {row['ms']:.2f} |")
  return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--against", nargs="+", required=True, help="git revisions to time against")
  ap.add_argument("--size", default="4M")
  ap.add_argument("--rounds", type=int, default=41)
  ap.add_argument("--out", type=Path, default=None)
  args = ap.parse_args(argv)
  n = ba.parse_size(args.size)
  params, grads = ba.make_tree(n), ba.make_tree(n, fill=1e-3)
  with tempfile.TemporaryDirectory() as tmp:
    sys.path.insert(0, tmp)
    progs = programs(optax_accum, "now")
    for rev in args.against:
      progs += programs(extract(rev, Path(tmp)), rev)
    timers = {p.key: ba.compile_program(p, params, grads) for p in progs}
    ba.run_rounds(list(timers.values()), ba.CopyTimer(64 * 2**20), args.rounds, windows=2)
  rows = []
  for kind in PROGRAMS:
    for phase in ("mid", "emit"):
      now = timers[f"now {kind}"].samples[phase]
      rows.append({"program": kind, "phase": phase, "ms": 1e3 * harness.median(now),
                   "ratios": {r: harness.paired_ratio(now, timers[f"{r} {kind}"].samples[phase])
                              for r in args.against}})
  result = {"against": args.against, "params": n, "rounds": args.rounds,
            "machine": harness.machine(), "rows": rows}
  if args.out is None:
    print(markdown(result))
  else:
    harness.write(args.out, "ab_cores", result, markdown(result))
  return result


if __name__ == "__main__":
  main()
