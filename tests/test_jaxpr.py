"""The one jaxpr interpreter (``optax_accum._jaxpr``) and the walks that are tables over it.

The descent is pinned kind by kind (a call, ``jax.checkpoint``, a custom rule, ``scan``,
``while``, ``cond``) on the JAX this runs on; then each walk is shown to follow what it
must through the inner jaxprs: the rows walk a max over the rows inside a call, the key
walk a key a ``while`` loop's body draws per row from.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import optax_accum as oa
from optax_accum import _jaxpr


def computed_from(fn, *names):
  """Which of ``fn``'s inputs (named ``names``) each of its outputs is computed from."""

  def rule(ctx, eqn, ins):
    return _jaxpr.descend(eqn, ins, walk, lambda values: frozenset().union(*values))

  rules = _jaxpr.Rules({}, rule, lambda literal: frozenset())

  def walk(jaxpr, ins):
    return _jaxpr.interpret(rules, jaxpr, [frozenset()] * len(jaxpr.constvars), ins)

  closed = jax.make_jaxpr(fn)(*(jnp.float32(i + 1) for i in range(len(names))))
  return ["".join(sorted(s)) for s in walk(closed.jaxpr, [frozenset(n) for n in names])]


def test_descend_maps_each_operand_to_the_jaxprs_it_feeds():
  def f(x, y, z, n):
    loop = lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1.0, c[1] + y), (0.0, z))[1]
    carry, ys = lax.scan(lambda c, t: (c + t, c * y), x, jnp.stack([z, z]))
    return (
      jax.checkpoint(lambda a: a * 2)(x),
      jax.jit(jax.nn.relu)(y),
      loop,
      carry,
      ys,
      lax.cond(n > 0, lambda: x, lambda: z),
    )

  # A while's condition constants (n) feed no output, a cond's index neither; a scan's
  # body is walked once (its ys see the carry on entry, x).
  assert computed_from(f, "x", "y", "z", "n") == ["x", "y", "yz", "xz", "xy", "xz"]


def test_the_rows_walk_follows_a_call():
  """A max over the rows inside ``jax.jit`` is found, as outside it."""

  def loss(w, x, stats):
    return jnp.sum((x @ w) ** 2) / stats["n"]

  most = lambda w, x: {"n": jax.jit(lambda x: jnp.max(jnp.abs(x).sum(1)))(x)}
  fn = oa.microbatched(jax.value_and_grad(loss), 2, normalize="sum", global_stats=most)
  with pytest.raises(ValueError, match=r"statistic at \['n'\] is a max over the rows"):
    fn(jnp.ones(3), jnp.ones((8, 3)))
