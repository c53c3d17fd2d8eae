"""Argument checks shared by the public transforms.

Every error names the argument at fault and says how to fix it.
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum import _arrays, _copies, _state

REDUCTIONS = ("mean", "sum", "weighted")

_INT32_MAX = 2**31 - 1


def check_update(
    config: Any, grads: Any, window: Any, *, weight: Any = None, emit_now: Any = False,
    flushing: bool = False,
) -> None:
  """Every check of an update's values: raises, converts nothing (:func:`update_values` does).

  The gradients must match the buffer's tree and shapes, fit its dtypes (no part of a
  value dropped: a complex gradient into a real buffer, or one wider than the buffer
  ``init`` built, float64 into float32, unless ``accumulator_dtype`` asked for it) and
  live where ``config.layout`` expects them (:func:`_check_placement`); under plain jit with
  ``axis_name`` every per-device leaf of ``window`` must hold one copy per device
  (:func:`_check_copies`). An integer param's gradient (``float0``) is not checked (it
  counts as zero), nor is a flush's (it carries no micro-batch). Each message names the
  tree path at fault and the fix. Call it inside the inputs' mesh (``_arrays.mesh_context``).
  """
  g_leaves, g_def = jax.tree_util.tree_flatten_with_path(grads)
  b_leaves, b_def = jax.tree_util.tree_flatten_with_path(window.acc_grads)
  if g_def != b_def:  # name the first path at which the trees differ
    paths = itertools.zip_longest([_path_str(p) for p, _ in g_leaves],
                                  [_path_str(p) for p, _ in b_leaves], fillvalue="nothing")
    first = next((f"{g} in the gradients, {b} in the state" for g, b in paths if g != b),
                 f"the node types (structures {g_def} vs {b_def})")
    raise ValueError(
        "The gradients tree does not match the accumulator built by `init(params)`: first"
        f" difference at {first}. Pass gradients with the same structure as the params given"
        " to `init`, or re-run `init` on the new params."
    )
  if flushing:
    return
  pairs = [(path, g, b) for (path, g), (_, b) in zip(g_leaves, b_leaves, strict=True)
           if not _is_float0(g)]  # (a float0 gradient counts as zero)
  stacked = config.layout.stacked  # plain jit: one copy per device of each per-device leaf
  if stacked is not None:
    _check_copies(window, stacked)
  for path, g, b in pairs:
    if stacked is not None:
      _check_stacked(_path_str(path), g, b, stacked)
    elif jnp.shape(g) != jnp.shape(b):
      lead = sorted(_arrays.leading_axes(g), key=str) if jnp.shape(g)[1:] == jnp.shape(b) else []
      raise ValueError(
          f"The gradients leaf at {_path_str(path)} has shape {jnp.shape(g)} but"
          f" the accumulator holds shape {jnp.shape(b)}. Pass gradients shaped"
          " like the params given to `init`." + (
              " (Or are these one copy per device, from"
              " `optax_accum.sharding.local_value_and_grad`? Then build the transform"
              f" with `accumulate(..., axis_name={_arrays.spec_entry(tuple(lead))!r})`.)"
              if lead else ""))
    _check_dtype(config, _path_str(path), jnp.result_type(g), jnp.result_type(b))
  check_weight(weight, config.reduction)
  if not isinstance(emit_now, (bool, np.bool_)) and jnp.ndim(emit_now) != 0:
    raise ValueError(
        "`emit_now` must be a scalar bool (close the window after this micro-batch or not); got"
        f" shape {jnp.shape(emit_now)}. Pass e.g. `emit_now=is_last_batch`."
    )
  _check_placement(config.layout, [(path, g) for path, g, _ in pairs])


def update_values(config: Any, grads: Any, window: Any, weight: Any, emit_now: Any,
                  flushing: bool) -> tuple[Any, jax.Array | None, Any]:
  """``(grads, weight, emit_now)`` as the window reads them, once :func:`check_update` (called
  here first) passed.

  An integer param's gradient (``float0``) counts as zero, and so does a flush's (it
  carries no micro-batch): zeros like the buffer (one copy per device under plain jit).
  Under plain jit with ``axis_name`` a partial sum typed unreduced comes back as its
  per-device copies (``_copies.stack``). The weight as float32 (a traced negative one
  as NaN: it cannot be checked, and acts like a non-finite gradient, skipped with
  ``skip_nonfinite=True``, else NaN in the update), ``emit_now`` as a bool.
  """
  check_update(config, grads, window, weight=weight, emit_now=emit_now, flushing=flushing)
  zeros = lambda b, dtype=None: _arrays.match_varying(jnp.zeros_like(b, dtype), b)
  if flushing:
    return jax.tree.map(lambda g, b: zeros(b, None if _is_float0(g) else jnp.result_type(g)),
                        grads, window.acc_grads), None, True
  grads = jax.tree.map(lambda g, b: zeros(b) if _is_float0(g) else g, grads, window.acc_grads)
  if config.layout.stacked is not None:
    grads = jax.tree.map(lambda g: _copies.stack(g, config.layout.stacked), grads)
  emit_now = bool(emit_now) if isinstance(emit_now, (bool, np.bool_)) else jnp.asarray(
      emit_now).astype(jnp.bool_)
  if weight is not None:
    weight = jnp.asarray(weight, jnp.float32)
    weight = jnp.where(weight < 0, jnp.nan, weight)
  return grads, weight, emit_now


def _is_float0(x: Any) -> bool:
  return getattr(x, "dtype", None) == jax.dtypes.float0


def _check_dtype(config: Any, path: str, g_dtype: Any, b_dtype: Any) -> None:
  """Raises if a gradient of ``g_dtype`` would lose part of its value in the buffer."""
  if jnp.issubdtype(g_dtype, jnp.complexfloating) and not jnp.issubdtype(
      b_dtype, jnp.complexfloating):
    raise TypeError(
        f"The gradient at {path} is {g_dtype} but the accumulator is {b_dtype}: the imaginary part"
        " would be dropped. Build the transform with a complex `accumulator_dtype` (or None, the"
        " default, and complex params)."
    )
  if config.acc_dtype is None and _arrays.promote_types(g_dtype, b_dtype) != b_dtype:
    raise TypeError(
        f"The gradient at {path} is {g_dtype}, wider than the {b_dtype} accumulator that `init`"
        " built from the params: it would lose precision. Pass `accumulator_dtype` explicitly (a"
        " narrower one is then accepted), or init with params of the gradients' dtype."
    )


def _check_copies(window: Any, axes: tuple[Any, ...]) -> None:
  """Raises unless each per-device leaf of ``window`` holds one copy per device over ``axes``.

  Under plain jit the weight total is a global scalar (the weight is given whole).
  """
  n = _arrays.device_count(axes)
  where = f"`axis_name={_arrays.spec_entry(axes)!r}`"
  for path, b in _state.leaves(window, skip=("acc_weight",)):
    if jnp.ndim(b) == 0 or jnp.shape(b)[0] != n:
      raise ValueError(
          f"The accumulator at {_path_str(path)} has shape {jnp.shape(b)}: it is not one copy"
          f" per device for the {n} device(s) of {where}. A state saved on another number of"
          " devices must be laid out for this mesh first:"
          " `state = optax_accum.sharding.reshard_state(restored, tx.init(params))`.")
    # (copies of size 0 are replicated)
    if set(_arrays.leading_axes(b)) != set(axes) and jnp.size(b):
      raise ValueError(
          f"The accumulator at {_path_str(path)} is {jax.typeof(b)}, not sharded over {where} along"
          " its leading dim (one copy per device). Place a restored state as `init` lays it out:"
          " `jax.device_put(restored, optax_accum.sharding.state_shardings(tx, params))`, and call"
          " `tx.init` inside the mesh (`jax.set_mesh`, or params placed on it).")


def _check_stacked(path: str, g: Any, b: Any, axes: tuple[Any, ...]) -> None:
  """Raises unless ``g`` fits the buffer ``b`` of plain jit with ``axis_name``.

  ``b`` holds one copy per device along a leading dim sharded over the data
  ``axes`` (:func:`_check_copies`); ``g`` is such copies too
  (``local_value_and_grad``) or a partial sum typed unreduced over ``axes``
  (``defer_reduction``).
  """
  where = f"`axis_name={_arrays.spec_entry(axes)!r}`"
  unreduced = _arrays.array_type(g).unreduced
  if unreduced and unreduced != set(axes):
    raise ValueError(
        f"The gradient at {path} is unreduced over {sorted(unreduced, key=str)} but the"
        f" accumulator reduces over {where}. Pass the same axes to `defer_reduction`"
        " and to `accumulate(..., axis_name=...)`.")
  if jnp.shape(g) == jnp.shape(b)[1:]:  # one copy's shape: a partial sum, or the whole gradient
    if unreduced:
      return
    raise ValueError(
        f"The gradient at {path} is already reduced over {where} (its type"
        f" {jax.typeof(g)} is the whole gradient): jax.grad with respect to replicated"
        " params reduces it on every micro-step, which is what `accumulate(...,"
        " axis_name=...)` under jit avoids. Take the gradients with"
        f" `optax_accum.sharding.local_value_and_grad(loss, {_arrays.spec_entry(axes)!r})`.")
  if jnp.shape(g) != jnp.shape(b) or (
      set(_arrays.leading_axes(g)) != set(axes) and jnp.size(g)):
    raise ValueError(
        f"The gradients leaf at {path} has shape {jnp.shape(g)} ({jax.typeof(g)}) but the"
        f" accumulator holds one copy per device, {jnp.shape(b)}. Pass the gradients of"
        " `optax_accum.sharding.local_value_and_grad` (one copy per device) or of"
        " `defer_reduction` (typed unreduced), for the params given to `init`.")


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
        f"`{name}`={k} does not fit the int32 step counters (at most {_INT32_MAX}). Use a smaller"
        " window, or flush windows with `emit_now=True`."
    )
  return int(k)


def check_schedule_value(value: Any, step: Any) -> jax.Array:
  """A ``k`` schedule's ``value`` as an int32 window length; raises if it is a concrete value
  below 1 (under jit: clamped to 1)."""
  if not isinstance(value, jax.core.Tracer):
    concrete = int(jnp.asarray(value))
    if concrete < 1:
      raise ValueError(
          f"The `k` schedule returned {concrete} at gradient_step {int(step)}; a window needs"
          " at least 1 micro-batch. Make the schedule return an int >= 1 for every step."
          " (Under jit such values are clamped to 1.)"
      )
  return jnp.maximum(jnp.asarray(value).astype(jnp.int32), 1)


def check_flag(value: Any, name: str) -> bool:
  """Returns ``value`` as a Python bool if it is a bool (numpy's too), else raises."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"`{name}` must be a bool; got {value!r}.")
  return bool(value)


def check_argnums(argnums: Any, name: str, *, empty_ok: bool = False) -> tuple[int, ...]:
  """``argnums`` (an int or a sequence of ints: positions of arguments) as a tuple, else raises."""
  nums = argnums if isinstance(argnums, Sequence) and not isinstance(argnums, str) else (argnums,)
  if not all(isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in nums):
    raise TypeError(
        f"`{name}` must be an int or a sequence of ints (positions of the function's"
        f" arguments); got {argnums!r}. Pass e.g. `{name}=1`."
    )
  if not nums and not empty_ok:
    raise ValueError(f"`{name}` is empty; name at least one argument by its position.")
  return tuple(int(a) for a in nums)


def check_optimizer(optimizer: Any, name: str = "optimizer") -> None:
  """Raises unless ``optimizer`` is None or an optax transformation."""
  if optimizer is None or (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
    return
  if callable(optimizer):
    what = getattr(optimizer, "__name__", repr(optimizer))
    raise TypeError(
        f"`{name}` must be an optax GradientTransformation such as optax.adam(1e-3); got the"
        f" function {what} itself. Call it with its hyperparameters, e.g. {what}(1e-3)."
    )
  raise TypeError(
      f"`{name}` must be an optax GradientTransformation (with `init` and"
      f" `update`), such as optax.adam(1e-3); got {type(optimizer).__name__}."
  )


def check_weight(weight: Any, reduction: str) -> None:
  """Raises unless ``weight`` suits ``reduction``: for "weighted" a scalar, not negative.

  A traced negative weight cannot be checked (:func:`update_values` makes it NaN).
  """
  if reduction != "weighted":
    if weight is not None:
      raise ValueError(
          f"`weight` was given but reduction={reduction!r} ignores it. Build"
          " the transform with `accumulate(k, ..., reduction='weighted')`."
      )
  elif weight is None:
    raise ValueError(
        "reduction='weighted' needs a per-micro-batch weight: call `update(grads, state, params,"
        " weight=w)` with w e.g. the number of real tokens in the micro-batch."
    )
  elif jnp.ndim(weight) != 0:
    raise ValueError(
        "`weight` must be a scalar (one weight per micro-batch); got shape"
        f" {jnp.shape(weight)}. Pass e.g. the micro-batch's token count."
    )
  elif not isinstance(weight, jax.core.Tracer) and float(np.asarray(weight)) < 0:
    raise ValueError(
        f"`weight` must be >= 0 (e.g. a count of real tokens); got {float(np.asarray(weight))}."
        " A negative weight has no meaning in a weighted mean."
    )


def check_no_float0(grads: Any, where: str = "gradient") -> None:
  """Raises on a ``float0`` leaf: the cotangent of an integer leaf (``allow_int=True``).

  ``microbatched`` sums its function's gradients, and nothing can be summed
  on ``float0`` (``accumulate`` counts it as zero instead).
  """
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    if _is_float0(g):
      raise TypeError(
          f"The {where} at {_path_str(path)} has dtype float0: it is the cotangent of an integer"
          " leaf (jax.grad(..., allow_int=True)), which `microbatched` cannot sum. Leave integer"
          " leaves out of what you differentiate: split them off first, e.g. `params, static ="
          " eqx.partition(model, eqx.is_inexact_array)`, and differentiate `params`."
      )


def has_window(node: Any) -> bool:
  """Whether ``node`` is a window's state: ``AccumulateState``, ``optax.MultiStepsState``."""
  return hasattr(node, "mini_step") and hasattr(node, "gradient_step")


class Flush:
  """What :func:`~optax_accum.flush` passes as ``flush=True``: ``taken`` once a window of ours
  reads it (a transform that passes it on, ``optax.MultiSteps``, or ignores it, leaves it)."""

  taken = False

  def __bool__(self) -> bool:
    return True


def check_flush(value: Any) -> bool:
  """``update``'s ``flush``, read by a window of ours: :func:`check_flag`'s bool, and a
  :class:`Flush` flag marked ``taken``."""
  if isinstance(value, Flush):
    value.taken = True
    return True
  return check_flag(value, "flush")


def check_flushed(flag: Flush) -> None:
  """Raises unless a window of ours closed on ``flag``: any other transform took a step on
  zero gradients, or (``optax.MultiSteps``) counted them as a micro-batch."""
  if not flag.taken:
    raise TypeError(
        "`flush` closes the window of `optax_accum.accumulate` or `optax_accum.MultiSteps`, and"
        " this transform holds neither: it would take a step on zero gradients (or count them as"
        " a micro-batch). Write `optax_accum.accumulate(k, opt)` around the optimizer, or"
        " `optax_accum.MultiSteps(opt, k)` for `optax.MultiSteps(opt, k)` (its drop-in).")


def check_choice(value: Any, name: str, choices: tuple[str, ...], hint: str) -> str:
  """``value`` if it is one of ``choices``, else raises naming ``name`` and ``hint``."""
  if value not in choices:
    raise ValueError(f"`{name}` must be one of {choices}; got {value!r}. {hint}")
  return value


def check_accumulator_dtype(dtype: Any) -> jnp.dtype | None:
  """Returns ``dtype`` canonicalised, or None (the default rule), else raises."""
  if dtype is None:
    return None
  try:
    canonical = jnp.dtype(dtype)
  except TypeError:
    canonical = None
  if canonical is None or not jnp.issubdtype(canonical, jnp.inexact):
    raise TypeError(
        "`accumulator_dtype` must be a floating or complex dtype such as jnp.float32, or"
        f" None for the default rule; got {repr(dtype) if canonical is None else canonical}."
    )
  return canonical


def _path_str(path: tuple[Any, ...]) -> str:
  return jax.tree_util.keystr(path) or "<root>"


def _check_placement(layout: _arrays.Layout, g_leaves: list[Any]) -> None:
  """Raises unless the gradients live where ``layout`` expects them: their types say it.

  Without ``axis_name`` no gradient is a per-device partial sum. Inside a checked
  ``shard_map`` each is device-local: ``jax.grad`` with respect to replicated params
  there sums the gradient over the mesh axis on every call, and accumulating that and
  reducing again would scale it by the axis size. Where the types carry no manual-axis
  information (pmap, ``check_vma=False``) nothing can be checked. (Plain jit:
  :func:`_check_stacked`.)
  """
  if layout.axis_name is None:
    for path, g in g_leaves:
      have = _arrays.array_type(g).unreduced
      if have:
        names = sorted(have, key=str)
        raise ValueError(
            f"The gradient at {_path_str(path)} is unreduced over {names} (each device holds a"
            " partial sum) but this accumulator was built without `axis_name`: build it with"
            f" `accumulate(..., axis_name={names[0] if len(names) == 1 else tuple(names)!r})` so"
            " the window is reduced once when it closes."
        )
  elif layout.manual:  # shard_map / pmap
    names = set(_arrays.axis_names(layout.axis_name))
    probe = _arrays.axis_indices(tuple(names))
    if probe is None or not all(names & _arrays.array_type(p).varying for p in probe):
      return  # no manual-axis types here: nothing to check
    for path, g in g_leaves:
      if not names <= _arrays.array_type(g).varying:
        raise ValueError(
            f"The gradient at {_path_str(path)} is already reduced over"
            f" {layout.axis_name!r} (it is the same on every device): inside shard_map,"
            " jax.grad with respect to replicated params sums over the devices on"
            " every micro-step, and `accumulate(..., axis_name=...)` would reduce"
            " it again. Differentiate with respect to"
            f" `jax.lax.pcast(params, {layout.axis_name!r}, to='varying')` so each device"
            " accumulates its local gradient and the all-reduce runs once per window."
        )


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
