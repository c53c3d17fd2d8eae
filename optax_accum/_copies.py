"""Values that differ per device, outside ``shard_map``: one copy per device, stacked.

Under plain jit with ``axis_name`` a device's partial sum of the gradient (from
``local_value_and_grad``) and the accumulation buffer are ordinary arrays with
one copy per device stacked along a leading axis sharded over the data axes
(:func:`zeros`, :func:`stack`): every device holds its own slice, nothing moves
until :func:`total` sums them, and the host can read, save and restore them as
any other array.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from optax_accum import _arrays


def zeros(shape: tuple[int, ...], dtype: Any, spec: PartitionSpec, axes: tuple[Any, ...]
          ) -> jax.Array:
  """Zeros, one copy of ``shape`` per device: ``(device_count(axes), *shape)``.

  The copies of an array laid out as ``spec`` lie along a leading axis over the data
  ``axes``; each copy's own dims keep their sharding over the other mesh axes and are
  whole over ``axes``. Copies of size 0 are replicated instead: they hold nothing, and
  JAX 0.10 cannot read a sharded array of size 0 back to the host (each shard reports
  the global shape: ``np.asarray`` raises). (A JAX 0.10 workaround: drop with the floor.)
  """
  layout = PartitionSpec(_arrays.spec_entry(axes), *_arrays.strip_axes(spec.partitions, axes))
  return jnp.zeros((_arrays.device_count(axes), *shape), dtype,
                   out_sharding=layout if math.prod(shape) else PartitionSpec())


def stack(x: jax.Array, axes: tuple[Any, ...]) -> jax.Array:
  """A partial sum typed unreduced over ``axes`` as its per-device copies, stacked.

  No data moves: inside a ``shard_map`` manual over every mesh axis, each
  device's block of an unreduced input is its own partial sum, and returned
  with a leading axis of 1 it is that device's slice of an ordinary array.
  (JAX 0.10 has no cast from unreduced to device-varying, so the body runs
  unchecked, ``check_vma=False``: a workaround to drop with the floor.) Copies
  already stacked are returned as they are; of size 0, laid out as
  :func:`zeros` lays them out.
  """
  array_type = _arrays.array_type(x)
  if x.size == 0:  # laid out as `zeros` lays out copies of size 0
    return zeros(x.shape if array_type.unreduced else x.shape[1:], x.dtype, PartitionSpec(), axes)
  if not array_type.unreduced:
    return x
  parts = array_type.spec.partitions
  return jax.shard_map(
      lambda block: block[None], mesh=jax.sharding.get_abstract_mesh(),
      in_specs=PartitionSpec(*parts, unreduced=set(axes)),
      out_specs=PartitionSpec(_arrays.spec_entry(axes), *parts), check_vma=False)(x)


def total(x: jax.Array, spec: PartitionSpec) -> jax.Array:
  """The sum of the per-device copies ``x`` (stacked along dim 0), laid out as ``spec``.

  An all-reduce over the devices, or a reduce-scatter where ``spec`` shards
  the result over them (FSDP): the one cross-device step.
  """
  return jax.reshard(jnp.sum(x, axis=0, dtype=x.dtype), spec)


def each_device(fn: Callable[[Any], jax.Array], tree: Any, empty: jax.Array) -> jax.Array:
  """``fn`` of each device's copies in ``tree``: one value per device; only they cross devices.

  (Copies of size 0 add nothing; laid out apart, they would not batch with the
  others.) ``empty`` where no copy holds anything.
  """
  leaves = [x for x in jax.tree.leaves(tree) if x.size]
  return jax.vmap(fn)(leaves) if leaves else empty


def param_layout(stacked: Any, params: Any) -> Any:
  """The spec of each param, or (``params`` None) of one copy in ``stacked``."""
  if params is None:
    return jax.tree.map(lambda x: PartitionSpec(*_arrays.array_type(x).spec[1:]), stacked)
  return jax.tree.map(lambda p: _arrays.array_type(p).spec, params)
