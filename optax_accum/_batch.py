"""The batch rules, written once: every entry point that takes a batch reads one :class:`Batch`.

``microbatched``, ``cached_microbatched`` and ``local_value_and_grad``
each build one :class:`Batch` per call
(:func:`of`, the counterpart of ``_arrays.Layout``): the params are argument 0
and never the batch; each position is named once and within the call; every
batch leaf has a leading dim, the same number of rows and the same split over
the mesh; the devices divide the rows; ``k`` divides each device's rows
(:meth:`Batch.check_divides`). The same bad input gets the same error from
each. Here too, what the two in-step wrappers do with the batch:
``num_microbatches``, the strided split (micro-batch ``i`` holds rows ``i, i +
k, ...``: a reshape, so a batch sharded along its leading dim stays on its
devices) and its inverse, the key of each device and micro-batch, the wrapped
``fn``'s output unpacked (:func:`unpack`), and each gradient given back in its
param's layout.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_accum import _arrays, _validation

PARAMS = 0  # the position of the params, the differentiated argument, in every call
SPLITS = ("strided", "contiguous")  # "contiguous": microbatched's deprecated option


class Batch(NamedTuple):
  """The batch arguments of one call, checked (:func:`of`).

  Attributes:
    positions: the positions of the batch arguments, in order (never ``PARAMS``).
    keys: the positions of the PRNG keys (``rng_argnums``), in order.
    rows: the batch size, the leading dim every batch leaf shares.
    per_device_rows: the rows each device holds (``rows`` on one device).
    axes: the mesh axes the rows are split over, ``()`` for none: those the
      leaves' types show, or those ``axis_name`` names.
  """

  positions: tuple[int, ...]
  keys: tuple[int, ...]
  rows: int
  per_device_rows: int
  axes: tuple[Any, ...]

  @property
  def devices(self) -> int:
    """The number of devices the rows are split over."""
    return self.rows // self.per_device_rows

  def check_divides(self, k: int) -> None:
    """Raises unless the rows split into ``k`` equal micro-batches on each device."""
    for per, devices in ((self.rows, 1), (self.per_device_rows, self.devices)):
      if per % k:
        where = f" on each of {devices} devices (mesh axes {self.axes})" if devices > 1 else ""
        raise ValueError(
            f"A batch of {self.rows} examples cannot be split into {k} equal"
            f" micro-batches{where} (num_microbatches={k}). Use a k that divides"
            f" {per} (one of {divisors(per)[:12]}), or pad the batch to a multiple of"
            f" {k * devices} and mask the padded rows out of the loss.")


def of(args: Sequence[Any], batch_argnums: tuple[int, ...], rng_argnums: tuple[int, ...] = (),
       *, axis_name: Any = None, in_step: bool = False) -> Batch:
  """The :class:`Batch` of a call with positional ``args``, else raises.

  ``batch_argnums`` and ``rng_argnums`` come from ``_validation.check_argnums``.
  The axes are those the batch leaves' types show, or those ``axis_name``
  names (see :func:`data_axes`; ``in_step``: the two in-step wrappers, which
  refuse a split they cannot see). Call it inside the inputs' mesh
  (``_arrays.mesh_context``) when ``axis_name`` is given.
  """
  positions = _positions(batch_argnums, len(args), "batch_argnums")
  keys = _positions(rng_argnums, len(args), "rng_argnums")
  nnx = sys.modules.get("flax.nnx")  # (imported where a user made an NNX module)
  if nnx is not None and any(isinstance(x, nnx.Module) for x in args):
    raise TypeError(
        "An NNX module is an argument: it is no pytree, and a traced loop cannot read it. Split"
        " it and differentiate its params: `graphdef, params, rest = nnx.split(model,"
        " nnx.Param, ...)`, `fn = jax.value_and_grad(lambda params, *a: loss(nnx.merge("
        "graphdef, params, rest), *a))`, called with `params`; `optimizer.update(model, grads)`.")
  if set(positions) & set(keys):
    raise ValueError(
        f"`batch_argnums` {positions} and `rng_argnums` {keys} must not overlap: an argument"
        " is either split, the batch, or folded per micro-batch, a key.")
  rows, split, mesh = leading_rows({f"argument {i}": args[i] for i in positions})
  axes = data_axes(axis_name, split, args, positions, in_step)
  devices = _arrays.device_count(axes, mesh if split else None)
  if rows % devices:
    raise ValueError(
        f"A batch of {rows} examples cannot be split evenly over the {devices} devices of"
        f" mesh axes {axes}. Pad the batch to a multiple of {devices} and mask the padded"
        " rows out of the loss.")
  return Batch(positions, keys, rows, rows // devices, axes)


def _positions(argnums: tuple[int, ...], nargs: int, name: str) -> tuple[int, ...]:
  """``argnums`` within a call of ``nargs`` arguments, each once and never the params."""
  for a in argnums:
    if not -nargs <= a < nargs:
      raise ValueError(
          f"`{name}` contains {a}, but the function was called with {nargs} positional"
          f" argument(s). Pass those arguments positionally, or set `{name}` to their positions."
      )
  nums = tuple(a % nargs for a in argnums)
  twice = sorted({a for a in nums if nums.count(a) > 1})
  if twice:
    raise ValueError(
        f"`{name}={argnums!r}` names argument {twice[0]} twice. Name each argument once.")
  if PARAMS in nums:
    raise ValueError(
        f"`{name}={argnums!r}` names position {PARAMS}, the params (the differentiated"
        " argument, given whole to every micro-batch and device). Count positions from the"
        f" params at {PARAMS}: name 1 or later.")
  return tuple(sorted(nums))


def leading_rows(batches: dict[str, Any]) -> tuple[int, tuple[Any, ...], Any]:
  """The rows of ``batches`` (name -> pytree), the mesh axes their types split them over, the mesh.

  The rows and the axes must be the same for every leaf; ``()`` when the
  types show no split.
  """
  first = None
  for name, tree in batches.items():
    found = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not found:
      raise ValueError(
          f"The batch {name} has no array leaves, so it cannot be split. Pass a pytree of"
          " arrays with a leading batch dimension, or fix `batch_argnums`.")
    for path, leaf in found:
      where = f"{name}{jax.tree_util.keystr(path)}"
      if jnp.ndim(leaf) == 0:
        raise ValueError(
            f"The batch leaf at {where} is a scalar; every batch leaf needs a leading batch"
            " dimension. Add one, or pass this value outside the batch (it is then given"
            " to every micro-batch unchanged).")
      s, a = int(jnp.shape(leaf)[0]), _arrays.leading_axes(leaf)
      if first is None:
        first, size, axes, mesh = where, s, a, _arrays.array_type(leaf).mesh
      if s != size:
        raise ValueError(
            f"The batch leaves disagree on the batch size: {first} has {size} rows but"
            f" {where} has {s}. Every batch leaf must share its leading dimension.")
      if a != axes:
        raise ValueError(
            f"The batch leaves are split differently over the mesh: {first} has its leading"
            f" dim sharded over {axes or 'no axis'} but {where} over {a or 'no axis'}. Place"
            " every batch leaf the same way, e.g. jax.device_put(batch,"
            f" P({_arrays.spec_entry(axes or a)!r})).")
  if size == 0:
    raise ValueError(f"The batch is empty ({first} has 0 rows); pass at least one row.")
  return size, axes, mesh


def data_axes(axis_name: Any, split: tuple[Any, ...], args: Sequence[Any],
              positions: tuple[int, ...], in_step: bool = False) -> tuple[Any, ...]:
  """The mesh axes to run per device over, given ``split``, those the batch's type shows.

  Explicit axes are read from the batch's type; Auto ones must be named by
  ``axis_name``. ``()`` to run as written: on one device, or inside
  ``shard_map``/``pmap`` (``axis_name`` naming their axes).
  """
  if axis_name is None:
    if in_step and not split:
      _check_no_hidden_split(args, positions)
    return split
  named = _arrays.axis_names(axis_name)
  if _arrays.axis_kind(axis_name, caller="`microbatched`") is None:  # inside shard_map, or pmap
    if split:
      raise ValueError(
          f"The batch is sharded over the Explicit mesh axes {split} while"
          f" `axis_name={axis_name!r}` names shard_map/pmap axes: both would split it. Drop"
          " `axis_name` (the split is read from the batch's type), or replicate the batch"
          " over the Explicit axes.")
    return ()
  if split and set(split) != set(named):
    raise ValueError(
        f"`axis_name={axis_name!r}` names mesh axes the batch is not split over: its type"
        f" shows it sharded over {split}. Name the axes the batch is split over (Explicit"
        " ones may be dropped: they are read from the batch's type).")
  return named


def _check_no_hidden_split(args: Sequence[Any], positions: tuple[int, ...]) -> None:
  """Raises on a mesh that mixes Auto and Explicit axes with params in explicit types.

  An Auto axis does not appear in the batch's type: a batch split over it
  would go undetected, and the partitioner would reduce the gradients on
  every micro-batch.
  """
  mesh = jax.sharding.get_abstract_mesh()
  auto = tuple(n for n in mesh.axis_names if _arrays.axis_kind(n) == "Auto")
  if not auto or not _arrays.has_explicit_axes(mesh):
    return
  for i, arg in enumerate(args):
    if i not in positions and any(
        isinstance(x, (jax.Array, np.ndarray)) and any(_arrays.array_type(x).spec)
        for x in jax.tree.leaves(arg)):
      raise ValueError(
          f"The mesh mixes Auto axes {auto} with Explicit ones, argument {i} of"
          " `fn` is sharded in its type, and the batch's type shows no split of"
          " its leading dim: a split over an Auto axis cannot be seen, and the"
          " gradients would be reduced on every micro-batch. Make the data axes"
          " Explicit and shard the batch over them, or name them:"
          f" `microbatched(..., axis_name={_arrays.spec_entry(auto)!r})`.")


def divisors(n: int) -> list[int]:
  """The divisors of ``n``, in increasing order."""
  return [d for d in range(1, n + 1) if n % d == 0]


def check_num_microbatches(num_microbatches: Any) -> int:
  """``num_microbatches`` if it is a positive int, else raises: it fixes the shapes."""
  if isinstance(num_microbatches, (float, np.floating)) or callable(num_microbatches):
    raise TypeError(
        "`num_microbatches` must be a positive int: it fixes the micro-batch shapes, so"
        " floats and schedules are not supported inside one step; got"
        f" {num_microbatches!r}. Pass e.g. `num_microbatches=4`."
    )
  return _validation.check_k(num_microbatches, "num_microbatches")


def check_split(split: Any) -> str:
  """``split`` if it is one of :data:`SPLITS`, else raises."""
  return _validation.check_choice(split, "split", SPLITS,
                                  "Use 'strided' (default) or 'contiguous'.")


def reshape(x: Any, k: int, split: str = "strided") -> jax.Array:
  """``[B, ...]`` to ``[B // k, k, ...]`` (strided; no data moves) or ``[k, B // k, ...]``."""
  x = jnp.asarray(x)
  m = x.shape[0] // k
  return x.reshape((m, k, *x.shape[1:]) if split == "strided" else (k, m, *x.shape[1:]))


def index(x: jax.Array, i: jax.Array, split: str = "strided") -> jax.Array:
  """Micro-batch ``i`` of a leaf laid out by :func:`reshape`."""
  return lax.dynamic_index_in_dim(x, i, axis=1 if split == "strided" else 0, keepdims=False)


def split_microbatches(tree: Any, num_microbatches: int, split: str = "strided") -> Any:
  """Splits a batch pytree into a stacked ``[k, batch // k, ...]`` pytree.

  The same split :func:`~optax_accum.microbatched` and
  :func:`~optax_accum.cached_microbatched` use, exposed for inspection and
  for reference computations: micro-batch ``i`` holds rows ``i, i + k,
  i + 2k, ...`` (a reshape to ``[batch // k, k, ...]``, so a batch sharded
  along its leading dim stays sharded without any data movement). ``split``
  is for the layout of ``microbatched``'s deprecated ``split="contiguous"``
  (rows ``i * m ... (i + 1) * m - 1``), which goes with it in 0.4.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_accum.microbatching import split_microbatches
    >>> split_microbatches(jnp.arange(6), 2).tolist()
    [[0, 2, 4], [1, 3, 5]]
  """
  k, split = check_num_microbatches(num_microbatches), check_split(split)
  rows = leading_rows({"`tree`": tree})[0]
  Batch((), (), rows, rows, ()).check_divides(k)  # (the whole batch: one device's rule)
  return _split(tree, k, split)


def split(tree: Any, k: int, split: str = "strided") -> Any:
  """A batch pytree as ``[k, B // k, ...]`` leaves, micro-batch ``i`` at index ``i``."""
  def one(x: Any) -> jax.Array:
    x = reshape(x, k, split)
    return jnp.swapaxes(x, 0, 1) if split == "strided" else x
  return jax.tree.map(one, tree)


_split = split  # (the name `split_microbatches`'s parameter hides)


def unsplit(tree: Any, split: str = "strided") -> Any:
  """The inverse of :func:`split`: ``[k, m, ...]`` leaves to ``[k * m, ...]`` in batch order."""
  def one(x: jax.Array) -> jax.Array:
    x = jnp.swapaxes(x, 0, 1) if split == "strided" else x
    return x.reshape((-1, *x.shape[2:]))
  return jax.tree.map(one, tree)


def device_key(key: jax.Array, axes: Any) -> jax.Array:
  """``key`` made this device's (folded with its index over ``axes``; as given for None)."""
  return key if axes is None else jax.random.fold_in(key, lax.axis_index(axes))


def microbatch_key(key: jax.Array, i: jax.Array) -> jax.Array:
  """Micro-batch ``i``'s key: never the key given (not even for ``k = 1``)."""
  return jax.random.fold_in(key, i)


def micro_args(args: Sequence[Any], micro: dict[int, Any], keys: dict[int, Any]) -> list[Any]:
  """``args`` with one micro-batch's rows (``micro``) and keys (``keys``) at their positions."""
  return [micro.get(i, keys.get(i, a)) for i, a in enumerate(args)]


class Out(NamedTuple):
  """One output of the wrapped ``fn``, unpacked."""

  num: Any  # the value (the numerator with normalize="weighted")
  den: Any  # the scalar denominator with normalize="weighted", else None
  aux: Any  # the aux with has_aux=True, else None
  grads: Any


def unpack(out: Any, normalize: str, has_aux: bool) -> Out:
  """``fn``'s output (``microbatched``'s contract) to ``(numerator, denominator, aux, grads)``."""
  def pair(x: Any, needs: str) -> Any:
    if not (isinstance(x, (tuple, list)) and len(x) == 2):
      raise TypeError(f"{needs}; got a value with structure {jax.tree.structure(x)}.")
    return x

  value, grads = pair(out, "`fn` must return `(value, grads)` like `jax.value_and_grad(loss_fn)`")
  den = aux = None
  if normalize == "weighted":
    value, den = pair(value, (
        "normalize='weighted' needs `fn`'s value to be (numerator, denominator) — e.g."
        " jax.value_and_grad(loss_fn, has_aux=True) with loss_fn returning (sum of token"
        " losses, number of real tokens)"))
    if has_aux:
      den, aux = pair(den, "normalize='weighted' with has_aux=True needs `fn`'s value to be"
                           " (numerator, (denominator, aux))")
    if jnp.ndim(den) != 0:
      raise ValueError(
          "normalize='weighted' needs a scalar denominator (e.g. the count of"
          f" real tokens); got shape {jnp.shape(den)}. Sum it before returning."
      )
  elif has_aux:
    value, aux = pair(value, "has_aux=True needs `fn` to return ((value, aux), grads), like"
                             " jax.value_and_grad(loss, has_aux=True)")
  elif isinstance(value, tuple) and len(value) == 2:  # (its aux would be averaged as a loss)
    raise TypeError(
        f"`fn`'s value has structure {jax.tree.structure(value)}, not one loss: an `fn` built"
        " with `jax.value_and_grad(loss_fn, has_aux=True)` needs `has_aux=True` here too.")
  return Out(value, den, aux, grads)


def check_no_batch_gradient(grads: Any, args: Sequence[Any], positions: tuple[int, ...],
                            rows: int) -> None:
  """Raises where ``grads`` is ``jax.value_and_grad(..., argnums=(0, ...))``'s tuple (its first
  entry shaped like the params, leaf by leaf) and another entry is shaped like a batch argument
  of ``args`` on ``rows`` rows. Summed over the micro-batches, its rows would be other
  examples' added together."""
  def shapes(tree: Any) -> tuple[Any, list[tuple[int, ...]]]:
    return jax.tree.structure(tree), [tuple(getattr(x, "shape", ())) for x in jax.tree.leaves(tree)]

  tupled = isinstance(grads, (tuple, list)) and len(grads) > 1 and shapes(grads[0]) == shapes(
      args[PARAMS])
  for i in positions if tupled else ():
    treedef, leaves = shapes(args[i])
    if any(shapes(g) == (treedef, [(rows, *s[1:]) for s in leaves]) for g in grads[1:]):
      raise TypeError(
          f"`fn` returns a gradient with respect to batch argument {i}: gradients are summed over"
          " the micro-batches, which would add other examples' rows together. Differentiate"
          " with respect to the params (`argnums=0`); return what you need of the batch's"
          " gradient as an aux (`has_aux=True`, `aux_rules='concat'`).")


def shapes_at(args: Sequence[Any], positions: tuple[int, ...], rows: int) -> list[Any]:
  """The shapes of the array leaves of ``args``, those at ``positions`` holding ``rows`` rows."""
  leaves = _arrays.ArrayLeaves.of(tuple(args))
  return [jax.ShapeDtypeStruct((rows, *jnp.shape(x)[1:]) if path[0].idx in positions
                               else jnp.shape(x), jnp.result_type(x))
          for path, x in zip(leaves.paths, leaves.arrays, strict=True)]


def param_specs(params: Any, grads: Any) -> list[Any] | None:
  """Each param's spec, if ``grads`` (arrays or shapes) is shaped like the params, else None."""
  leaves, treedef = jax.tree.flatten(params)
  g_leaves, g_def = jax.tree.flatten(grads)
  if treedef != g_def or any(jnp.shape(p) != jnp.shape(g)
                             for p, g in zip(leaves, g_leaves, strict=True)):
    return None
  return [_arrays.array_type(p).spec for p in leaves]


def to_params(grads: Any, params: Any) -> Any:
  """``grads`` each in its param's sharding under explicit axes (as given if not params')."""
  if param_specs(params, grads) is None:
    return grads
  return jax.tree.map(_arrays.laid_out_like, grads, params)

