"""Gradient accumulation across calls as an Optax transformation.

``accumulate(k, optimizer)`` sums the gradients of ``k`` micro-batches into a
zero-initialised buffer and runs ``optimizer`` once per window, on the reduced
gradient, inside a ``lax.cond``. It is the exact large-batch step for any
optimizer: the inner optimizer never sees a micro-step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_accum import _validation

KSchedule = Callable[[jax.Array], Any]


class AccumulateState(NamedTuple):
  """State of :func:`accumulate`.

  Attributes:
    mini_step: micro-batches accepted in the current window (int32).
    gradient_step: windows closed so far, i.e. optimizer steps (int32).
    acc_grads: the accumulation buffer, a pytree like the params. It holds the
      running sum of the current window while ``mini_step > 0``; when
      ``mini_step == 0`` its contents are stale (the last window's sum, kept
      for inspection) and the next accepted micro-batch overwrites them. This
      lazy reset saves a full pass over the buffer per window.
    acc_weight: sum of the weights seen in the current window (float32; only
      used by ``reduction="weighted"``).
    num_skipped: non-finite micro-batches dropped so far (int32; only counts
      with ``skip_nonfinite=True``).
    emitted: whether the last call closed a window (bool).
    inner_opt_state: the state of the inner optimizer (``()`` without one).
  """

  mini_step: jax.Array
  gradient_step: jax.Array
  acc_grads: optax.Updates
  acc_weight: jax.Array
  num_skipped: jax.Array
  emitted: jax.Array
  inner_opt_state: optax.OptState


def has_updated(state: Any) -> jax.Array:
  """Whether the last ``update`` call closed a window and emitted an update.

  Works for :class:`AccumulateState`, :class:`~optax_accum.MultiStepsState`
  and ``optax.MultiStepsState``, and for states that hold one of these (such as
  an ``optax.chain`` state): the first one found is used.

  Example:
    >>> import jax.numpy as jnp, optax, optax_accum as oa
    >>> tx = oa.accumulate(2, optax.sgd(0.1))
    >>> params = {"w": jnp.zeros(3)}
    >>> state = tx.init(params)
    >>> _, state = tx.update({"w": jnp.ones(3)}, state, params)
    >>> bool(oa.has_updated(state))
    False
    >>> _, state = tx.update({"w": jnp.ones(3)}, state, params)
    >>> bool(oa.has_updated(state))
    True
  """
  found = _find_accumulation_state(state)
  if found is None:
    raise TypeError(
        "`has_updated` needs the state of `accumulate` or `MultiSteps` (or a"
        f" tuple holding one); got {type(state).__name__}."
    )
  # jnp.asarray unwraps containers such as Flax NNX's optimizer variables.
  if isinstance(found, AccumulateState):
    return jnp.asarray(found.emitted)
  return jnp.logical_and(jnp.asarray(found.mini_step) == 0, jnp.asarray(found.gradient_step) > 0)


def _find_accumulation_state(state: Any) -> Any:
  if isinstance(state, AccumulateState):
    return state
  if hasattr(state, "mini_step") and hasattr(state, "gradient_step"):
    return state
  if isinstance(state, (tuple, list)):
    for sub in state:
      found = _find_accumulation_state(sub)
      if found is not None:
        return found
  return None


def _resolve_k(k: int | KSchedule, gradient_step: jax.Array) -> jax.Array:
  """The window length for ``gradient_step``, checked when concrete."""
  if isinstance(k, int):
    return jnp.asarray(k, jnp.int32)
  value = k(gradient_step)
  if not isinstance(value, jax.core.Tracer):
    concrete = int(jnp.asarray(value))
    if concrete < 1:
      raise ValueError(
          f"The `k` schedule returned {concrete} at gradient_step"
          f" {int(gradient_step)}; a window needs at least 1 micro-batch. Make"
          " the schedule return an int >= 1 for every step. (Under jit such"
          " values are clamped to 1.)"
      )
  return jnp.maximum(jnp.asarray(value).astype(jnp.int32), 1)


def all_finite(tree: Any) -> jax.Array:
  """True iff every leaf of ``tree`` is free of NaN and Inf (a bool scalar).

  The same test ``accumulate(..., skip_nonfinite=True)`` applies.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_accum import all_finite
    >>> bool(all_finite({"a": jnp.ones(2)})), bool(all_finite({"a": jnp.array([1., jnp.inf])}))
    (True, False)
  """
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  if not leaves:
    return jnp.asarray(True)
  return jnp.stack(leaves).all()


class _StepOut(NamedTuple):
  updates: optax.Updates  # or the new params, with ``apply_to_params=True``
  acc_grads: optax.Updates
  acc_weight: jax.Array
  mini_step: jax.Array
  gradient_step: jax.Array
  inner_opt_state: optax.OptState
  emitted: jax.Array


def _cast_like(new: Any, old: Any) -> Any:
  if hasattr(new, "dtype") and hasattr(old, "dtype") and new.dtype != old.dtype:
    return new.astype(old.dtype)
  return new


def _zeros_like_shapes(shapes: Any) -> Any:
  return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)


def accumulation_step(
    grads: optax.Updates,
    *,
    acc_grads: optax.Updates,
    acc_weight: jax.Array,
    mini_step: jax.Array,
    gradient_step: jax.Array,
    inner_opt_state: optax.OptState,
    params: optax.Params | None,
    k: int | KSchedule,
    inner: optax.GradientTransformationExtraArgs | None,
    reduction: str,
    weight: jax.Array | None,
    accept: jax.Array | None,
    axis_name: Any,
    extra_args: dict[str, Any],
    emit_now: Any = False,
    apply_to_params: bool = False,
) -> _StepOut:
  """One micro-step of accumulation; shared by `accumulate` and `MultiSteps`.

  ``accept`` (a bool scalar, or None for always) says whether this micro-batch
  counts. A rejected one leaves every buffer and counter as it was.

  The buffer is reset lazily: its contents only count while ``mini_step > 0``.
  The first micro-batch of a window overwrites it (``where(mini_step == 0, 0,
  acc) + g``, one fused pass), so no step ever spends a separate pass zeroing
  it, and a NaN left by a past window is discarded by a select, never
  multiplied. The ``lax.cond`` then only reads the buffer: XLA updates it in
  place with no copy (a branch that wrote it would force one; see
  benchmarks/NOTES.md).
  """
  k_now = _resolve_k(k, gradient_step)
  weighted = reduction == "weighted"
  stale = mini_step == 0
  if weighted:
    w = jnp.asarray(weight, jnp.float32)
    new_weight = acc_weight + w  # acc_weight is reset eagerly (a scalar)
  else:
    w = None
    new_weight = acc_weight

  def add(acc, g):
    g = g.astype(acc.dtype)
    if w is not None:
      # A zero-weight micro-batch (e.g. all padding, whose mean loss is 0/0)
      # must contribute nothing, even if its gradient is NaN.
      g = jnp.where(w != 0, g * w.astype(acc.dtype), jnp.zeros((), acc.dtype))
    new = jnp.where(stale, jnp.zeros((), acc.dtype), acc) + g
    if accept is not None:
      new = jnp.where(accept, new, acc)
    return new

  new_acc = jax.tree.map(add, acc_grads, grads)
  if accept is not None:
    new_weight = jnp.where(accept, new_weight, acc_weight)
    count = mini_step + accept.astype(mini_step.dtype)
    emit = jnp.logical_and(count > 0, jnp.logical_or(count >= k_now, emit_now))
    emit = jnp.logical_and(emit, jnp.logical_or(accept, emit_now))
  else:
    count = mini_step + 1
    emit = count >= k_now
    if emit_now is not False:
      emit = jnp.logical_or(emit, emit_now)

  def reduce_window(acc, total_weight, count):
    if axis_name is not None:
      acc = lax.psum(acc, axis_name)
    if reduction == "mean":
      denom = count.astype(jnp.float32)
      if axis_name is not None:
        denom = denom * lax.psum(1, axis_name)
    elif reduction == "sum":
      denom = None
    else:
      if axis_name is not None:
        total_weight = lax.psum(total_weight, axis_name)
      denom = jnp.where(total_weight == 0, 1.0, total_weight)

    # A scalar reciprocal, not a divide: XLA then fuses the scaling into each
    # consumer (e.g. both of Adam's moment updates) instead of materialising
    # acc / count as a separate parameter-sized array (benchmarks/NOTES.md).
    inv = None if denom is None else 1.0 / denom

    def finish(a, g):
      if inv is not None:
        a = a * inv.astype(a.dtype)
      return a.astype(g.dtype)

    return jax.tree.map(finish, acc, grads), total_weight

  def inner_update(reduced, inner_state, params):
    if inner is None:
      return reduced, inner_state
    updates, new_state = inner.update(reduced, inner_state, params, **extra_args)
    # Some optimizers promote their state (e.g. Adam's f16 moments on bf16
    # gradients become f32). Both cond branches must agree, and a state whose
    # dtype drifts breaks lax.scan, so it keeps the dtypes it was created with.
    new_state = jax.tree.map(_cast_like, new_state, inner_state)
    return updates, new_state

  def emit_branch(acc, total_weight, count, inner_state, params):
    reduced, total_weight = reduce_window(acc, total_weight, count)
    if weighted and inner is not None and axis_name is not None:
      # A window without a single real token anywhere: no step, no state
      # change. (Without an axis this test is folded into the outer cond.)
      shapes = jax.eval_shape(inner_update, reduced, inner_state, params)[0]
      updates, new_inner = lax.cond(
          total_weight > 0,
          inner_update,
          lambda r, s, p: (_zeros_like_shapes(shapes), s),
          reduced, inner_state, params,
      )
    else:
      updates, new_inner = inner_update(reduced, inner_state, params)
    if apply_to_params:
      return optax.apply_updates(params, updates), new_inner
    return updates, new_inner

  update_shapes = jax.eval_shape(
      emit_branch, new_acc, new_weight, count, inner_opt_state, params)[0]

  def mid_branch(acc, total_weight, count, inner_state, params):
    del acc, total_weight, count
    if apply_to_params:
      return params, inner_state
    return _zeros_like_shapes(update_shapes), inner_state

  run_inner = emit
  if weighted and inner is not None and axis_name is None:
    run_inner = jnp.logical_and(emit, new_weight > 0)
  updates, out_inner = lax.cond(
      run_inner, emit_branch, mid_branch,
      new_acc, new_weight, count, inner_opt_state, params)
  return _StepOut(
      updates=updates,
      acc_grads=new_acc,
      acc_weight=jnp.where(emit, jnp.zeros_like(new_weight), new_weight),
      mini_step=jnp.where(emit, jnp.zeros_like(count), count),
      gradient_step=gradient_step + emit.astype(gradient_step.dtype),
      inner_opt_state=out_inner,
      emitted=emit,
  )


def init_buffer(params: optax.Params, dtype: jnp.dtype | None) -> optax.Updates:
  """A zero buffer like ``params`` (same shapes and shardings)."""
  def zeros(p):
    return jnp.zeros_like(p, dtype=dtype if dtype is not None else jnp.result_type(p))
  return jax.tree.map(zeros, params)


def accumulate(
    k: int | KSchedule,
    optimizer: optax.GradientTransformation | None = None,
    *,
    reduction: str = "mean",
    accumulator_dtype: Any = jnp.float32,
    skip_nonfinite: bool = False,
    axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Accumulates ``k`` micro-batch gradients, then takes one optimizer step.

  Each call adds the incoming gradients to a zero-initialised buffer. Every
  ``k``-th call closes the window: the buffer is reduced (see ``reduction``),
  cast to the gradients' dtype and, if ``optimizer`` is given, handed to it;
  the next window starts from zeros (the first micro-batch overwrites the
  buffer in the same fused pass as the add; see ``AccumulateState``). The
  switch is a ``lax.cond`` on the
  micro-step count, so the inner optimizer runs **only** on emitting steps:
  its state, step counter and schedules advance once per window, exactly as in
  large-batch training. Mid-steps return zeros.

  Two forms:

  * ``accumulate(k, optimizer)`` — the exact large-batch step for any
    optimizer. Prefer this form.
  * ``optax.chain(accumulate(k), optimizer)`` — emits the reduced gradient
    every ``k``-th call and zeros otherwise. Stateless transforms after it
    (``sgd`` without momentum, ``scale``) then behave exactly; **stateful ones
    still step on the zeros** of every mid-step (Adam's moments decay and its
    bias-correction count advances, ``clip_by_global_norm`` sees zeros), so
    the result is not large-batch training. Put such optimizers inside:
    ``accumulate(k, optax.chain(clip, adam))``.

  Args:
    k: micro-batches per optimizer step: a positive int, or a schedule
      ``f(gradient_step) -> int`` (e.g. a batch-size ramp). A schedule is
      evaluated on the traced step count, so changing values never
      recompiles. A concrete value below 1 raises ``ValueError``; under
      ``jit`` the value cannot be checked and is clamped to 1.
    optimizer: the inner optimizer, run once per window. ``None`` gives the
      chain form described above.
    reduction: ``"mean"`` (sum / k), ``"sum"``, or ``"weighted"``: then
      ``update(..., weight=w)`` takes a per-micro-batch weight (e.g. its count
      of real tokens) and the window emits :math:`\sum_i w_i g_i / \sum_i w_i`.
      A micro-batch of weight 0 contributes nothing, even a NaN gradient; a
      window of total weight 0 emits zeros and leaves the inner optimizer's
      state untouched.
    accumulator_dtype: dtype of the buffer (default float32, so bf16/f16
      gradients are summed without losing the signal). ``None`` uses each
      parameter's dtype.
    skip_nonfinite: if True, a micro-batch with any NaN/Inf gradient (or
      weight) is dropped: it does not count toward ``k``, changes no buffer
      and increments ``state.num_skipped``. If False, a non-finite gradient
      reaches the emitted update (as it would in large-batch training), but
      the next window discards the buffer with a select (never ``0 * acc``),
      so it never poisons a later window.
    axis_name: a ``pmap``/``shard_map`` axis name (or tuple of names). Each
      device accumulates its local gradients; the cross-device reduction runs
      once per window, inside the emitting branch. With ``skip_nonfinite`` the
      devices agree on the skip with one scalar reduction per micro-step.

  Returns:
    An ``optax.GradientTransformationExtraArgs``. ``update(grads, state,
    params=None, *, weight=None, emit_now=False, **extra_args)``:
    ``emit_now=True`` (a Python or traced bool) closes the window after this
    micro-batch even if it holds fewer than ``k`` (the mean then divides by
    the micro-batches actually accumulated) — use it on the last batch of an
    epoch to flush a partial window. ``extra_args`` go to the inner optimizer
    (e.g. ``value=`` for ``optax.contrib.reduce_on_plateau``).

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_accum as oa
    >>> tx = oa.accumulate(4, optax.adam(1e-2))
    >>> params = {"w": jnp.ones(3)}
    >>> state = tx.init(params)
    >>> step = jax.jit(tx.update)
    >>> for i in range(4):
    ...   updates, state = step({"w": jnp.full(3, float(i))}, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> int(state.gradient_step), bool(oa.has_updated(state))
    (1, True)
    >>> # Equal to one Adam step on the mean gradient (1.5):
    >>> ref = optax.adam(1e-2)
    >>> u, _ = ref.update({"w": jnp.full(3, 1.5)}, ref.init({"w": jnp.ones(3)}))
    >>> bool(jnp.allclose(params["w"], 1 + u["w"]))
    True
  """
  k = _validation.check_k(k)
  reduction = _validation.check_reduction(reduction)
  acc_dtype = _validation.check_accumulator_dtype(accumulator_dtype)
  if not isinstance(skip_nonfinite, bool):
    raise TypeError(f"`skip_nonfinite` must be a bool; got {skip_nonfinite!r}.")
  if not isinstance(k, int):
    _check_schedule_at_zero(k)
  accumulator = _Accumulator(
      k=k,
      inner=None if optimizer is None else optax.with_extra_args_support(optimizer),
      reduction=reduction,
      acc_dtype=acc_dtype,
      skip_nonfinite=skip_nonfinite,
      axis_name=axis_name,
  )
  return optax.GradientTransformationExtraArgs(accumulator.init, accumulator.update)


