"""Array-type facts and tree helpers: where an array lives, and how to walk a pytree.

A leaf module: it imports nothing of the package. Under explicit sharding the
sharding is part of an array's type; inside ``shard_map`` so is the set of
manual axes it varies over; under ``jax.jit`` with Explicit axes a gradient can
be typed *unreduced* (a per-device partial sum). Every module reads these
facts from here.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def accumulator_dtype(dtype: Any, requested: jnp.dtype | None = None) -> jnp.dtype:
  """The dtype of the buffer that sums values of ``dtype``.

  The default rule (``requested=None``) never narrows: bfloat16 and float16
  accumulate in float32, float32 in float32, float64 in float64, complex64 in
  complex64 and complex128 in complex128. An explicit ``requested`` dtype is
  used as given, even if narrower (the caller asked for it), except that a
  real buffer for complex values raises: it would drop the imaginary part.
  Non-floating dtypes (integer aux outputs, say) keep their own dtype.
  """
  dtype = jnp.dtype(dtype)
  if requested is not None:
    if jnp.issubdtype(dtype, jnp.complexfloating) and not jnp.issubdtype(
        requested, jnp.complexfloating):
      raise TypeError(
          f"`accumulator_dtype={requested}` is real but the values are {dtype}:"
          " the imaginary part would be dropped. Pass a complex dtype such as"
          f" {jnp.promote_types(dtype, jnp.complex64)}, or None for the default rule."
      )
    return jnp.dtype(requested)
  if jnp.issubdtype(dtype, jnp.inexact):  # complex64 with float32 promotes to complex64
    return promote_types(dtype, jnp.float32)
  return dtype


def promote_types(a: Any, b: Any) -> jnp.dtype:
  """``jnp.promote_types``, where an 8-bit float (which JAX promotes to nothing implicitly)
  meets another dtype as bfloat16, which holds it exactly (fp8 with float32: float32)."""
  if jnp.dtype(a) == jnp.dtype(b):
    return jnp.dtype(a)
  as_bf16 = lambda d: jnp.bfloat16 if jnp.issubdtype(d, jnp.floating) and jnp.dtype(
      d).itemsize == 1 else d
  return jnp.promote_types(as_bf16(a), as_bf16(b))


def sum_dtype(dtype: Any, requested: Any = None, mean: bool = False) -> jnp.dtype:
  """The dtype a sum over micro-batches keeps values of ``dtype`` in (``microbatched``'s loop,
  its aux rules and its statistics alike).

  Floats and complex as :func:`accumulator_dtype` gives (``requested`` as
  given); integers narrower than int32 in int32 (512 int8 counts would wrap to
  0), and in a mean (or as the denominator of one) in float32.
  """
  if jnp.issubdtype(dtype, jnp.inexact):
    return accumulator_dtype(dtype, requested)
  if mean:
    return jnp.dtype(jnp.float32)
  return jnp.promote_types(dtype, jnp.int32) if jnp.dtype(dtype).itemsize < 4 else jnp.dtype(dtype)


class ArrayType(NamedTuple):
  """What an array's type says about where it lives."""

  spec: jax.sharding.PartitionSpec  # its PartitionSpec (empty when none)
  explicit_spec: Any  # the out_sharding a new array needs to have this type, or None
  varying: frozenset[Any]  # the manual mesh axes it varies over inside shard_map
  unreduced: frozenset[Any]  # the mesh axes over which it is an unreduced partial sum
  mesh: Any  # the mesh of its sharding (a Mesh or an AbstractMesh), or None


def array_type(x: Any) -> ArrayType:
  """The type facts of an array, a tracer or a ``jax.ShapeDtypeStruct``.

  Under explicit sharding the sharding is part of the type (both branches of
  a cond, and a scan carry, must keep it). ``varying`` is empty under
  ``pmap`` and ``shard_map(check_vma=False)``, whose types carry no such
  information.
  """
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  sharding = getattr(aval, "sharding", None)
  # (not `or`: a rank-0 spec, typed unreduced or not, is an empty tuple)
  spec = getattr(sharding, "spec", jax.sharding.PartitionSpec())
  explicit = spec if has_explicit_axes(getattr(sharding, "mesh", None)) else None
  varying = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
  return ArrayType(spec, explicit, frozenset(varying or ()),
                   frozenset(getattr(spec, "unreduced", None) or ()),
                   getattr(sharding, "mesh", None))


def filled(s: Any, dtype: Any, fill: Any = 0) -> jax.Array:
  """``fill`` shaped like ``s``; under explicit sharding also sharded like ``s``.

  A ``lax.scan`` carry must keep its type, and under explicit sharding the
  type includes the sharding (a gradient sharded over a ``"model"`` axis).
  """
  return jnp.full(s.shape, fill, dtype, out_sharding=array_type(s).explicit_spec)


