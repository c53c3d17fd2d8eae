"""Run a function once per device, on that device's rows of the batch.

The one mechanism behind :func:`~optax_accum.sharding.local_value_and_grad`
and :func:`~optax_accum.microbatching.microbatched` under plain ``jax.jit``:
:func:`run`, a ``shard_map`` over the data axes of the current mesh. The
batch arguments are split along their leading dim; every other argument is
given whole to every device and marked device-varying, so that a gradient
taken inside with respect to it is the device's own, unreduced (for a
replicated input, ``shard_map``'s autodiff would sum it over the devices on
every call). Around it: the batch's rows and which axes they are split over
(:func:`batch_rows`, :func:`data_axes`), and where gradients reduced per
device go back to (:func:`scatter_dim`).

Outside ``shard_map`` a value that differs per device (a device's partial sum
of the gradient, the accumulation buffer of ``accumulate(..., axis_name=...)``
under plain jit) is an ordinary array with one copy per device stacked along a
leading axis sharded over the data axes (:func:`zeros`, :func:`stack`,
:func:`total`): every device holds its own slice, nothing moves until
:func:`total` sums them, and the host can read, save and restore it as any
other array.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from optax_accum import _arrays, gradient_noise, precision

# The per-device leaves of a state: each device's partial sums of the open window. The one
# list that `init`, `per_device_state`, `shard_map_specs`, `reshard_state` and the checks read.
STATE = ("acc_grads", "acc_weight", "noise_stats.window_sq_norms", "noise_stats.window_count")


def map_state(fn: Callable[[Any], Any], state: Any, *, skip: tuple[str, ...] = ()) -> Any:
  """``state`` with ``fn`` applied to every leaf of its per-device fields (:data:`STATE`).

  ``state`` is a NamedTuple with such fields (``_window.Window``,
  ``AccumulateState``, ``optax.MultiStepsState``); those it lacks, or holds as
  ``()`` (no noise estimate), and those in ``skip`` are passed over.
  """
  for name in STATE:
    head, _, field = name.partition(".")
    node = getattr(state, head, None)
    if name in skip or node is None or (field and not hasattr(node, field)):
      continue
    new = jax.tree.map(fn, getattr(node, field) if field else node)
    state = state._replace(**{head: node._replace(**{field: new}) if field else new})
  return state


class _Marked:
  """A marker leaf: a per-device leaf of a state, found with its key path."""

  def __init__(self, leaf: Any):
    self.leaf = leaf


def state_leaves(state: Any, *, skip: tuple[str, ...] = ()) -> list[tuple[Any, Any]]:
  """``[(key path, leaf)]`` of the per-device leaves of ``state``, as :func:`map_state` maps."""
  marked = jax.tree_util.tree_flatten_with_path(map_state(_Marked, state, skip=skip))[0]
  return [(path, x.leaf) for path, x in marked if isinstance(x, _Marked)]


def spec_entry(axes: tuple[Any, ...]) -> Any:
  """Mesh axes as one entry of a ``PartitionSpec``: a name, or a tuple of names."""
  return axes[0] if len(axes) == 1 else axes


def stacked_spec(spec: PartitionSpec, axes: tuple[Any, ...]) -> PartitionSpec:
  """The layout of one copy per device of an array laid out as ``spec``.

  A leading axis over the data ``axes``; the copy's own dims keep their
  sharding over the other mesh axes and are whole over ``axes``.
  """
  return PartitionSpec(spec_entry(axes), *_arrays.strip_axes(spec.partitions, axes))


def device_count(axes: tuple[Any, ...]) -> int:
  """The number of devices along the data ``axes`` of the current mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  return math.prod(mesh.shape[a] for a in axes)


def zeros(shape: tuple[int, ...], dtype: Any, spec: PartitionSpec, axes: tuple[Any, ...]
          ) -> jax.Array:
  """Zeros, one copy of ``shape`` per device: ``(device_count(axes), *shape)``.

  Copies of size 0 are replicated instead: they hold nothing, and JAX 0.10
  cannot read a sharded array of size 0 back to the host (each shard reports
  the global shape: ``np.asarray`` raises).
  """
  layout = stacked_spec(spec, axes) if math.prod(shape) else PartitionSpec()
  return jnp.zeros((device_count(axes), *shape), dtype, out_sharding=layout)


