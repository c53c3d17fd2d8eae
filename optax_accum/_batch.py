"""The batch rules of the two in-step wrappers, ``microbatched`` and ``cached_microbatched``.

What both do to the arguments of the function they wrap, written once: the
params are argument 0; ``num_microbatches`` is a positive int; which
positions are the batch and which the keys; a batch that ``k`` micro-batches
per device must divide; the strided split (micro-batch ``i`` holds rows
``i, i + k, ...``: a reshape, so a batch sharded along its leading dim stays
on its devices) and its inverse; the key of each device and micro-batch; the
wrapped ``fn``'s output unpacked (:func:`unpack`, which ``check_large_batch``
reads too); and each gradient given back in its param's layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_accum import _arrays, _validation

PARAMS = 0  # the position of the params, the differentiated argument, in every call
SPLITS = ("strided", "contiguous")  # "contiguous": microbatched's deprecated option


def check_num_microbatches(num_microbatches: Any) -> int:
  """``num_microbatches`` if it is a positive int, else raises: it fixes the shapes."""
  if isinstance(num_microbatches, (float, np.floating)) or callable(num_microbatches):
    raise TypeError(
        "`num_microbatches` must be a positive int: it fixes the micro-batch shapes, so"
        " floats and schedules are not supported inside one step; got"
        f" {num_microbatches!r}. Pass e.g. `num_microbatches=4`."
    )
  return _validation.check_k(num_microbatches, "num_microbatches")


def positions(batch_argnums: tuple[int, ...], rng_argnums: tuple[int, ...], nargs: int,
              ) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """The batch and key positions for a call with ``nargs`` positional arguments, else raises."""
  b_nums = _validation.resolve_argnums(batch_argnums, nargs, "batch_argnums")
  r_nums = _validation.resolve_argnums(rng_argnums, nargs, "rng_argnums")
  if PARAMS in (*b_nums, *r_nums) or set(b_nums) & set(r_nums):
    raise ValueError(
        f"`batch_argnums` {b_nums} and `rng_argnums` {r_nums} must not overlap (an argument"
        " is either split, the batch, or folded per micro-batch, a key) nor name position"
        f" {PARAMS}, the params (the differentiated argument, given whole to every"
        " micro-batch). Count positions in `fn(params, *args)`.")
  return b_nums, r_nums


def check_divides(size: int, k: int, devices: int = 1, axes: tuple[Any, ...] = ()) -> None:
  """Raises unless a batch of ``size`` rows splits into ``k`` micro-batches on each device."""
  if size % (k * devices) == 0:
    return
  where = f" on each of {devices} devices (mesh axes {axes})" if devices > 1 else ""
  per = size // devices
  raise ValueError(
      f"A batch of {size} examples cannot be split into num_microbatches={k} equal"
      f" micro-batches{where}. Use a num_microbatches that divides {per} (one of"
      f" {[d for d in range(1, per + 1) if per % d == 0]}), or pad the batch to a multiple"
      f" of {k * devices} and mask the padded rows out of the loss.")


def reshape(x: Any, k: int, split: str = "strided") -> jax.Array:
  """``[B, ...]`` to ``[B // k, k, ...]`` (strided; no data moves) or ``[k, B // k, ...]``."""
  x = jnp.asarray(x)
  m = x.shape[0] // k
  return x.reshape((m, k, *x.shape[1:]) if split == "strided" else (k, m, *x.shape[1:]))


def index(x: jax.Array, i: jax.Array, split: str = "strided") -> jax.Array:
  """Micro-batch ``i`` of a leaf laid out by :func:`reshape`."""
  return lax.dynamic_index_in_dim(x, i, axis=1 if split == "strided" else 0, keepdims=False)


def split(tree: Any, k: int, split: str = "strided") -> Any:
  """A batch pytree as ``[k, B // k, ...]`` leaves, micro-batch ``i`` at index ``i``."""
  def one(x: Any) -> jax.Array:
    x = reshape(x, k, split)
    return jnp.swapaxes(x, 0, 1) if split == "strided" else x
  return jax.tree.map(one, tree)


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
  out = list(args)
  for j, value in (*micro.items(), *keys.items()):
    out[j] = value
  return out


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
  return Out(value, den, aux, grads)


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

