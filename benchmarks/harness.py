"""What every benchmark script shares: how it times (:func:`interleaved` rounds, compared
by :func:`paired_ratio`: NOTES.md, "How the timings are taken"), where it ran, its results
files (:func:`write`), and what several scripts build alike.
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
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum as oa

K = TypeVar("K", bound=Hashable)
RESULTS = Path(__file__).resolve().parent / "results"


def parser(doc: str, quick: str | None = None, **flags: Any) -> argparse.ArgumentParser:
  """The script's first docstring line as description, ``--out`` (default
  ``benchmarks/results``), with its help text ``--quick``, and per keyword a flag typed as its
  default (``d_model=128``: ``--d-model``; a list takes one or more)."""
  ap = argparse.ArgumentParser(description=doc.split("\n")[0])
  ap.add_argument("--out", type=Path, default=RESULTS,
                  help="folder for the results files (default benchmarks/results)")
  if quick:
    ap.add_argument("--quick", action="store_true", help=quick)
  for name, default in flags.items():
    many = isinstance(default, list)
    ap.add_argument(f"--{name.replace('_', '-')}", default=default, nargs="+" if many else None,
                    type=type(default[0] if many else default))
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


def rss() -> int:
  """This process's resident host memory now, in bytes (Linux)."""
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def mib(n_bytes: float) -> str:
  return f"{n_bytes / 2**20:.2f}"


def peak_bytes(compiled: Any) -> int:
  """A compiled program's peak per device: ``argument + output + temp - alias`` bytes of its
  ``memory_analysis()`` (XLA's ``peak_memory_in_bytes`` leaves the temporaries out on XLA:CPU)."""
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
             - m.alias_size_in_bytes)


def pyplot() -> Any:
  """``matplotlib.pyplot`` on the Agg backend (no display)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def interleaved(runs: Mapping[K, Callable[[], object]], rounds: int, *, seed: int = 0,
                warmup: int = 1) -> dict[K, list[float]]:
  """Seconds of each run in each round: ``{key: [round 0, round 1, ...]}``.

  Every round calls every run once, in a fresh order from ``random.Random(seed)``
  (a fixed order puts the same run after the same neighbour, a cache-evicting copy
  say, every round), after ``warmup`` rounds not recorded. A run that times itself
  ignores its entry. Same-round samples pair up for :func:`paired_ratio`.

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
      "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
  }


def write(out: Path, stem: str, result: dict[str, Any], markdown: str,
          plot: Callable[[dict[str, Any]], Any] | None = None) -> None:
  """``out/stem.json``, ``out/stem.md`` (printed) and, with ``plot`` (result ->
  figure), ``out/stem.png`` at the figure's dpi."""
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


def rel_diff(tree: Any, ref: Any) -> float:
  """The largest ``|tree - ref|`` over the largest ``|ref|``, leaf by leaf."""
  return max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
             for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(ref), strict=True))


def compare(fns: Sequence[tuple[str, Callable[..., Any]]], args: Sequence[Any], rounds: int,
            iters: int) -> list[dict[str, Any]]:
  """Per named value-and-grad function, jitted, against the first: its loss, compiled
  temporaries, :func:`rel_diff` of its gradients and step time (``iters`` calls a round)."""
  rows, calls = [], []
  for name, fn in fns:
    c = jax.jit(fn).lower(*args).compile()
    value, grads = c(*args)
    rows.append({"config": name, "loss": float(jax.tree.leaves(value)[0]), "grads": grads,
                 "temp_bytes": int(c.memory_analysis().temp_size_in_bytes)})
    calls.append(lambda c=c: jax.block_until_ready([c(*args) for _ in range(iters)][-1]))
  secs, ref = interleaved(dict(enumerate(calls)), rounds), rows[0]["grads"]
  for i, row in enumerate(rows):
    row.update(step_ms=1e3 * median(secs[i]) / iters, step_ratio=paired_ratio(secs[i], secs[0]),
               temp_ratio_vs_full=row["temp_bytes"] / rows[0]["temp_bytes"],
               grad_rel_diff_vs_full=rel_diff(row.pop("grads"), ref))
  return rows


def compare_table(rows: Sequence[dict[str, Any]],
                  extra: tuple[str, Callable[[dict[str, Any]], str]]) -> list[str]:
  """:func:`compare`'s rows as a markdown :func:`table`; ``extra``: a column (header, cell)."""
  head, cell = extra
  return table(
      f"config | temporaries (MiB) | vs full | {head} | step (ms) | step vs full"
      " | max rel. grad diff vs full", "lrrrrrr",
      [[r["config"], mib(r["temp_bytes"]), f"{r['temp_ratio_vs_full']:.2f}x", cell(r),
        f"{r['step_ms']:.1f}", f"{r['step_ratio']:.2f}x", f"{r['grad_rel_diff_vs_full']:.1e}"]
       for r in rows])


def bars(rows: Sequence[dict[str, Any]]) -> Any:
  """:func:`compare`'s rows: temporaries (red: a row's ``temp_bound``), step time over the first."""
  y = np.arange(len(rows))
  fig, axes = pyplot().subplots(1, 2, figsize=(13, 0.35 * len(rows) + 2), dpi=110, sharey=True)
  axes[0].barh(y, [r["temp_bytes"] / 2**20 for r in rows], color="tab:blue")
  for yy, r in zip(y, rows, strict=True):
    if "temp_bound" in r:
      axes[0].plot([r["temp_bound"] / 2**20] * 2, [yy - 0.4, yy + 0.4], color="tab:red")
  axes[0].set_yticks(y, [r["config"] for r in rows])
  axes[0].set_xlabel("compiled temporaries (MiB); red: bound")
  axes[1].barh(y, [r["step_ratio"] for r in rows], color="tab:orange")
  axes[1].set_xlabel("step time / the full batch's (same round)")
  axes[0].invert_yaxis()  # (shared: both)
  return fig