def stack(x: jax.Array, axes: tuple[Any, ...]) -> jax.Array:
  """A partial sum typed unreduced over ``axes`` as its per-device copies, stacked.

  No data moves: inside a ``shard_map`` manual over every mesh axis, each
  device's block of an unreduced input is its own partial sum, and returned
  with a leading axis of 1 it is that device's slice of an ordinary array.
  (JAX 0.10 has no cast from unreduced to device-varying, so the body runs
  unchecked, ``check_vma=False``.) Copies already stacked are returned as
  they are; of size 0, laid out as :func:`zeros` lays them out.
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
      out_specs=PartitionSpec(spec_entry(axes), *parts), check_vma=False)(x)


def total(x: jax.Array, spec: PartitionSpec) -> jax.Array:
  """The sum of the per-device copies ``x`` (stacked along dim 0), laid out as ``spec``.

  An all-reduce over the devices, or a reduce-scatter where ``spec`` shards
  the result over them (FSDP): the one cross-device step.
  """
  return jax.reshard(jnp.sum(x, axis=0, dtype=x.dtype), spec)


def sq_norms(tree: Any) -> jax.Array:
  """Each device's squared norm of its copies in ``tree``: a float32 vector, one per device."""
  # (Copies of size 0 add nothing; laid out apart, they would not batch with the others.)
  leaves = [x for x in jax.tree.leaves(tree) if x.size]
  return jax.vmap(gradient_noise.sq_norm)(leaves) if leaves else jnp.zeros([], jnp.float32)


def all_finite(tree: Any) -> jax.Array:
  """Whether every copy in ``tree`` is free of NaN and Inf: one scalar crosses devices.

  Each device tests its own copies (``precision.all_finite``); only the
  devices' answers are reduced.
  """
  leaves = [x for x in jax.tree.leaves(tree) if x.size]
  return jnp.all(jax.vmap(precision.all_finite)(leaves)) if leaves else jnp.asarray(True)


def param_layout(stacked: Any, params: Any) -> Any:
  """The spec of each param, or (``params`` None) of one copy in ``stacked``."""
  if params is None:
    return jax.tree.map(lambda x: PartitionSpec(*_arrays.array_type(x).spec[1:]), stacked)
  return jax.tree.map(lambda p: _arrays.array_type(p).spec, params)


def micro_batch_sq_norms(grads: Any, weight: jax.Array | None) -> tuple[jax.Array, Any]:
  """Each device's micro-batch, for the noise estimate: its mean gradient's squared norm, weight.

  A device's copy in ``grads`` is its share of the mean over every device's
  rows, ``1 / n`` of its own micro-batch's mean (``n`` devices), and it
  holds ``1 / n`` of the weight, as when the devices' micro-batches are alike.
  """
  n = jax.tree.leaves(grads)[0].shape[0]
  return sq_norms(grads) * n**2, None if weight is None else weight / n


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
  rows = PartitionSpec(spec_entry(axes))
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


def batch_rows(batches: dict[int, Any]) -> tuple[int, tuple[Any, ...]]:
  """The batch's rows: their number, and the mesh axes they are split over per its type.

  Both must be the same for every leaf of the batch arguments ``batches``
  (argnum -> pytree); ``()`` when the type shows no split.
  """
  first = None
  for argnum, tree in batches.items():
    found = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not found:
      raise ValueError(
          f"The batch argument {argnum} of `fn` has no array leaves, so it"
          " cannot be split. Pass a pytree of arrays with a leading batch"
          " dimension, or fix `batch_argnums`."
      )
    for path, leaf in found:
      where = f"argument {argnum}{jax.tree_util.keystr(path)}"
      if jnp.ndim(leaf) == 0:
        raise ValueError(
            f"The batch leaf at {where} is a scalar; every batch leaf needs a"
            " leading batch dimension. Add one, or pass this value outside the"
            " batch (it is then given to every micro-batch unchanged)."
        )
      lead = (*_arrays.array_type(leaf).spec, None)[0]  # the leading dim's entry, if any
      s, a = int(jnp.shape(leaf)[0]), _arrays.axis_names(lead) if lead else ()
      if first is None:
        first, size, axes = where, s, a
      if s != size:
        raise ValueError(
            f"The batch leaves disagree on the batch size: {first} has"
            f" {size} rows but {where} has {s}. Every batch leaf must share its"
            " leading dimension."
        )
      if a != axes:
        raise ValueError(
            f"The batch leaves are split differently over the mesh: {first} has its"
            f" leading dim sharded over {axes or 'no axis'} but {where} over"
            f" {a or 'no axis'}. Place every batch leaf the same way, e.g."
            f" jax.device_put(batch, P({spec_entry(axes or a)!r})).")
  return size, axes


