"""Standalone reproductions of the accumulation designs discussed in NOTES.md.

Each ``make_<X>(k, inner)`` returns ``(init, update)`` with the optax protocol
``update(grads, state, params) -> (updates, state)``, ``state = (mini_step,
acc, inner_state)``, mean reduction. Only the placement of the buffer update
relative to the ``lax.cond`` differs:

* **A** -- ``acc + g`` outside the cond; the cond passes the new buffer
  through (mid) or zeroes it (emit) and returns it.
* **B** -- ``acc + g`` materialised once outside, read by the cond; the buffer
  is reset by a ``where(emit, 0, acc + g)`` select outside the cond.
* **D** -- the emitting branch recomputes ``acc + g`` from read-only operands;
  a select outside writes ``where(emit, 0, acc + g)`` into the buffer.
* **E** -- everything inside the branches: mid returns ``acc + g``, emit
  returns zeros for the buffer.
* **K** -- (shipped in 0.1.0 and 0.2.0; the core now adds inside a
  conditional, see NOTES.md) lazy reset: ``where(mini_step == 0, 0, acc) + g``
  outside, the cond only reads it; ``mini_step`` wraps to 0 on emit.

Run ``python benchmarks/variants.py`` to print, for 4M f32 params in 8 leaves
with adam and k=4, each design's compiled temporaries (state-first donation
convention, see NOTES.md), its count of parameter-sized ``copy`` ops (split
into copies of data and copies of a zero broadcast) and its mid-step time as a
ratio to the floor ``acc += g`` measured in the same process.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
from collections.abc import Callable
from typing import Any

import harness
import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_accum.debug import copies

Tree = Any
Update = Callable[[Tree, Any, Tree], tuple[Tree, Any]]


def _zeros(tree: Tree) -> Tree:
  return jax.tree.map(jnp.zeros_like, tree)


def _init(inner: optax.GradientTransformation) -> Callable[[Tree], Any]:
  def init(params: Tree) -> Any:
    return (jnp.zeros([], jnp.int32), _zeros(params), inner.init(params))
  return init


def _reduced(acc: Tree, k: int) -> Tree:
  return jax.tree.map(lambda a: a / k, acc)


def make_a(k: int, inner: optax.GradientTransformation) -> tuple[Callable, Update]:
  """A: sum outside, buffer passed through / zeroed inside the cond."""
  def update(grads, state, params):
    step, acc, inner_state = state
    new = jax.tree.map(jnp.add, acc, grads)
    count = step + 1

    def emit(new, s, p):
      u, s = inner.update(_reduced(new, k), s, p)
      return u, _zeros(new), s

    def mid(new, s, p):
      return _zeros(new), new, s

    u, acc, inner_state = lax.cond(count >= k, emit, mid, new, inner_state, params)
    return u, (jnp.where(count >= k, 0, count), acc, inner_state)
  return _init(inner), update


def make_b(k: int, inner: optax.GradientTransformation) -> tuple[Callable, Update]:
  """B: sum materialised once outside; select outside resets the buffer."""
  def update(grads, state, params):
    step, acc, inner_state = state
    new = jax.tree.map(jnp.add, acc, grads)
    count = step + 1
    emit_now = count >= k

    def emit(new, s, p):
      return inner.update(_reduced(new, k), s, p)

    def mid(new, s, p):
      return _zeros(new), s

    u, inner_state = lax.cond(emit_now, emit, mid, new, inner_state, params)
    acc = jax.tree.map(lambda a: jnp.where(emit_now, jnp.zeros((), a.dtype), a), new)
    return u, (jnp.where(emit_now, 0, count), acc, inner_state)
  return _init(inner), update


def make_d(k: int, inner: optax.GradientTransformation) -> tuple[Callable, Update]:
  """D: the emitting branch recomputes the sum; a select outside writes the buffer."""
  def update(grads, state, params):
    step, acc, inner_state = state
    count = step + 1
    emit_now = count >= k

    def emit(acc, g, s, p):
      return inner.update(_reduced(jax.tree.map(jnp.add, acc, g), k), s, p)

    def mid(acc, g, s, p):
      return _zeros(acc), s

    u, inner_state = lax.cond(emit_now, emit, mid, acc, grads, inner_state, params)
    new = jax.tree.map(
        lambda a, g: jnp.where(emit_now, jnp.zeros((), a.dtype), a + g), acc, grads)
    return u, (jnp.where(emit_now, 0, count), new, inner_state)
  return _init(inner), update


def make_e(k: int, inner: optax.GradientTransformation) -> tuple[Callable, Update]:
  """E: everything inside the branches."""
  def update(grads, state, params):
    step, acc, inner_state = state
    count = step + 1

    def emit(acc, g, s, p):
      u, s = inner.update(_reduced(jax.tree.map(jnp.add, acc, g), k), s, p)
      return u, _zeros(acc), s

    def mid(acc, g, s, p):
      return _zeros(acc), jax.tree.map(jnp.add, acc, g), s

    u, acc, inner_state = lax.cond(count >= k, emit, mid, acc, grads, inner_state, params)
    return u, (jnp.where(count >= k, 0, count), acc, inner_state)
  return _init(inner), update


def make_k(k: int, inner: optax.GradientTransformation) -> tuple[Callable, Update]:
  """K (0.1.0 and 0.2.0): lazy reset outside, the cond only reads the buffer."""
  def update(grads, state, params):
    step, acc, inner_state = state
    new = jax.tree.map(
        lambda a, g: jnp.where(step == 0, jnp.zeros((), a.dtype), a) + g, acc, grads)
    count = step + 1

    def emit(new, s, p):
      return inner.update(_reduced(new, k), s, p)

    def mid(new, s, p):
      return _zeros(new), s

    u, inner_state = lax.cond(count >= k, emit, mid, new, inner_state, params)
    return u, (jnp.where(count >= k, 0, count), new, inner_state)
  return _init(inner), update


VARIANTS: dict[str, Callable[[int, optax.GradientTransformation], tuple[Callable, Update]]] = {
    "A": make_a, "B": make_b, "D": make_d, "E": make_e, "K": make_k,
}


def copy_sites(hlo_text: str, min_elems: int) -> list[tuple[str, str]]:
  """``(computation, kind)`` of each ``copy`` of an array of >= ``min_elems``.

  Read with :func:`optax_accum.debug.copies`. ``kind`` is ``"fill"`` for a
  copy of a broadcast or of constants (XLA CSEs identical zero trees into one
  broadcast, then copies it into each distinct output buffer: that is the
  zero-writing itself, present in the floor too) and ``"data"`` for a copy of
  anything else (a parameter, the buffer, the optimizer state): the copies a
  design must avoid. The computation is ``"ENTRY"`` for a copy on the entry's
  straight-line path, else the name of the ``lax.cond`` branch (``region_*``).
  """
  return [
      ("ENTRY" if not c.context else c.computation, "fill" if c.fill else "data")
      for c in copies(hlo_text) if math.prod(c.shape) >= min_elems
  ]


def count_copies(hlo_text: str, min_elems: int) -> dict[str, int]:
  """``{"data": n, "fill": m}``: counts of :func:`copy_sites` by kind."""
  sites = copy_sites(hlo_text, min_elems)
  return {kind: sum(1 for _, k in sites if k == kind) for kind in ("data", "fill")}


def describe_sites(hlo_text: str, min_elems: int) -> str:
  """E.g. ``"8 data in ENTRY, 7 fill in region_0.2"``."""
  tally: dict[tuple[str, str], int] = {}
  for site in copy_sites(hlo_text, min_elems):
    tally[site] = tally.get(site, 0) + 1
  return ", ".join(f"{n} {kind} in {comp}" for (comp, kind), n in sorted(tally.items())) or "none"


def _tree(n_params: int, leaves: int) -> dict[str, jax.Array]:
  return {f"w{i}": jnp.full((n_params // leaves,), 0.01 * (i + 1), jnp.float32)
          for i in range(leaves)}


def main() -> None:
  """Prints temps, copies and mid-step time ratio to the floor per design."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--params", type=float, default=4.0, help="millions of f32 params")
  ap.add_argument("--rounds", type=int, default=31)
  ap.add_argument("--reps", type=int, default=4, help="calls per timed sample")
  args = ap.parse_args()
  n = int(args.params * 2**20)
  leaves = 8
  params = _tree(n, leaves)
  grads = jax.tree.map(lambda x: x * 0.5, params)
  pbytes = n * 4
  inner = optax.adam(1e-3)
  k_mid = 1 << 30  # stay mid-window: time mid-steps

  runners: dict[str, Callable[[], None]] = {}

  floor_fn = jax.jit(lambda acc, g: (jax.tree.map(jnp.add, acc, g), _zeros(g)),
                     donate_argnums=(0,))
  floor_c = floor_fn.lower(_zeros(params), grads).compile()
  floor_state = [_zeros(params)]

  def run_floor() -> None:
    floor_state[0], _ = floor_c(floor_state[0], grads)
    jax.block_until_ready(floor_state[0])

  runners["floor"] = run_floor
  print(f"{'design':8s} {'temps/params':>12s}  param-sized copies (where)")
  print(f"{'floor':8s} {floor_c.memory_analysis().temp_size_in_bytes / pbytes:12.3f}"
        f"  {describe_sites(floor_c.as_text(), n // leaves)}")
  for name, make in VARIANTS.items():
    init, update = make(k_mid, inner)
    fn = jax.jit(lambda s, g, p, update=update: update(g, s, p)[::-1], donate_argnums=(0,))
    comp = fn.lower(init(params), grads, params).compile()
    temps = comp.memory_analysis().temp_size_in_bytes / pbytes
    print(f"{name:8s} {temps:12.3f}  {describe_sites(comp.as_text(), n // leaves)}")
    holder = [init(params)]

    def run(comp=comp, holder=holder) -> None:
      holder[0], _ = comp(holder[0], grads, params)
      jax.block_until_ready(holder[0])

    runners[name] = run
  for run in runners.values():  # warm up
    run()

  def repeat(run: Callable[[], None]) -> None:
    for _ in range(args.reps):
      run()

  # harness.interleaved: a random order per round (no fixed neighbour bias).
  secs = harness.interleaved({name: functools.partial(repeat, run)
                              for name, run in runners.items()}, args.rounds, warmup=0)
  samples = {name: [s / args.reps for s in ss] for name, ss in secs.items()}
  names = list(runners)
  floor = samples["floor"]
  print(f"\nmid-step time / floor (median over {args.rounds} interleaved rounds of the"
        f" per-round ratio; floor median {statistics.median(floor) * 1e3:.2f} ms)")
  for name in names:
    print(f"  {name:6s} {harness.paired_ratio(samples[name], floor):5.2f}x")


if __name__ == "__main__":
  main()
