"""Gradient accumulation across calls as an Optax transformation.

``accumulate(k, optimizer)`` sums the gradients of ``k`` micro-batches into a
zero-initialised buffer and runs ``optimizer`` once per window, on the reduced
gradient, inside a ``lax.cond``: the exact large-batch step for any optimizer.
The micro-step itself lives in :mod:`optax_accum._window`.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_accum import _arrays, _copies, _global_stats, _validation, _window
from optax_accum import gradient_noise as noise_lib
from optax_accum._window import Applied, KSchedule
from optax_accum.precision import all_finite

__all__ = ["AccumulateState", "Applied", "accumulate", "flush", "has_updated", "update_and_apply"]


class AccumulateState(NamedTuple):
  """State of :func:`accumulate`.

  Attributes:
    mini_step: micro-batches accepted in the current window (int32).
    gradient_step: optimizer steps taken (int32; it saturates, never wraps).
    acc_grads: the buffer, a pytree like the params: the sum of the current
      window (for ``reduction="weighted"`` the weighted sum) while
      ``mini_step > 0``. When ``mini_step == 0`` it holds leftovers of the
      last window, which the next micro-batch overwrites (a lazy reset saves
      a pass per window): usually the updates just returned (the emitting
      step parks them in the dead buffer), otherwise (part of) its sum.
    acc_weight: the sum of the weights seen in the current window (float32);
      ``()`` unless ``reduction="weighted"``.
    num_skipped: non-finite micro-batches dropped so far (int32); ``()``
      unless ``skip_nonfinite=True``.
    emitted: whether the last call took an optimizer step (bool).
    inner_opt_state: the state of the inner optimizer (``()`` without one).
    noise_stats: the gradient noise-scale estimate
      (:class:`~optax_accum.gradient_noise.NoiseScaleState`) with
      ``track_noise_scale``; ``()`` otherwise.
    global_stats: with ``global_stats``, a NamedTuple ``(running, last)``:
      ``running`` the sum of the open window's micro-batch statistics so far
      (this device's under ``shard_map``/``pmap``), the causal buffer, zeros
      when a window opens; ``last`` the last closed window's total over every
      micro-batch and device, the lagged statistics (zeros until one closes).
      ``()`` otherwise.
  """

  mini_step: jax.Array
  gradient_step: jax.Array
  acc_grads: optax.Updates
  acc_weight: jax.Array
  num_skipped: jax.Array
  emitted: jax.Array
  inner_opt_state: optax.OptState
  noise_stats: Any = ()
  global_stats: Any = ()


class _NoOptimizer:
  """The default of ``accumulate``'s ``optimizer``: none given (not even ``None``)."""

  def __repr__(self) -> str:
    return "<no optimizer>"


_NO_OPTIMIZER: Any = _NoOptimizer()


def accumulate(
    k: int | KSchedule,
    optimizer: optax.GradientTransformation | None = _NO_OPTIMIZER,
    *,
    reduction: str = "mean",
    accumulator_dtype: Any = None,
    skip_nonfinite: bool = False,
    axis_name: Any = None,
    track_noise_scale: bool | float = False,
    global_stats: Any = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Accumulates ``k`` micro-batch gradients, then takes one optimizer step.

  Each call adds the incoming gradients to a zero-initialised buffer. Every
  ``k``-th call closes the window: the buffer is reduced (see ``reduction``)
  and handed to ``optimizer``, inside a ``lax.cond``, so the inner optimizer
  runs **only** on emitting steps: its state, step counter and schedules
  advance once per window, exactly as in large-batch training. Mid-steps
  return zero updates.

  Two forms:

  * ``accumulate(k, optimizer)``: the exact large-batch step for any
    optimizer. Prefer this form.
  * ``optax.chain(accumulate(k, None), optimizer)``: emits the reduced
    gradient every ``k``-th call and zeros otherwise. Stateless transforms
    after it (``sgd`` without momentum, ``scale``) then behave exactly;
    stateful ones still step on the zeros of every mid-step (Adam's moments
    decay, its count advances), so that is not large-batch training.
    ``optax.chain`` gives its first member no way to stop the others:
    ``accumulate(k)`` with no optimizer runs, and warns, naming
    ``accumulate(k, optax.adam(lr))``; an explicit ``None`` keeps the form
    without the warning.

  Args:
    k: micro-batches per optimizer step: a positive int, a schedule
      ``f(gradient_step) -> int`` (a batch-size ramp), evaluated on the traced
      step count so changing values never recompile (a concrete value below 1
      raises; under ``jit`` it is clamped to 1), or
      :func:`~optax_accum.adaptive_k` to follow the gradient noise scale.
    optimizer: the inner optimizer, run once per window; an explicit
      ``None`` gives the chain form.
    reduction: ``"mean"`` (sum / k), ``"sum"``, or ``"weighted"``: then
      ``update(..., weight=w)`` takes a per-micro-batch weight ``w >= 0``
      (e.g. its count of real tokens) and the window emits
      :math:`\sum_i w_i g_i / \sum_i w_i`. A micro-batch of weight 0 adds
      nothing, even a NaN gradient. A window of total weight 0 is not a step:
      zero updates, ``gradient_step`` and the inner state unchanged,
      ``has_updated`` False. A non-finite weight (or a traced negative one)
      acts like a non-finite gradient; a concrete negative weight raises.
    accumulator_dtype: dtype of the buffer. ``None`` (default): never
      narrower than the gradients (bfloat16/float16 accumulate in float32,
      float64 in float64, complex64 in complex64). An explicit dtype is used
      as given, even a narrower one; a real one for complex gradients raises.
    skip_nonfinite: if True, a micro-batch with a NaN/Inf gradient or weight
      is dropped: it does not count toward ``k``, changes no buffer and
      increments ``state.num_skipped``. If False, it reaches that window's
      update (as in large-batch training), and the next window starts clean.
    axis_name: the data axis name (or tuple): of ``pmap``/``shard_map``, or
      Explicit mesh axes under plain ``jit`` (the gradients one copy per
      device, from :func:`~optax_accum.sharding.local_value_and_grad`). Each
      device accumulates its local gradients; the cross-device reduction runs
      once per window, inside the emitting branch. With ``skip_nonfinite`` the
      devices agree on a skip with one scalar reduction per micro-step.
    track_noise_scale: estimate the gradient noise scale from every window
      (read it with :func:`~optax_accum.gradient_noise.noise_scale`); a float in
      (0, 1) sets the decay of its moving averages (True: 0.99). It costs one
      squared norm per micro-batch and a few scalars of state. With
      ``axis_name`` the estimate is global and its unit is one device's
      micro-batch.
    global_stats: the shapes of one micro-batch's statistics to carry across
      micro-steps (a pytree of arrays or ``jax.ShapeDtypeStruct`` of
      numbers, e.g. ``jax.eval_shape(stats_fn, params, micro_batch)``).
      ``update(..., stats=s)`` then takes this micro-batch's, and
      ``state.global_stats`` holds ``running``, the open window's so far (the
      causal buffer: a loss adds its own micro-batch's to it), and ``last``,
      the last window's total over every micro-batch and device (lagged;
      under ``shard_map``/``pmap`` one ``psum`` per window, when it closes;
      under plain jit give global values). The window's own total needs the
      whole window in hand: ``microbatched(..., global_stats=...)``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update(grads, state,
    params=None, *, weight=None, emit_now=False, apply=False, flush=False,
    stats=None, **extra_args)`` returns ``(updates, state)``. ``emit_now=True``
    (a Python or traced bool) closes the window after this micro-batch even if
    it holds fewer than ``k``. ``stats=`` is this micro-batch's statistics
    (with ``global_stats``). ``apply=True`` returns :class:`Applied` (the new params)
    in place of the updates, applied inside the emitting branch, so mid-steps
    never touch the params (what :func:`update_and_apply` passes).
    ``flush=True`` closes the open window now and ``grads`` carries no
    micro-batch (what :func:`flush` passes). ``extra_args`` go to the inner
    optimizer (``value=`` for ``optax.contrib.reduce_on_plateau``); a keyword
    the inner optimizer cannot take is a ``TypeError``. The updates (and the
    gradient the inner optimizer sees) have the wider of each gradient's and
    param's dtype. Chains and :func:`~optax_accum.sharding.per_device_state`
    pass every keyword on, so ``apply`` and ``flush`` reach the accumulation
    through them.

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

    Statistics across micro-steps (say, tokens routed to each of 3 experts):

    >>> tx = oa.accumulate(2, optax.sgd(0.1), global_stats=jnp.zeros(3, jnp.int32))
    >>> state = tx.init(params)
    >>> for counts in ([1, 0, 2], [0, 3, 1], [2, 2, 2]):
    ...   _, state = tx.update({"w": jnp.zeros(3)}, state, params, stats=jnp.array(counts))
    >>> state.global_stats.running.tolist(), state.global_stats.last.tolist()
    ([2, 2, 2], [1, 3, 3])
  """
  k = _validation.check_k(k)  # a schedule or `adaptive_k` (callable) passes as it is
  if optimizer is _NO_OPTIMIZER:
    warnings.warn(
        "`accumulate(k)` was given no optimizer: it emits the reduced gradient every k-th"
        " call and zeros otherwise, so an optimizer chained after it, as in"
        " `optax.chain(accumulate(k), optax.adam(lr))`, still steps on every mid-step's"
        " zeros: Adam's moments decay and its count runs k times too fast. For the"
        " large-batch step write `accumulate(k, optax.adam(lr))`. The chain form is exact"
        " for stateless transforms after it (`optax.sgd(lr)`): pass `None` to keep it"
        " without this warning, `accumulate(k, None)`.",
        UserWarning, stacklevel=2)
    optimizer = None
  _validation.check_optimizer(optimizer)
  config = _window.Config(
      k=k,
      inner=None if optimizer is None else optax.with_extra_args_support(optimizer),
      reduction=_validation.check_choice(
          reduction, "reduction", _validation.REDUCTIONS, "Use 'mean' for sum/k, 'sum' for the"
          " plain sum, or 'weighted' with `update(..., weight=w)` for sum(w_i g_i) / sum(w_i)."),
      acc_dtype=_validation.check_accumulator_dtype(accumulator_dtype),
      axis_name=axis_name,
      noise_decay=noise_lib.check_decay(track_noise_scale, k),
  )
  skip_nonfinite = _validation.check_flag(skip_nonfinite, "skip_nonfinite")
  stats_like = _global_stats.check_like(global_stats)
  # Only an optimizer that had to be wrapped is known to take no extra args;
  # in the chain form the chain hands every member the others' keywords.
  strict_kwargs = optimizer is not None and not isinstance(
      optimizer, optax.GradientTransformationExtraArgs)
  if not isinstance(k, (int, noise_lib.AdaptiveK)):
    # A schedule evaluated at step 0 (an array, as the window gives it): one that fails there,
    # or gives no positive integer, fails where `accumulate` is built.
    _validation.check_schedule_value(k(jnp.zeros([], jnp.int32)), 0)

  def init_fn(params: optax.Params) -> AccumulateState:
    """An empty window and the inner optimizer's initial state."""
    with _arrays.mesh_context(params):  # every leaf on the params' mesh, as `update` returns it
      window = _window.init_window(dataclasses.replace(config, layout=_arrays.device_layout(
          config.axis_name, check=False)), params)  # (`jax.pmap(tx.init)` names no axis)
      return AccumulateState(
          **window._asdict(),
          num_skipped=jnp.zeros([], jnp.int32) if skip_nonfinite else (),
          emitted=jnp.zeros([], jnp.bool_),
          inner_opt_state=() if config.inner is None else config.inner.init(params),
          global_stats=_global_stats.init(stats_like),
      )

  def update_fn(
      updates: optax.Updates,
      state: AccumulateState,
      params: optax.Params | None = None,
      *,
      weight: Any = None,
      emit_now: Any = False,
      apply: bool = False,
      flush: bool = False,
      stats: Any = None,
      **extra_args: Any,
  ) -> tuple[Any, AccumulateState]:
    """Adds ``updates`` (this micro-batch's gradients) to the window.

    Returns zero updates on mid-steps and the inner optimizer's updates when
    the window closes (after ``k`` micro-batches, or now with
    ``emit_now=True``); ``weight=`` is this micro-batch's weight for
    ``reduction="weighted"``; ``apply=True`` returns :class:`Applied` (the new
    params) instead, ``flush=True`` closes the window without a micro-batch;
    ``stats=`` is this micro-batch's statistics (``global_stats``). Other
    keywords go to the inner optimizer.
    """
    if not isinstance(state, AccumulateState):
      raise TypeError(
          "`state` must be the AccumulateState returned by this transform's"
          f" `init`; got {type(state).__name__}."
      )
    flushing = _validation.check_flush(flush)
    # The chain form has no optimizer inside to apply: `update_and_apply` applies the
    # updates it returns.
    apply = _validation.check_flag(apply, "apply") and config.inner is not None
    _validation.check_keywords(extra_args, strict_kwargs, "the update of `accumulate`",
                               ("weight", "emit_now", "apply", "flush", "stats"))
    with _arrays.mesh_context((updates, params)):
      now = dataclasses.replace(config, layout=_arrays.device_layout(config.axis_name))
      window = _window.Window(**{f: getattr(state, f) for f in _window.Window._fields})
      updates, weight, emit_now = _validation.update_values(now, updates, window, weight,
                                                            emit_now, flushing)
      accept = False if flushing else (
          _accept(updates, weight, now.layout) if skip_nonfinite else True)
      out = _window.micro_step(now, updates, window, state.inner_opt_state, params,
                               accept=accept, weight=weight, emit_now=emit_now, apply=apply,
                               extra_args=extra_args)
      new_stats = _global_stats.advance(state.global_stats, stats, stats_like, accept, out.closes,
                                        config.axis_name if now.layout.manual else None)
    num_skipped = state.num_skipped
    if skip_nonfinite and not flushing:
      num_skipped = num_skipped + jnp.logical_not(accept).astype(jnp.int32)
    new_state = state._replace(**out.window._asdict(), num_skipped=num_skipped,
                               emitted=out.emitted, inner_opt_state=out.inner_state,
                               global_stats=new_stats)
    return (Applied(out.out) if apply else out.out), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _accept(grads: Any, weight: jax.Array | None, layout: _arrays.Layout) -> jax.Array:
  """Whether this micro-batch counts when non-finite ones are skipped.

  Every device must agree, or the windows drift apart: one scalar reduction
  (over the per-device copies under plain jit, a ``pmin`` under shard_map).
  """
  accept = all_finite(grads) if layout.stacked is None else jnp.all(
      _copies.each_device(all_finite, grads, jnp.asarray(True)))  # each device tests its own
  if weight is not None:
    accept = jnp.logical_and(accept, jnp.isfinite(weight))
  if layout.manual:
    accept = lax.pmin(accept.astype(jnp.int32), layout.axis_name).astype(jnp.bool_)
  return accept


def has_updated(state: Any) -> jax.Array:
  """Whether the last ``update`` call took an optimizer step (a bool scalar).

  Works for :class:`AccumulateState` and ``optax.MultiStepsState`` (what
  :class:`~optax_accum.MultiSteps` uses too), and for any state that holds one
  of these (an ``optax.chain`` state, a Flax optimizer's ``opt_state``): the
  first one found is used.

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
  found = _arrays.first_node(state, _validation.has_window)  # AccumulateState, MultiStepsState
  if found is None:
    raise TypeError(
        "`has_updated` needs the state of `accumulate` or `MultiSteps` (or a"
        f" tuple holding one); got {type(state).__name__}."
    )
  # jnp.asarray unwraps containers such as Flax NNX's optimizer variables.
  return jnp.asarray(found.emitted) if isinstance(found, AccumulateState) else _window.stepped(
      found)


def flush(
    tx: optax.GradientTransformation,
    state: Any,
    params: optax.Params,
    **extra_args: Any,
) -> tuple[optax.Updates, Any]:
  """Closes the open window now, without a new micro-batch.

  For the end of an epoch when the last micro-batch has already been passed to
  ``update``: the micro-batches waiting in the buffer become one optimizer
  step (the mean divides by how many there are). An empty window changes
  nothing: zero updates, state unchanged. Use ``update(..., emit_now=True)``
  instead when you know in advance which micro-batch is the last.

  Args:
    tx: ``accumulate(...)``, ``MultiSteps(...)``, or a transform holding one
      (an ``optax.chain``, :func:`~optax_accum.sharding.per_device_state`); others raise.
    state: its state.
    params: the current params; the updates take their dtypes.
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
  tx = _extra_args_transform(tx, "flush", {})
  zeros, flag = jax.tree.map(jnp.zeros_like, params), _validation.Flush()
  out = tx.update(zeros, state, params, **extra_args, flush=flag)
  _validation.check_flushed(flag)
  return out


def update_and_apply(
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    state: Any,
    params: optax.Params,
    **kwargs: Any,
) -> tuple[optax.Params, Any]:
  """``tx.update`` then ``optax.apply_updates``, applied inside the window's cond.

  Results equal ``tx.update`` followed by ``optax.apply_updates``. The optax
  protocol returns an update on every call, so a mid-step must write a tree
  of zeros and ``apply_updates`` must read and write the params for nothing.
  Here the update is applied inside the emitting branch instead: on mid-steps
  the params pass through untouched (no copy when they are donated) and a
  mid-step costs only the buffer update ``acc += g``.

  Args:
    tx: any transform. The fast path applies to ``accumulate(k, optimizer)``,
      ``MultiSteps(...)``, a chain whose last transform is one of them, and
      :func:`~optax_accum.sharding.per_device_state` around one; any other transform
      (the chain form ``chain(accumulate(k), opt)`` included) gets
      ``tx.update`` + ``optax.apply_updates``.
    grads: this micro-batch's gradients.
    state: the transform's state.
    params: the current params (donate them to the jitted step).
    **kwargs: ``weight=``, ``emit_now=`` and extra args, as for ``tx.update``.

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
  if params is None:
    raise TypeError("`update_and_apply(tx, grads, state, params)` got `params=None`: it returns"
                    " the new params, made from the current ones. Pass the current params.")
  tx = _extra_args_transform(tx, "update_and_apply", kwargs)
  out, state = tx.update(grads, state, params, **kwargs, apply=True)
  if isinstance(out, Applied):
    return out.params, state
  return optax.apply_updates(params, out), state


def _extra_args_transform(
    tx: Any, name: str, kwargs: dict[str, Any]) -> optax.GradientTransformationExtraArgs:
  """``tx`` as a transform whose ``update`` takes keyword arguments."""
  if hasattr(tx, "gradient_transformation"):  # MultiSteps-like objects
    tx = tx.gradient_transformation()
  if not (hasattr(tx, "init") and hasattr(tx, "update")):
    raise TypeError(
        f"`{name}` needs an optax transform such as `optax_accum.accumulate(k,"
        f" optimizer)`; got {type(tx).__name__}."
    )
  if not isinstance(tx, optax.GradientTransformationExtraArgs) and kwargs:
    raise TypeError(
        f"`{name}` got keyword(s) {sorted(kwargs)} but `tx` takes no keyword"
        " arguments (it is a plain optax.GradientTransformation)."
    )
  return optax.with_extra_args_support(tx)