def data_axes(axis_name: Any, split: tuple[Any, ...], args: tuple[Any, ...],
              batch_argnums: tuple[int, ...]) -> tuple[Any, ...] | None:
  """The mesh axes to run per device over, given ``split``, those the batch's type shows.

  Explicit axes are read from the batch's type; Auto ones must be named by
  ``axis_name``. None to run as written: on one device, or inside
  ``shard_map``/``pmap`` (``axis_name`` naming their axes).
  """
  if axis_name is None:
    if not split:
      _check_no_hidden_split(args, batch_argnums)
    return split or None
  named = _arrays.axis_names(axis_name)
  kinds = _arrays.axis_kinds(jax.sharding.get_abstract_mesh(), named)
  if kinds is None or kinds == {"Manual"}:  # inside shard_map, or pmap
    if split:
      raise ValueError(
          f"The batch is sharded over the Explicit mesh axes {split} while"
          f" `axis_name={axis_name!r}` names shard_map/pmap axes: both would"
          f" split it. Drop `axis_name` (microbatched reads the split from the"
          " batch's type), or replicate the batch over the Explicit axes.")
    return None
  if len(kinds) > 1 or (split and set(split) != set(named)):
    raise ValueError(
        f"`axis_name={axis_name!r}` names mesh axes of kinds {sorted(kinds)}"
        f" and the batch's type shows it sharded over {split or 'no Explicit axis'}."
        " Name the axes the batch is split over, all of one kind: Explicit ones"
        " (then `axis_name` may be dropped) or Auto ones.")
  return named


def _check_no_hidden_split(args: tuple[Any, ...], batch_argnums: tuple[int, ...]) -> None:
  """Raises on a mesh that mixes Auto and Explicit axes with params in explicit types.

  An Auto axis does not appear in the batch's type: a batch split over it
  would go undetected, and the partitioner would reduce the gradients on
  every micro-batch.
  """
  mesh = jax.sharding.get_abstract_mesh()
  auto = tuple(n for n in mesh.axis_names if _arrays.axis_kinds(mesh, (n,)) == {"Auto"})
  if not auto or "Explicit" not in (_arrays.axis_kinds(mesh, mesh.axis_names) or ()):
    return
  for i, arg in enumerate(args):
    if i not in batch_argnums and any(
        isinstance(x, (jax.Array, np.ndarray)) and any(_arrays.array_type(x).spec)
        for x in jax.tree.leaves(arg)):
      raise ValueError(
          f"The mesh mixes Auto axes {auto} with Explicit ones, argument {i} of"
          " `fn` is sharded in its type, and the batch's type shows no split of"
          " its leading dim: a split over an Auto axis cannot be seen, and the"
          " gradients would be reduced on every micro-batch. Make the data axes"
          " Explicit and shard the batch over them, or name them:"
          f" `microbatched(..., axis_name={spec_entry(auto)!r})`.")


def scatter_dim(spec: PartitionSpec, axes: tuple[Any, ...]) -> tuple[int, Any] | None:
  """``(dim, names)`` if ``spec`` shards one dim over exactly the data axes, else None.

  A gradient of such a param is reduce-scattered onto it. Only when no other
  dim is sharded: jax 0.10's ``psum_scatter`` fails to lower an operand that
  is also sharded over an Explicit axis inside a partial-manual
  ``shard_map``. Such a gradient is all-reduced, then sliced.
  """
  entries = [() if e is None else _arrays.axis_names(e) for e in spec]
  hits = [dim for dim, names in enumerate(entries) if set(names) == set(axes)]
  if len(hits) != 1 or sum(bool(names) for names in entries) != 1:
    return None
  return hits[0], entries[hits[0]]
