"""Argument checks shared by the public transforms.

Every error names the argument at fault and says how to fix it.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum import _arrays

REDUCTIONS = ("mean", "sum", "weighted")

_INT32_MAX = 2**31 - 1


def check_update(
    config: Any, grads: Any, buffer: Any, *, weight: Any = None, emit_now: Any = False,
    flushing: bool = False, skip_nonfinite: bool = False,
) -> tuple[jax.Array | None, Any]:
  """Every check of an update's values; returns ``(weight, emit_now)``, checked.

  The gradients must match the buffer's tree and shapes, fit its dtypes (no part of a value
  dropped) and live where the window expects them: device-local under
  ``shard_map``, unreduced under plain jit with Explicit axes, neither
  without ``axis_name``. A flush carries zeros and no weight. Each failure is
  raised by the check that words it.
  """
  g_leaves, g_def = jax.tree.flatten(grads)
  b_leaves, b_def = jax.tree.flatten(buffer)
  if g_def != b_def:
    check_tree_matches(grads, buffer)
  explicit_dtype = config.acc_dtype is not None
  for g, b in zip(g_leaves, b_leaves, strict=True):
    if getattr(g, "dtype", None) == jax.dtypes.float0:
      check_no_float0(grads)
    if jnp.shape(g) != jnp.shape(b):
      check_tree_matches(grads, buffer)
    g_dtype, b_dtype = jnp.result_type(g), jnp.result_type(b)
    if (jnp.issubdtype(g_dtype, jnp.complexfloating)
        and not jnp.issubdtype(b_dtype, jnp.complexfloating)) or (
            not explicit_dtype and jnp.promote_types(g_dtype, b_dtype) != b_dtype):
      check_grad_dtypes(grads, buffer, explicit_dtype)
  if flushing:
    return None, True
  if weight is not None or config.reduction == "weighted":
    weight = check_weight(weight, config.reduction)
  if emit_now is not False:
    emit_now = check_emit_now(emit_now)
  # Where the gradients live: their types say it.
  if config.axis_name is None:
    for g in g_leaves:
      if _arrays.array_type(g).unreduced:
        check_grads_not_unreduced(grads)
    return weight, emit_now
  axes = _arrays.explicit_axes(config.axis_name)
  if axes is None:  # shard_map / pmap
    check_grads_are_local(grads, config.axis_name)
    return weight, emit_now
  check_grads_unreduced(grads, axes)
  check_buffer_unreduced(buffer, axes)
  for flag, on in (("skip_nonfinite", skip_nonfinite),
                   ("track_noise_scale", config.noise_decay is not None)):
    if on:
      raise ValueError(
          f"`{flag}` needs each device's gradient values, but under jit with"
          f" `axis_name={config.axis_name!r}` they are unreduced partial sums (JAX has"
          " no finiteness or squared-norm rule for those). Use shard_map with"
          " `axis_name` (optax_accum.per_device_state), or drop the option."
      )
  return weight, emit_now


def check_k(k: Any, name: str = "k") -> int | Callable[[jax.Array], Any]:
  """Returns ``k`` if it is a positive int (or integral float) or a schedule, else raises."""
  if callable(k):
    return k
  if isinstance(k, (float, np.floating)) and float(k).is_integer():
    k = int(k)  # optax.MultiSteps accepts 2.0
  if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)):
    raise TypeError(
        f"`{name}` must be a positive int (micro-batches per optimizer step) or"
        f" a schedule `f(gradient_step) -> int`; got {k!r} of type"
        f" {type(k).__name__}. Pass e.g. `{name}=4`."
    )
  if k < 1:
    raise ValueError(
        f"`{name}` must be >= 1 (the number of micro-batches per optimizer"
        f" step); got {k}. Use `{name}=1` for no accumulation."
    )
  if k > _INT32_MAX:
    raise ValueError(
        f"`{name}`={k} does not fit the int32 step counters (at most"
        f" {_INT32_MAX}). Use a smaller window, or flush windows with"
        " `emit_now=True`."
    )
  return int(k)


def check_flag(value: Any, name: str) -> bool:
  """Returns ``value`` as a Python bool if it is a bool (numpy's too), else raises."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"`{name}` must be a bool; got {value!r}.")
  return bool(value)


def check_optimizer(optimizer: Any, name: str = "optimizer") -> None:
  """Raises unless ``optimizer`` is None or an optax transformation."""
  if optimizer is None or (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
    return
  if callable(optimizer):
    what = getattr(optimizer, "__name__", repr(optimizer))
    raise TypeError(
        f"`{name}` must be an optax GradientTransformation such as"
        f" optax.adam(1e-3); got the function {what} itself. Call it with its"
        f" hyperparameters, e.g. {what}(1e-3)."
    )
  raise TypeError(
      f"`{name}` must be an optax GradientTransformation (with `init` and"
      f" `update`), such as optax.adam(1e-3); got {type(optimizer).__name__}."
  )


def check_emit_now(emit_now: Any) -> Any:
  """``emit_now`` as False, True or a bool scalar array, else raises."""
  if isinstance(emit_now, (bool, np.bool_)):
    return bool(emit_now)
  if jnp.ndim(emit_now) != 0:
    raise ValueError(
        "`emit_now` must be a scalar bool (close the window after this"
        f" micro-batch or not); got shape {jnp.shape(emit_now)}. Pass e.g."
        " `emit_now=is_last_batch`."
    )
  return jnp.asarray(emit_now).astype(jnp.bool_)


def check_weight(weight: Any, reduction: str) -> jax.Array | None:
  """The micro-batch weight as a float32 scalar (None without weights), else raises.

  A negative weight is an error when it is concrete; a traced one cannot be
  checked and is turned into NaN, so that it behaves like a non-finite
  gradient (skipped with ``skip_nonfinite=True``, else NaN in the update).
  """
  if reduction != "weighted":
    if weight is not None:
      raise ValueError(
          f"`weight` was given but reduction={reduction!r} ignores it. Build"
          " the transform with `accumulate(k, ..., reduction='weighted')`."
      )
    return None
  if weight is None:
    raise ValueError(
        "reduction='weighted' needs a per-micro-batch weight: call"
        " `update(grads, state, params, weight=w)` with w e.g. the number of"
        " real tokens in the micro-batch."
    )
  if jnp.ndim(weight) != 0:
    raise ValueError(
        "`weight` must be a scalar (one weight per micro-batch); got shape"
        f" {jnp.shape(weight)}. Pass e.g. the micro-batch's token count."
    )
  if not isinstance(weight, jax.core.Tracer):
    concrete = float(np.asarray(weight))
    if concrete < 0:
      raise ValueError(
          f"`weight` must be >= 0 (e.g. a count of real tokens); got {concrete}."
          " A negative weight has no meaning in a weighted mean."
      )
  w = jnp.asarray(weight, jnp.float32)
  return jnp.where(w < 0, jnp.nan, w)


def check_grad_dtypes(grads: Any, buffer: Any, explicit: bool) -> None:
  """Raises where the buffer would silently drop part of a gradient.

  A complex gradient into a real buffer loses its imaginary part; a gradient
  wider than the buffer built by ``init`` (float64 into float32) loses
  precision, which is allowed only when the buffer dtype was asked for.
  """
  check_no_float0(grads)
  for (path, g), b in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                          jax.tree.leaves(buffer), strict=True):
    g_dtype, b_dtype = jnp.result_type(g), jnp.result_type(b)
    if jnp.issubdtype(g_dtype, jnp.complexfloating) and not jnp.issubdtype(
        b_dtype, jnp.complexfloating):
      raise TypeError(
          f"The gradient at {_path_str(path)} is {g_dtype} but the accumulator"
          f" is {b_dtype}: the imaginary part would be dropped. Build the"
          " transform with a complex `accumulator_dtype` (or None, the default,"
          " and complex params)."
      )
    if not explicit and jnp.promote_types(g_dtype, b_dtype) != b_dtype:
      raise TypeError(
          f"The gradient at {_path_str(path)} is {g_dtype}, wider than the"
          f" {b_dtype} accumulator that `init` built from the params: it would"
          " lose precision. Pass `accumulator_dtype` explicitly (a narrower"
          " one is then accepted), or init with params of the gradients' dtype."
      )


def check_no_float0(grads: Any, where: str = "gradient") -> None:
  """Raises on a ``float0`` leaf: the cotangent of an integer leaf (``allow_int=True``).

  Nothing can be summed or stepped on it (optax's optimizers reject it too):
  the integer leaves must stay out of what is differentiated.
  """
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    if getattr(g, "dtype", None) == jax.dtypes.float0:
      raise TypeError(
          f"The {where} at {_path_str(path)} has dtype float0: it is the cotangent of an"
          " integer leaf (jax.grad(..., allow_int=True)), which cannot be accumulated"
          " or stepped on. Leave integer leaves out of what you differentiate and"
          " optimise: split them off first, e.g. `params, static ="
          " eqx.partition(model, eqx.is_inexact_array)`, and differentiate `params`."
      )


def check_reduction(reduction: Any) -> str:
  if reduction not in REDUCTIONS:
    raise ValueError(
        f"`reduction` must be one of {REDUCTIONS}; got {reduction!r}. Use"
        " 'mean' for sum/k, 'sum' for the plain sum, or 'weighted' with"
        " `update(..., weight=w)` for sum(w_i g_i) / sum(w_i)."
    )
  return reduction


def check_accumulator_dtype(dtype: Any) -> jnp.dtype | None:
  """Returns ``dtype`` canonicalised, or None (the default rule), else raises."""
  if dtype is None:
    return None
  try:
    canonical = jnp.dtype(dtype)
  except TypeError as e:
    raise TypeError(
        "`accumulator_dtype` must be a floating or complex dtype such as"
        f" jnp.float32, or None for the default rule; got {dtype!r}."
    ) from e
  if not jnp.issubdtype(canonical, jnp.inexact):
    raise TypeError(
        "`accumulator_dtype` must be a floating or complex dtype such as"
        f" jnp.float32, or None for the default rule; got {canonical}."
    )
  return canonical


def _path_str(path: tuple[Any, ...]) -> str:
  return jax.tree_util.keystr(path) or "<root>"


def check_tree_matches(grads: Any, buffer: Any, *, what: str = "gradients") -> None:
  """Raises if ``grads`` does not have the structure and shapes of ``buffer``.

  The message names the first path at which the two trees differ.
  """
  g_leaves, g_def = jax.tree_util.tree_flatten_with_path(grads)
  b_leaves, b_def = jax.tree_util.tree_flatten_with_path(buffer)
  if g_def != b_def:
    g_paths = [_path_str(p) for p, _ in g_leaves]
    b_paths = [_path_str(p) for p, _ in b_leaves]
    for gp, bp in zip(g_paths, b_paths, strict=False):
      if gp != bp:
        raise ValueError(
            f"The {what} tree does not match the accumulator built by"
            f" `init(params)`: first difference at {gp} (gradients) vs {bp}"
            " (state). Pass gradients with the same structure as the params"
            " given to `init`, or re-run `init` on the new params."
        )
    longer, shorter = (g_paths, b_paths) if len(g_paths) > len(b_paths) else (
        b_paths, g_paths)
    side = "gradients" if longer is g_paths else "state"
    extra = longer[len(shorter)] if len(longer) > len(shorter) else "<node types>"
    raise ValueError(
        f"The {what} tree does not match the accumulator built by"
        f" `init(params)`: first difference at {extra} (only in the {side};"
        f" structures {g_def} vs {b_def}). Pass gradients with the same"
        " structure as the params given to `init`."
    )
  for (path, g), (_, b) in zip(g_leaves, b_leaves, strict=True):
    if jnp.shape(g) != jnp.shape(b):
      raise ValueError(
          f"The {what} leaf at {_path_str(path)} has shape {jnp.shape(g)} but"
          f" the accumulator holds shape {jnp.shape(b)}. Pass gradients shaped"
          " like the params given to `init`."
      )


def check_grads_are_local(grads: Any, axis_name: Any) -> None:
  """Raises if, inside a checked ``shard_map``, ``grads`` are already reduced.

  ``jax.grad`` with respect to replicated params inside ``shard_map`` sums the
  gradient over the mesh axis on every call; accumulating that and reducing
  again would scale it by the axis size. Where the types carry no manual-axis
  information (pmap, ``check_vma=False``) nothing can be checked.
  """
  axes = set(_arrays.axis_names(axis_name))
  try:
    probe = [jax.lax.axis_index(a) for a in axes]
  except NameError:
    return
  if not all(axes & _arrays.varying_axes(p) for p in probe):
    return  # no manual-axis types here: nothing to check
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    if not axes <= _arrays.varying_axes(g):
      raise ValueError(
          f"The gradient at {_path_str(path)} is already reduced over"
          f" {axis_name!r} (it is the same on every device): inside shard_map,"
          " jax.grad with respect to replicated params sums over the devices on"
          " every micro-step, and `accumulate(..., axis_name=...)` would reduce"
          " it again. Differentiate with respect to"
          f" `jax.lax.pcast(params, {axis_name!r}, to='varying')` so each device"
          " accumulates its local gradient and the all-reduce runs once per window."
      )


def check_grads_unreduced(grads: Any, axes: tuple[Any, ...]) -> None:
  """Raises unless every gradient leaf is unreduced over exactly ``axes``."""
  want = frozenset(axes)
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    have = _arrays.unreduced_axes(g)
    if have == want:
      continue
    if not have:
      raise ValueError(
          f"The gradient at {_path_str(path)} is already reduced over {sorted(want)}"
          f" (its type {jax.typeof(g)} has no {{U:...}}): jax.grad with respect to"
          " replicated params reduces it on every micro-step, which is what"
          " `accumulate(..., axis_name=...)` under jit avoids. Take the gradients with"
          " `optax_accum.sharding.local_value_and_grad(loss,"
          f" {axis_name_repr(axes)})`."
      )
    raise ValueError(
        f"The gradient at {_path_str(path)} is unreduced over {sorted(have)} but the"
        f" accumulator reduces over {sorted(want)}. Pass the same axes to"
        " `local_value_and_grad` and to `accumulate(..., axis_name=...)`."
    )


def check_buffer_unreduced(buffer: Any, axes: tuple[Any, ...]) -> None:
  """Raises unless the accumulator was built (by ``init``) unreduced over ``axes``."""
  want = frozenset(axes)
  for path, b in jax.tree_util.tree_flatten_with_path(buffer)[0]:
    if _arrays.unreduced_axes(b) != want:
      raise ValueError(
          f"The accumulator at {_path_str(path)} is {jax.typeof(b)}, not unreduced over"
          f" {sorted(want)}: `init` ran outside the mesh. Call `tx.init(params)` (or"
          " jax.jit(tx.init)) inside `jax.set_mesh(mesh)`, or lay the state out with"
          " `jax.jit(tx.init, out_shardings=optax_accum.state_shardings(tx, params))`"
          " there."
      )


def check_grads_not_unreduced(grads: Any) -> None:
  """Raises if a gradient is unreduced but the accumulator has no axis to reduce it."""
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    have = _arrays.unreduced_axes(g)
    if have:
      raise ValueError(
          f"The gradient at {_path_str(path)} is unreduced over {sorted(have)} (each"
          " device holds a partial sum) but this accumulator was built without"
          f" `axis_name`: build it with `accumulate(..., axis_name={axis_name_repr(tuple(have))})`"
          " so the window is reduced once when it closes."
      )


def axis_name_repr(axes: tuple[Any, ...]) -> str:
  return repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))


def check_keywords(extra: dict[str, Any], strict: bool, where: str, own: tuple[str, ...]) -> None:
  """Raises on keyword arguments that would be silently ignored.

  With ``strict`` (the inner optimizer takes no extra arguments) every unknown
  keyword is an error. Otherwise unknown keywords may be meant for the inner
  optimizer (or, in a chain, for another member), but one that looks like a
  misspelling of our own (``emitnow``, ``wieght``) is still an error.
  """
  if not extra:
    return
  if strict:
    raise TypeError(
        f"Unknown keyword(s) {sorted(extra)} for {where}: it takes"
        f" {', '.join(f'`{o}=`' for o in own) or 'no keywords'} and the inner optimizer"
        " takes no extra arguments. Check the spelling."
    )
  for name in extra:
    close = difflib.get_close_matches(name, own, n=1, cutoff=0.7)
    if close:
      raise TypeError(
          f"Unknown keyword `{name}=` for {where}: did you mean `{close[0]}=`? (Extra"
          " keywords go to the inner optimizer, which would silently ignore it.)"
      )
