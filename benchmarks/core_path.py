"""How heavy one trace of an accumulating update is: the table of issue 20, measured.

For each configuration of ``accumulate(4, adam)`` (and ``MultiSteps``), one
``jax.jit(step).lower(...)`` runs under ``sys.setprofile`` and records:

* the distinct package functions called (files under ``optax_accum/``, the
  demo excluded; every lambda of a file counts as one, as do its
  comprehensions),
* how often a call lands in another package file than the previous call,
* how many times the inner optimizer's ``update`` is traced.

Then trace + lower + compile time of a train step on a 300-leaf tree against
``optax.MultiSteps``' in the same process (best of 2 rounds, fresh shapes each
round so no cache is hit), the top-level public names and ``microbatched``'s
parameters. Writes ``core_path.json`` and ``core_path.md`` to ``--out``.

Usage: ``python benchmarks/core_path.py --out benchmarks/results``.
"""

from __future__ import annotations

import argparse
import inspect
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
import harness
import jax
import jax.numpy as jnp
import optax

import optax_accum as oa

PACKAGE = os.path.dirname(oa.__file__)
GOALS = {"functions (mean)": 20, "functions (worst)": 25, "file moves (worst)": 8,
         "inner traces": 1, "compile ratio": 1.25, "public names": 20, "microbatched params": 9}
CONFIGS = {
    "mean": ({}, {}),
    "sum": ({"reduction": "sum"}, {}),
    "weighted": ({"reduction": "weighted"}, {"weight": 2.0}),
    "noise": ({"track_noise_scale": True}, {}),
    "weighted+noise": ({"reduction": "weighted", "track_noise_scale": True}, {"weight": 2.0}),
    "skip_nonfinite": ({"skip_nonfinite": True}, {}),
}


def counting(opt: optax.GradientTransformation) -> tuple[Any, dict[str, int]]:
  """``opt`` with a counter of how often its ``update`` is traced."""
  calls = {"n": 0}

  def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
    calls["n"] += 1
    return opt.update(updates, state, params, **extra)

  return optax.GradientTransformationExtraArgs(opt.init, update), calls


def walk(step: Callable[..., Any], args: tuple[Any, ...]) -> tuple[int, int]:
  """(distinct package functions, moves between package files) in one lowering."""
  functions: set[tuple[str, str]] = set()
  moves, last = 0, None

  def profile(frame: Any, event: str, _: Any) -> None:
    nonlocal moves, last
    name = frame.f_code.co_filename
    if event != "call" or not name.startswith(PACKAGE) or name.endswith("demo.py"):
      return
    functions.add((os.path.basename(name), frame.f_code.co_name))
    moves += last is not None and last != name
    last = name

  sys.setprofile(profile)
  try:
    jax.jit(step).lower(*args)
  finally:
    sys.setprofile(None)
  return len(functions), moves


def paths() -> dict[str, dict[str, int]]:
  params = {"a": jnp.zeros((8, 4)), "b": jnp.zeros((4,))}
  grads = jax.tree.map(jnp.ones_like, params)
  rows = {}
  for name, (options, call) in CONFIGS.items():
    for fused in (False, True):
      inner, calls = counting(optax.adam(1e-3))
      tx = oa.accumulate(4, inner, **options)
      if fused:
        step = lambda g, s, p, tx=tx, call=call: oa.update_and_apply(tx, g, s, p, **call)
      else:
        def step(g: Any, s: Any, p: Any, tx: Any = tx, call: dict[str, Any] = call) -> Any:
          updates, s = tx.update(g, s, p, **call)
          return optax.apply_updates(p, updates), s
      functions, moves = walk(step, (grads, tx.init(params), params))
      rows[name + (" update_and_apply" if fused else "")] = {
          "functions": functions, "file_moves": moves, "inner_traces": calls["n"]}
  inner, calls = counting(optax.adam(1e-3))
  ms = oa.MultiSteps(inner, 4)
  functions, moves = walk(lambda g, s, p: ms.update(g, s, p), (grads, ms.init(params), params))
  rows["MultiSteps"] = {"functions": functions, "file_moves": moves, "inner_traces": calls["n"]}
  return rows