class _Accumulator:
  """The configuration behind one :func:`accumulate` transform."""

  def __init__(self, *, k, inner, reduction, acc_dtype, skip_nonfinite, axis_name):
    self.k = k
    self.inner = inner
    self.reduction = reduction
    self.acc_dtype = acc_dtype
    self.skip_nonfinite = skip_nonfinite
    self.axis_name = axis_name

  def init(self, params: optax.Params) -> AccumulateState:
    return AccumulateState(
        mini_step=jnp.zeros([], jnp.int32),
        gradient_step=jnp.zeros([], jnp.int32),
        acc_grads=init_buffer(params, self.acc_dtype),
        acc_weight=jnp.zeros([], jnp.float32),
        num_skipped=jnp.zeros([], jnp.int32),
        emitted=jnp.zeros([], jnp.bool_),
        inner_opt_state=() if self.inner is None else self.inner.init(params),
    )

  def update(
      self,
      updates: optax.Updates,
      state: AccumulateState,
      params: optax.Params | None = None,
      *,
      weight: Any = None,
      emit_now: Any = False,
      **extra_args: Any,
  ) -> tuple[optax.Updates, AccumulateState]:
    return self._step(updates, state, params, weight, emit_now, extra_args, False)

  def flush(
      self, state: AccumulateState, params: optax.Params, **extra_args: Any
  ) -> tuple[optax.Updates, AccumulateState]:
    zeros = jax.tree.map(jnp.zeros_like, params)
    weight = 0.0 if self.reduction == "weighted" else None
    return self._step(zeros, state, params, weight, True, extra_args, False, count_this=False)

  def update_and_apply(
      self,
      grads: optax.Updates,
      state: AccumulateState,
      params: optax.Params,
      *,
      weight: Any = None,
      emit_now: Any = False,
      **extra_args: Any,
  ) -> tuple[optax.Params, AccumulateState]:
    return self._step(grads, state, params, weight, emit_now, extra_args, True)

  def _step(self, updates, state, params, weight, emit_now, extra_args, apply_to_params,
            count_this=True):
    if not isinstance(state, AccumulateState):
      raise TypeError(
          "`state` must be the AccumulateState returned by this transform's"
          f" `init`; got {type(state).__name__}."
      )
    _validation.check_tree_matches(updates, state.acc_grads)
    if self.axis_name is not None and count_this:
      _validation.check_grads_are_local(updates, self.axis_name)
    if self.reduction == "weighted" and weight is None:
      raise ValueError(
          "reduction='weighted' needs a per-micro-batch weight: call"
          " `update(grads, state, params, weight=w)` with w e.g. the number of"
          " real tokens in the micro-batch."
      )
    if self.reduction != "weighted" and weight is not None:
      raise ValueError(
          f"`weight` was given but reduction={self.reduction!r} ignores it. Build"
          " the transform with `accumulate(k, ..., reduction='weighted')`."
      )
    if weight is not None and jnp.ndim(weight) != 0:
      raise ValueError(
          f"`weight` must be a scalar (one weight per micro-batch); got shape"
          f" {jnp.shape(weight)}. Pass e.g. the micro-batch's token count."
      )
    accept = None
    num_skipped = state.num_skipped
    if not count_this:
      accept = jnp.zeros([], jnp.bool_)
    elif self.skip_nonfinite:
      accept = all_finite(updates)
      if weight is not None:
        accept = jnp.logical_and(accept, jnp.isfinite(weight))
      if self.axis_name is not None:
        accept = lax.pmin(accept.astype(jnp.int32), self.axis_name).astype(jnp.bool_)
      num_skipped = num_skipped + jnp.logical_not(accept).astype(jnp.int32)
    out = accumulation_step(
        updates,
        acc_grads=state.acc_grads,
        acc_weight=state.acc_weight,
        mini_step=state.mini_step,
        gradient_step=state.gradient_step,
        inner_opt_state=state.inner_opt_state,
        params=params,
        k=self.k,
        inner=self.inner,
        reduction=self.reduction,
        weight=weight,
        accept=accept,
        axis_name=self.axis_name,
        extra_args=extra_args,
        emit_now=emit_now,
        apply_to_params=apply_to_params,
    )
    new_state = AccumulateState(
        mini_step=out.mini_step,
        gradient_step=out.gradient_step,
        acc_grads=out.acc_grads,
        acc_weight=out.acc_weight,
        num_skipped=num_skipped,
        emitted=out.emitted,
        inner_opt_state=out.inner_opt_state,
    )
    return out.updates, new_state


