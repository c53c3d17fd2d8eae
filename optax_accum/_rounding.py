"""Stochastic rounding: a float32 value into a 16-bit float without bias.

Rounding to nearest stalls a narrow running sum: once the sum is large, each
small addend rounds away (a bfloat16 sum of 1,024 ones is 256). Rounding
*stochastically*, up with probability equal to the distance from the value
below (in units of the gap between the two neighbours), makes every rounding
unbiased: ``E[round(x)] = x``, so the sum's error stays a zero-mean random
walk.

The random bits come from a counter-based hash of the element's index and a
few counters (the window's step counts, the leaf, the device), not from a
PRNG key: reruns and checkpoints resume bit for bit, no state is added, and
the bits are made where they are used, element by element.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def _mix(x: jax.Array) -> jax.Array:
  """A 32-bit integer hash with full avalanche (Wellons' lowbias32)."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def random_bits(shape: tuple[int, ...], counters: list[Any], out_sharding: Any = None
                ) -> jax.Array:
  """Uniform random uint32 values, one per element of ``shape``.

  A hash of each element's row-major index and ``counters`` (ints or int
  scalars): the same counters give the same bits, any change in one gives
  independent ones.
  """
  key = jnp.uint32(0x9E3779B9)
  for c in counters:
    key = _mix(key ^ jnp.asarray(c).astype(jnp.uint32))
  index = jnp.zeros(shape, jnp.uint32, out_sharding=out_sharding)
  stride = 1
  for dim in reversed(range(len(shape))):
    index = index + lax.broadcasted_iota(jnp.uint32, shape, dim, out_sharding=out_sharding) * (
        jnp.uint32(stride % 2**32))
    stride *= shape[dim]
  return _mix(index ^ key)


def round_stochastic(x: jax.Array, dtype: Any, bits: jax.Array) -> jax.Array:
  """``x`` (float32) in ``dtype``, rounded up or down without bias.

  ``bits`` holds uniform random uint32 values, one per element. ``x`` goes to
  the neighbour above or below it in ``dtype`` with probability equal to how
  close it is to that neighbour (in units of the gap between them), so
  ``E[result] = x``. Values ``dtype`` represents exactly, infinities and NaN
  are kept as they are.
  """
  if jnp.dtype(dtype) == jnp.bfloat16:
    # bfloat16 is float32's top half: adding 16 random bits to the bottom half
    # carries into the top with exactly that probability; then truncate.
    raised = lax.bitcast_convert_type(x, jnp.uint32) + (bits >> 16)
    rounded = lax.bitcast_convert_type(raised & jnp.uint32(0xFFFF0000), jnp.float32)
    return jnp.where(jnp.isnan(x), x, rounded).astype(dtype)
  # The barrier keeps the round trip: XLA's GPU compiler removes a float32 -> float16 ->
  # float32 chain (SimplifyFPConversions, excess precision allowed), so near32 became x and
  # nothing rounded stochastically. Shown by tests/test_narrow_buffer.py's float16 cases on
  # a GPU (benchmarks/results/gpu.md) and by the H200 compiler's program
  # (docs/development/compiler_evidence.md, "float16 stochastic rounding").
  nearest = lax.optimization_barrier(x.astype(dtype))
  near32 = nearest.astype(jnp.float32)
  other = jnp.nextafter(nearest, jnp.where(near32 > x, -jnp.inf, jnp.inf).astype(dtype))
  gap = jnp.abs(other.astype(jnp.float32) - near32)
  u = (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)  # uniform in [0, 1)
  take_other = jnp.logical_and(u * gap < jnp.abs(x - near32), jnp.isfinite(x))
  return jnp.where(take_other, other, nearest)
