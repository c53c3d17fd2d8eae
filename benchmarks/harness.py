"""What every benchmark script shares: how it times, where it ran, its results files.

A script that times programs against each other runs them in
:func:`interleaved` rounds (every program once per round, in a fresh seeded
random order) and compares them with :func:`paired_ratio` (the median over
rounds of same-round ratios); ``bench_accumulate.run_rounds`` is
:func:`interleaved` over its train-step timers and the bandwidth copy. Each
script calls :func:`write` once: the result as JSON, its markdown (printed
too), and a PNG where it plots (its ``plot`` draws a figure from :func:`pyplot`).
The rest is what several scripts build alike: the command line
(:func:`parser`), the two train steps (:func:`protocol_step`,
:func:`fast_step`) and markdown tables (:func:`table`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import jax
import optax

import optax_accum as oa

K = TypeVar("K", bound=Hashable)
RESULTS = Path(__file__).resolve().parent / "results"


def parser(doc: str, quick: str | None = None) -> argparse.ArgumentParser:
  """The script's first docstring line as description, ``--out`` (default
  ``benchmarks/results``) and, with its help text, ``--quick``."""
  ap = argparse.ArgumentParser(description=doc.split("\n")[0])
  ap.add_argument("--out", type=Path, default=RESULTS,
                  help="folder for the results files (default benchmarks/results)")
  if quick:
    ap.add_argument("--quick", action="store_true", help=quick)
  return ap


def protocol_step(tx: Any, **kw: Any) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
  """``step(params, state, grads)``: ``tx.update`` then ``optax.apply_updates``."""
  def step(params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
    updates, state = tx.update(grads, state, params, **kw)
    return optax.apply_updates(params, updates), state
  return step


def fast_step(tx: Any, **kw: Any) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
  """``step(params, state, grads)`` through ``oa.update_and_apply``."""
  return lambda params, state, grads: oa.update_and_apply(tx, grads, state, params, **kw)


def table(head: str, align: str, rows: Iterable[Sequence[Any]]) -> list[str]:
  """A markdown table: ``head`` the columns joined by " | ", ``align`` one ``l``,
  ``r`` or ``c`` per column, each row its cells.

  >>> table("k | x", "rl", [(1, "a")])
  ['| k | x |', '|---:|---|', '| 1 | a |']
  """
  rule = {"l": "---|", "r": "---:|", "c": ":---:|"}
  return [f"| {head} |", "|" + "".join(rule[a] for a in align),
          *("| " + " | ".join(map(str, r)) + " |" for r in rows)]


def mib(n_bytes: float) -> str:
  return f"{n_bytes / 2**20:.2f}"


def pyplot() -> Any:
  """``matplotlib.pyplot`` on the Agg backend (no display)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def interleaved(runs: Mapping[K, Callable[[], object]], rounds: int, *, seed: int = 0,
                warmup: int = 1) -> dict[K, list[float]]:
  """Seconds of each run in each round: ``{key: [round 0, round 1, ...]}``.

  Every round calls every run once, in a fresh order drawn from
  ``random.Random(seed)`` (a fixed or rotating order would put the same run
  after the same neighbour, a cache-evicting copy say, round after round).
  ``warmup`` rounds go first, shuffled the same way and not recorded. A run
  that times itself (several calls, or per phase) ignores its entry; one
  that makes ``n`` calls divides its seconds by ``n``. Same-round samples pair
  up for :func:`paired_ratio`.

  >>> log = []
  >>> secs = interleaved({"a": lambda: log.append("a"), "b": lambda: log.append("b")},
  ...                    rounds=3, seed=0)
  >>> {key: len(s) for key, s in secs.items()}, len(log)  # 1 warm-up round + 3
  ({'a': 3, 'b': 3}, 8)
  >>> sorted(log[2:4]) == sorted(log[6:8]) == ["a", "b"]  # each round runs each once
  True
  """
  rng = random.Random(seed)
  samples: dict[K, list[float]] = {key: [] for key in runs}
  for r in range(warmup + rounds):
    order = list(runs)
    rng.shuffle(order)
    for key in order:
      t0 = time.perf_counter()
      runs[key]()
      if r >= warmup:
        samples[key].append(time.perf_counter() - t0)
  return samples


def median(xs: Sequence[float]) -> float:
  """``statistics.median``, NaN for no samples."""
  return statistics.median(xs) if xs else float("nan")


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> float:
  """Median over rounds of ``num[r] / den[r]`` (same round, seconds apart).

  >>> paired_ratio([2.0, 4.0, 9.0], [1.0, 2.0, 3.0])
  2.0
  """
  return median([a / b for a, b in zip(num, den, strict=True)])


def machine() -> dict[str, Any]:
  """The backend, device, JAX and optax versions and host of this run."""
  return {
      "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
      "jax": jax.__version__, "optax": optax.__version__, "cpu_count": os.cpu_count(),
      "machine": platform.machine(),
      "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg()),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }


def write(out: Path, stem: str, result: dict[str, Any], markdown: str,
          plot: Callable[[dict[str, Any]], Any] | None = None) -> None:
  """``out/stem.json``, ``out/stem.md`` (printed) and, with ``plot`` (result ->
  figure), ``out/stem.png`` at the figure's dpi."""
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
  (out / f"{stem}.md").write_text(markdown if markdown.endswith("\n") else markdown + "\n")
  if plot is not None:
    fig = plot(result)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png")
    pyplot().close(fig)
  print(markdown)
  print(f"wrote {out}/{stem}.{{json,md{',png' if plot else ''}}}")