def flush(
    tx: optax.GradientTransformation,
    state: AccumulateState,
    params: optax.Params,
    **extra_args: Any,
) -> tuple[optax.Updates, AccumulateState]:
  """Closes the open window now, without a new micro-batch.

  For the end of an epoch or of training when the last micro-batch has
  already been passed to ``update``: the micro-batches waiting in the buffer
  become one optimizer step (the mean divides by how many there are). With an
  empty window nothing happens: zero updates, state unchanged. Use
  ``update(..., emit_now=True)`` instead when you know in advance which
  micro-batch is the last.

  Args:
    tx: a transform built by :func:`accumulate`.
    state: its state.
    params: the current params (they also give the updates' dtypes).
    **extra_args: passed to the inner optimizer.

  Returns:
    ``(updates, new_state)``, as from ``tx.update``.

  Example:
    >>> import jax.numpy as jnp, optax, optax_accum as oa
    >>> tx = oa.accumulate(4, optax.sgd(1.0))
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> _, state = tx.update({"w": jnp.full(2, 2.0)}, state, params)
    >>> _, state = tx.update({"w": jnp.full(2, 4.0)}, state, params)
    >>> updates, state = oa.flush(tx, state, params)   # mean of the 2 waiting
    >>> updates["w"].tolist(), int(state.gradient_step), int(state.mini_step)
    ([-3.0, -3.0], 1, 0)
  """
  return _accumulator_of(tx, "flush").flush(state, params, **extra_args)