def compile_seconds(tx: Any, call: dict[str, Any], params: Any) -> float:
  grads = jax.tree.map(jnp.ones_like, params)

  def step(g: Any, s: Any, p: Any) -> Any:
    updates, s = tx.update(g, s, p, **call)
    return optax.apply_updates(p, updates), s

  start = time.perf_counter()
  jax.jit(step).lower(grads, tx.init(params), params).compile()
  return time.perf_counter() - start


def compile_ratios(leaves: int = 300, rounds: int = 2) -> tuple[float, dict[str, float]]:
  """Trace + compile over optax.MultiSteps', best of ``rounds``, interleaved."""
  best: dict[str, float] = {}
  for r in range(rounds):
    params = {f"l{i}": jnp.zeros((64, 64 + r)) for i in range(leaves)}
    ref = compile_seconds(optax.MultiSteps(optax.adam(1e-3), 4).gradient_transformation(), {},
                          params)
    best["optax"] = min(best.get("optax", float("inf")), ref)
    for name in ("mean", "weighted", "noise"):
      options, call = CONFIGS[name]
      ratio = compile_seconds(oa.accumulate(4, optax.adam(1e-3), **options), call, params) / ref
      best[name] = min(best.get(name, float("inf")), ratio)
  return best.pop("optax"), best


def markdown(result: dict[str, Any]) -> str:
  rows = result["paths"]
  lines = [
      "# One trace of an accumulating update",
      "",
      f"`python benchmarks/core_path.py` (jax {jax.__version__}, {jax.default_backend()}).",
      "",
      "| configuration | package functions | file moves | inner `update` traces |",
      "|---|---:|---:|---:|",
      *(f"| {name} | {r['functions']} | {r['file_moves']} | {r['inner_traces']} |"
        for name, r in rows.items()),
      "",
      f"Trace + compile over `optax.MultiSteps`' ({result['optax_s']:.2f} s), 300 leaves, best"
      " of 2: " + ", ".join(f"{k} {v:.2f}x" for k, v in result["compile_ratios"].items()) + ".",
      f"Top-level public names: {result['public_names']}. Named parameters of `microbatched`:"
      f" {result['microbatched_params']}"
      + (" (and a one-release `**deprecated` for its removed options)"
         if result["microbatched_catch_all"] else "") + ".",
      "",
      "| measure | now | goal |",
      "|---|---:|---:|",
      *(f"| {k} | {v} | {GOALS[k]} |" for k, v in result["summary"].items()),
  ]
  return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, default=None)
  parser.add_argument("--skip-compile", action="store_true", help="leave out the compile ratios")
  args = parser.parse_args(argv)
  rows = paths()
  optax_s, ratios = (0.0, {}) if args.skip_compile else compile_ratios()
  signature = inspect.signature(oa.microbatched).parameters.values()
  result = {
      "paths": rows, "optax_s": optax_s, "compile_ratios": ratios,
      "public_names": len(oa.__all__),
      "microbatched_params": sum(p.kind != p.VAR_KEYWORD for p in signature),
      "microbatched_catch_all": any(p.kind == p.VAR_KEYWORD for p in signature),
  }
  result["summary"] = {
      "functions (mean)": rows["mean"]["functions"],
      "functions (worst)": max(r["functions"] for r in rows.values()),
      "file moves (worst)": max(r["file_moves"] for r in rows.values()),
      "inner traces": max(r["inner_traces"] for r in rows.values()),
      "compile ratio": round(max(ratios.values(), default=0.0), 2),
      "public names": result["public_names"],
      "microbatched params": result["microbatched_params"],
  }
  if args.out is not None:
    harness.write(args.out, "core_path", result, markdown(result))
  else:
    print(markdown(result))
  return result


if __name__ == "__main__":
  main()
