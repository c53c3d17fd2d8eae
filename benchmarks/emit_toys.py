"""What an emitting step costs on this backend, in toys (benchmarks/NOTES.md).

Train steps on 4M f32 params in 8 leaves with Adam, params, state and a
parameter-sized buffer donated, timed in interleaved rounds
(``harness.interleaved``: a fresh seeded random order per round); each ratio
is the median over rounds of the time over the plain Adam step's in the same
round.

* ``plain``: ``adam.update`` + ``apply_updates`` (10P on XLA:CPU, whose Adam
  is three loops per leaf; 7P where it is one fused kernel);
* ``in_cond``: the same inside a ``lax.cond`` kept by a scalar barrier (does
  a conditional cost anything by itself?);
* ``updates_in_buffer``: Adam in a conditional writing the updates into the
  donated buffer, ``p + where(c, buffer, 0)`` outside (the protocol path's
  round trip through memory, without the window sum): 12P;
* ``updates_in_buffer_no_select``: the same with ``p + buffer``;
* ``window_sum``: Adam on ``(buffer + g) / 4``, applied, no conditional (the
  work of an ``update_and_apply`` emit: 12P on XLA:CPU, both moment loops
  read the buffer and the micro-batch);
* ``window_sum_materialised``: the same with the sum computed once into a
  temporary (``optimization_barrier``) that both moment loops read (13P).

Run: ``python benchmarks/emit_toys.py`` (about 20 s); ``taskset -c 0`` in
front for one core.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

import harness
import jax
import jax.numpy as jnp
import optax
from jax import lax

LEAVES = 8
OPT = optax.adam(1e-3)


def plain(p: Any, s: Any, b: Any, g: Any, c: jax.Array) -> tuple[Any, Any, Any]:
  u, s = OPT.update(g, s, p)
  return optax.apply_updates(p, u), s, b


def in_cond(p: Any, s: Any, b: Any, g: Any, c: jax.Array) -> tuple[Any, Any, Any]:
  def step(ops: tuple[Any, Any]) -> tuple[Any, Any]:
    p, s = ops
    one = lax.optimization_barrier(jnp.float32(1.0))
    u, s = OPT.update(jax.tree.map(lambda x: x * one, g), s, p)
    return optax.apply_updates(p, u), s

  p, s = lax.cond(c > 0, step, lambda ops: ops, (p, s))
  return p, s, b


def _updates_in_buffer(select: bool) -> Callable[..., tuple[Any, Any, Any]]:
  def fn(p: Any, s: Any, b: Any, g: Any, c: jax.Array) -> tuple[Any, Any, Any]:
    def step(ops: tuple[Any, Any]) -> tuple[Any, Any]:
      s, _ = ops
      one = lax.optimization_barrier(jnp.float32(1.0))
      u, s = OPT.update(jax.tree.map(lambda x: x * one, g), s, p)
      return s, u

    s, b = lax.cond(c > 0, step, lambda ops: ops, (s, b))
    read = (lambda u: jnp.where(c > 0, u, 0.0)) if select else (lambda u: u)
    return jax.tree.map(lambda x, u: x + read(u), p, b), s, b
  return fn


def _window_sum(materialise: bool) -> Callable[..., tuple[Any, Any, Any]]:
  def fn(p: Any, s: Any, b: Any, g: Any, c: jax.Array) -> tuple[Any, Any, Any]:
    window = jax.tree.map(lambda a, x: (a + x) * 0.25, b, g)
    if materialise:
      window = lax.optimization_barrier(window)
    u, s = OPT.update(window, s, p)
    return optax.apply_updates(p, u), s, b
  return fn


TOYS: dict[str, Callable[..., tuple[Any, Any, Any]]] = {
    "plain": plain,
    "in_cond": in_cond,
    "updates_in_buffer": _updates_in_buffer(True),
    "updates_in_buffer_no_select": _updates_in_buffer(False),
    "window_sum": _window_sum(False),
    "window_sum_materialised": _window_sum(True),
}


def main(argv: list[str] | None = None) -> dict[str, float]:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--params", type=int, default=4 * 2**20)
  ap.add_argument("--rounds", type=int, default=50)
  args = ap.parse_args(argv)
  shape = (args.params // LEAVES,)
  tree = lambda v: [jnp.full(shape, v, jnp.float32) for _ in range(LEAVES)]
  grads, on = tree(1e-3), jnp.int32(1)
  fns = {k: jax.jit(f, donate_argnums=(0, 1, 2)) for k, f in TOYS.items()}
  states = {k: (tree(0.01), OPT.init(tree(0.0)), tree(0.0)) for k in fns}

  def step(k: str) -> None:
    states[k] = jax.block_until_ready(fns[k](*states[k], grads, on))

  # harness.interleaved; its warm-up round compiles.
  times = harness.interleaved({k: functools.partial(step, k) for k in fns}, args.rounds)
  ratios = {k: harness.paired_ratio(t, times["plain"]) for k, t in times.items()}
  print(f"| toy ({args.params} params, {jax.default_backend()}) | ms | x plain Adam |")
  print("|---|---:|---:|")
  for k, t in times.items():
    print(f"| {k} | {harness.median(t) * 1e3:.2f} | {ratios[k]:.2f}x |")
  return ratios


if __name__ == "__main__":
  main()