def leading_axes(x: Any) -> tuple[Any, ...]:
  """The mesh axes ``x``'s type splits its leading dim (its rows) over; ``()`` for none."""
  lead = (*array_type(x).spec, None)[0]
  return axis_names(lead) if lead else ()


def laid_out_like(x: jax.Array, like: Any) -> jax.Array:
  """``x`` resharded to ``like``'s layout where their types say different ones (explicit axes)."""
  want = array_type(like).explicit_spec
  return x if want is None or array_type(x).explicit_spec == want else jax.reshard(x, want)


def strip_axes(partitions: tuple[Any, ...], axes: tuple[Any, ...]) -> tuple[Any, ...]:
  """A spec's partitions with ``axes`` removed (those dims all-gathered over them)."""
  kept = (tuple(n for n in axis_names(e) if n not in axes) for e in partitions)
  return tuple(spec_entry(names) if names else None for names in kept)  # (None stays None)


def on_one_device(sharding: Any) -> bool:
  """Whether ``sharding`` is a one-device sharding other than a NamedSharding (JAX 0.12.1
  deprecates the name ``SingleDeviceSharding``, and will make such shardings NamedShardings)."""
  return (isinstance(sharding, jax.sharding.Sharding) and len(sharding.device_set) == 1
          and not isinstance(sharding, jax.sharding.NamedSharding))


def has_explicit_axes(mesh: Any) -> bool:
  """Whether ``mesh`` (a Mesh, an AbstractMesh or None) has an Explicit axis."""
  return jax.sharding.AxisType.Explicit in (getattr(mesh, "axis_types", ()) or ())


def match_varying(x: jax.Array, target: Any) -> jax.Array:
  """``x`` marked device-varying over the manual axes ``target`` varies over.

  A no-op outside ``shard_map``. Inside it, both branches of a ``lax.cond``
  (and a ``lax.scan`` carry and its update) must vary over the same axes.
  """
  return pcast_varying(x, tuple(sorted(array_type(target).varying, key=str)))


def pcast_varying(x: jax.Array, names: Sequence[Any]) -> jax.Array:
  """``x`` marked device-varying over the manual axes ``names`` (a no-op where it is)."""
  names = tuple(a for a in names if a not in array_type(x).varying)
  return lax.pcast(x, names, to="varying") if names else x


def axis_names(axis_name: Any) -> tuple[Any, ...]:
  """``axis_name`` (one name, or a tuple or list of them) as a tuple."""
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def spec_entry(axes: tuple[Any, ...]) -> Any:
  """Mesh axes as one entry of a ``PartitionSpec``: a name, or a tuple of names."""
  return axes[0] if len(axes) == 1 else axes


def device_count(axes: tuple[Any, ...], mesh: Any = None) -> int:
  """The number of devices along ``axes`` of ``mesh`` (default: the current mesh)."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  return math.prod(mesh.shape[a] for a in axes)


def axis_kind(axis_name: Any, *, check: bool = True, caller: str = "the step") -> str | None:
  """The kind of the mesh axes ``axis_name`` names: ``"Explicit"``, ``"Auto"``, or None.

  None for manual axes: those of ``shard_map`` (Manual on the current mesh)
  or ``pmap`` (not on it). Raises for a mix of kinds, and (with ``check``) for
  axes neither on the current mesh nor bound, naming ``caller``: ``init``,
  which ``jax.pmap`` maps without naming the axis, passes ``check=False``.
  """
  axes = axis_names(axis_name)
  mesh = jax.sharding.get_abstract_mesh()
  names = tuple(mesh.axis_names or ())
  if not all(a in names for a in axes):
    if check and axis_indices(axes) is None:
      raise ValueError(
          f"`axis_name={axis_name!r}` is not an axis of the current mesh (its axes are"
          f" {names}) nor a bound pmap/shard_map axis. Pass one of the mesh's axes." if names else
          f"`axis_name={axis_name!r}` is bound nowhere: no mesh is set (under jit, the mesh of"
          " inputs placed with NamedSharding is not), no shard_map or pmap binds it. Call"
          f" {caller} under `with jax.set_mesh(mesh):` or inside a `jax.shard_map` over it.")
    return None
  kinds = {str(mesh.axis_types[names.index(a)]).rsplit(".", 1)[-1] for a in axes}
  if len(kinds) > 1:
    raise ValueError(
        f"`axis_name={axis_name!r}` names mesh axes of kinds {sorted(kinds)}: name axes of"
        " one kind, not a mix (Explicit ones for plain jit, Manual ones inside shard_map).")
  return None if kinds == {"Manual"} else kinds.pop()


def axis_indices(axes: Sequence[Any]) -> list[jax.Array] | None:
  """Each axis's ``lax.axis_index``; None unless all are bound by a pmap / shard_map."""
  try:
    return [lax.axis_index(a) for a in axes]
  except NameError:
    return None