def _accumulator_of(tx: optax.GradientTransformation, name: str) -> _Accumulator:
  accumulator = getattr(tx.update, "__self__", None)
  if not isinstance(accumulator, _Accumulator):
    raise TypeError(
        f"`{name}` needs a transform returned by `optax_accum.accumulate`"
        f" (its `update` is {tx.update!r}). For a chain, put the chain inside:"
        " `accumulate(k, optax.chain(...))`."
    )
  return accumulator


def update_and_apply(
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    state: AccumulateState,
    params: optax.Params,
    **kwargs: Any,
) -> tuple[optax.Params, AccumulateState]:
  """``tx.update`` and ``optax.apply_updates`` fused inside the window's cond.

  The optax protocol returns an update on every call, so a mid-step must
  write a tree of zeros and the caller's ``apply_updates`` must read the
  params, read the zeros and write the params back: three parameter-sized
  passes for nothing. This helper applies the update inside the emitting
  branch instead; on mid-steps the params pass through the ``lax.cond``
  untouched (no copy when they are donated), so a mid-step costs only the
  buffer update ``acc += g``. Results are identical to ``tx.update`` followed
  by ``optax.apply_updates``.

  Args:
    tx: a transform built by :func:`accumulate` (not a chain holding one).
    grads: this micro-batch's gradients.
    state: the transform's state.
    params: the current params (donate them to the jitted step).
    **kwargs: ``weight``, ``emit_now`` and extra args, as for ``tx.update``.

  Returns:
    ``(new_params, new_state)``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_accum as oa
    >>> tx = oa.accumulate(2, optax.sgd(0.5))
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> step = jax.jit(lambda g, s, p: oa.update_and_apply(tx, g, s, p))
    >>> params, state = step({"w": jnp.ones(2)}, state, params)
    >>> params["w"].tolist()
    [0.0, 0.0]
    >>> params, state = step({"w": jnp.full(2, 3.0)}, state, params)
    >>> params["w"].tolist()
    [-1.0, -1.0]
  """
  accumulator = _accumulator_of(tx, "update_and_apply")
  return accumulator.update_and_apply(grads, state, params, **kwargs)


def _check_schedule_at_zero(schedule: KSchedule) -> None:
  """Evaluates a schedule at step 0 to catch obviously wrong ones early."""
  try:
    value = schedule(jnp.zeros([], jnp.int32))
    concrete = int(jnp.asarray(value))
  except Exception as e:  # the schedule may only work on traced values
    warnings.warn(
        f"Could not evaluate the `k` schedule at step 0 ({e!r}); it will be"
        " checked when first called.",
        stacklevel=3,
    )
    return
  if concrete < 1:
    raise ValueError(
        f"The `k` schedule returned {concrete} at gradient_step 0; a window"
        " needs at least 1 micro-batch. Make the schedule return an int >= 1."
    )
