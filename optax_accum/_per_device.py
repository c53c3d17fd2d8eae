"""Run a function once per device, on that device's rows of the batch.

The one mechanism behind :func:`~optax_accum.sharding.local_value_and_grad`,
:func:`~optax_accum.microbatching.microbatched` and
:func:`~optax_accum.cached_microbatched` under plain ``jax.jit``: :func:`run`, a
``shard_map`` over the data axes of the current mesh. The batch arguments are
split along their leading dim; every other argument is given whole to every
device and marked device-varying, so that a gradient taken inside with respect
to it is the device's own, unreduced (for a replicated input, ``shard_map``'s
autodiff would sum it over the devices on every call). Where gradients reduced
per device go back to: :func:`scatter_dim`. Which rows and axes: ``_batch``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from optax_accum import _arrays


def make_varying(tree: Any, axes: tuple[Any, ...]) -> Any:
  """``tree``'s array leaves marked device-varying over ``axes`` (a no-op outside shard_map)."""
  return jax.tree.map(lambda x: _arrays.pcast_varying(x, axes)
                      if isinstance(x, (jax.Array, np.ndarray)) else x, tree)


def run(body: Callable[..., Any], args: Sequence[Any], batch_argnums: tuple[int, ...],
        axes: tuple[Any, ...], out_specs: Any, *, manual: tuple[Any, ...] | None = None) -> Any:
  """``body(*args)`` on every device, given its rows of the batch arguments.

  A ``shard_map`` over the data ``axes`` of the current mesh, manual over
  ``manual`` (default: ``axes`` alone, so that ``body`` keeps the explicit
  sharding of the other axes). The arguments at ``batch_argnums`` are split
  over ``axes`` along their leading dim; the array leaves of the others are
  made whole over ``axes`` (params sharded over them, FSDP: one all-gather
  per call) and device-varying, so gradients taken in ``body`` stay
  unreduced. Non-array leaves (an Equinox module's activation function)
  pass through as they are. ``out_specs`` are ``shard_map``'s.
  """
  leaves = _arrays.ArrayLeaves.of(tuple(args))
  is_batch = [path[0].idx in batch_argnums for path in leaves.paths]  # path[0]: the argnum
  rows = PartitionSpec(_arrays.spec_entry(axes))
  in_specs = tuple(rows if batch else PartitionSpec() for batch in is_batch)

  def per_device(*arrays: Any) -> Any:
    return body(*leaves.rebuild([x if batch else make_varying(x, axes)
                                 for x, batch in zip(arrays, is_batch, strict=True)]))

  arrays = list(leaves.arrays)
  for i, x in enumerate(arrays):
    # shard_map wants its inputs typed as in_specs say: a non-batch array whose type shards
    # it over `axes` (FSDP) is all-gathered; one over none of them (replicated, or Auto
    # axes, which the partitioner handles) moves nothing.
    spec = _arrays.array_type(x).spec
    if not is_batch[i] and any(e and set(_arrays.axis_names(e)) & set(axes) for e in spec):
      arrays[i] = jax.reshard(x, PartitionSpec(*_arrays.strip_axes(tuple(spec), axes)))
  return jax.shard_map(per_device, mesh=jax.sharding.get_abstract_mesh(), in_specs=in_specs,
                       out_specs=out_specs, axis_names=set(manual or axes))(*arrays)


def scatter_dim(spec: PartitionSpec, axes: tuple[Any, ...]) -> tuple[int, Any] | None:
  """``(dim, names)`` if ``spec`` shards one dim over exactly the data axes, else None.

  A gradient of such a param is reduce-scattered onto it. Only when no other
  dim is sharded: jax 0.10's ``psum_scatter`` fails to lower an operand that
  is also sharded over an Explicit axis inside a partial-manual
  ``shard_map`` (a workaround to drop with the floor). Such a gradient is
  all-reduced, then sliced.
  """
  entries = [() if e is None else _arrays.axis_names(e) for e in spec]
  hits = [dim for dim, names in enumerate(entries) if set(names) == set(axes)]
  if len(hits) != 1 or sum(bool(names) for names in entries) != 1:
    return None
  return hits[0], entries[hits[0]]