class Layout(NamedTuple):
  """Where a step's per-device values live, given ``axis_name``: computed once per call.

  One of three: one device (``axis_name`` None); manual axes (``shard_map``,
  ``pmap``: each device holds its own value, a ``psum`` reduces); or plain jit
  on Explicit axes (``stacked``: one copy per device along a leading axis
  sharded over them, a ``jax.reshard`` reduces).
  """

  axis_name: Any = None
  stacked: tuple[Any, ...] | None = None  # plain jit: the data axes the copies are stacked over

  @property
  def manual(self) -> bool:
    """``shard_map`` or ``pmap``: the cross-device reduction is a ``psum``."""
    return self.axis_name is not None and self.stacked is None


ONE_DEVICE = Layout()


def device_layout(axis_name: Any, *, check: bool = True) -> Layout:
  """The :class:`Layout` for ``axis_name`` on the current mesh.

  ``stacked`` holds the axes if ``axis_name`` names Explicit axes of the current
  mesh (plain jit): under ``jax.jit`` in explicit-sharding mode the gradients
  arrive *unreduced* over them and the reduction is a ``jax.reshard``. None
  when they are manual axes (``shard_map``, ``pmap``): there the cross-device
  reduction is a ``psum``. Auto axes carry no such types: that is an error, as
  is a mix of kinds (:func:`axis_kind`, which ``check`` goes to).
  """
  if axis_name is None:
    return ONE_DEVICE
  kind = axis_kind(axis_name, check=check, caller="`accumulate(..., axis_name=...)`'s update")
  if kind == "Auto":
    raise ValueError(
        f"`axis_name={axis_name!r}` names mesh axes of kinds ['Auto']. Use Explicit axes"
        " (jax.make_mesh(..., axis_types=(AxisType.Explicit, ...)) and jax.set_mesh) for jit"
        " with unreduced gradients, or Manual ones (inside shard_map) for psum.")
  return Layout(axis_name, axis_names(axis_name) if kind == "Explicit" else None)


def mesh_context(tree: Any) -> Any:
  """A context that enters the mesh ``tree``'s arrays are placed on, when none is set.

  The pjit idiom places arrays with ``NamedSharding(mesh, spec)`` and never
  calls ``jax.set_mesh``; a new array typed with a ``PartitionSpec`` (the
  per-device buffer, a cond's zeros, a reshard) needs a mesh in context. Under
  ``jax.jit`` the inputs' abstract mesh is entered, eagerly the concrete one.
  A set mesh, or inputs on no Explicit mesh, leave everything as it is.
  """
  if jax.sharding.get_abstract_mesh().empty:
    for x in jax.tree.leaves(tree):
      # A tracer's sharding is in its type; an array's (or a ShapeDtypeStruct's) on it.
      sharding = getattr(jax.typeof(x) if isinstance(x, jax.core.Tracer) else x, "sharding", None)
      mesh = getattr(sharding, "mesh", None)
      if has_explicit_axes(mesh):
        if isinstance(mesh, jax.sharding.Mesh):
          return jax.set_mesh(mesh)
        return jax.sharding.use_abstract_mesh(mesh)
  return contextlib.nullcontext()


class ArrayLeaves(NamedTuple):
  """A pytree's array leaves, and how to put the tree back around new ones.

  What crosses ``jax.eval_shape`` or a ``shard_map`` is the arrays; every
  other leaf (an Equinox module's activation function, a Python number)
  stays static, passed through as it is, the way ``eqx.filter_jit`` does.
  """

  arrays: list[Any]
  paths: list[Any]  # the key path of each array leaf
  leaves: list[Any]  # every leaf
  treedef: Any

  @classmethod
  def of(cls, tree: Any) -> ArrayLeaves:
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    found = [(p, x) for p, x in with_paths if isinstance(x, (jax.Array, np.ndarray))]
    return cls([x for _, x in found], [p for p, _ in found], [x for _, x in with_paths], treedef)

  def rebuild(self, arrays: Sequence[Any]) -> Any:
    new = iter(arrays)
    return jax.tree.unflatten(self.treedef, [
        next(new) if isinstance(x, (jax.Array, np.ndarray)) else x for x in self.leaves])


def first_node(tree: Any, predicate: Callable[[Any], bool]) -> Any:
  """The first node of ``tree`` (any pytree: a chain's tuple, a Flax state) matching, or None."""
  return next((n for n in jax.tree.leaves(tree, is_leaf=predicate) if predicate(n)), None)
