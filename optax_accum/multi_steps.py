"""A drop-in replacement for ``optax.MultiSteps`` built on :func:`accumulate`'s core.

Same constructor, state fields and methods as ``optax.MultiSteps``, but the
inner optimizer runs only on emitting steps (``optax.MultiSteps`` runs it on
every mini-step and masks the result), and a new window discards the buffer
with a select (``optax.MultiSteps`` multiplies by ``1 - emit``, so one NaN
mini-step poisons every later window). ``acc_grads`` holds the window's running
sum (optax keeps a running mean) and is cleared lazily, on the first mini-step
of the next window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax.transforms import ShouldSkipUpdateFunction, skip_large_updates, skip_not_finite

from optax_accum import _validation
from optax_accum.accumulation import accumulation_step, init_buffer

__all__ = [
    "MultiSteps",
    "MultiStepsState",
    "ShouldSkipUpdateFunction",
    "skip_large_updates",
    "skip_not_finite",
]


class MultiStepsState(NamedTuple):
  """State of :class:`MultiSteps`; the fields of ``optax.MultiStepsState``.

  Attributes:
    mini_step: mini-steps accepted in the current window.
    gradient_step: optimizer steps taken.
    inner_opt_state: the state of the wrapped optimizer.
    acc_grads: accumulated gradients (the sum over the window so far).
    skip_state: what ``should_skip_update_fn`` returned last (``()`` without).
  """

  mini_step: jax.Array
  gradient_step: jax.Array
  inner_opt_state: Any
  acc_grads: Any
  skip_state: Any = ()


def _never_skip(updates: Any, gradient_step: Any, params: Any) -> tuple[jax.Array, Any]:
  del updates, gradient_step, params
  return jnp.zeros([], jnp.bool_), ()


class MultiSteps:
  """Accumulates gradients over ``every_k_schedule`` mini-steps (drop-in).

  Example:
    >>> import jax.numpy as jnp, optax, optax_accum as oa
    >>> ms = oa.MultiSteps(optax.sgd(1.0), every_k_schedule=2)
    >>> params = {"a": jnp.zeros([])}
    >>> state = ms.init(params)
    >>> _, state = ms.update({"a": jnp.ones([])}, state, params)
    >>> updates, state = ms.update({"a": jnp.full([], 3.0)}, state, params)
    >>> float(updates["a"]), bool(ms.has_updated(state))
    (-2.0, True)
  """

  def __init__(
      self,
      opt: optax.GradientTransformation,
      every_k_schedule: int | Callable[[jax.Array], Any],
      use_grad_mean: bool = True,
      should_skip_update_fn: ShouldSkipUpdateFunction | None = None,
      accumulator_dtype: Any = jnp.float32,
  ):
    """Same arguments as ``optax.MultiSteps``.

    Args:
      opt: the wrapped optimizer, run once per window.
      every_k_schedule: mini-steps per update: an int or ``f(gradient_step)``.
      use_grad_mean: average (True) or sum (False) the window's gradients.
      should_skip_update_fn: ``f(updates, gradient_step, params) -> (skip,
        skip_state)``, e.g. ``optax_accum.skip_not_finite``. A skipped
        mini-step changes nothing and does not count toward ``k``.
      accumulator_dtype: dtype of the buffer (float32 by default).
    """
    self._opt = optax.with_extra_args_support(opt)
    self._k = _validation.check_k(every_k_schedule, "every_k_schedule")
    self._reduction = "mean" if use_grad_mean else "sum"
    self._should_skip = should_skip_update_fn or _never_skip
    self._acc_dtype = _validation.check_accumulator_dtype(accumulator_dtype)

  @property
  def inner_opt(self) -> optax.GradientTransformationExtraArgs:
    return self._opt

  def init(self, params: Any) -> MultiStepsState:
    gradient_step = jnp.zeros([], jnp.int32)
    _, skip_state = self._should_skip(
        jax.tree.map(jnp.zeros_like, params), gradient_step, params)
    return MultiStepsState(
        mini_step=jnp.zeros([], jnp.int32),
        gradient_step=gradient_step,
        inner_opt_state=self._opt.init(params),
        acc_grads=init_buffer(params, self._acc_dtype),
        skip_state=skip_state,
    )

  def update(
      self,
      updates: optax.Updates,
      state: MultiStepsState,
      params: optax.Params | None = None,
      **extra_args: Any,
  ) -> tuple[optax.Updates, MultiStepsState]:
    _validation.check_tree_matches(updates, state.acc_grads)
    should_skip, skip_state = self._should_skip(updates, state.gradient_step, params)
    should_skip = jnp.asarray(should_skip)
    if (should_skip.dtype, should_skip.shape) != (jnp.bool_, ()):
      raise ValueError(
          "`should_skip_update_fn` must return a boolean scalar array first;"
          f" got dtype {should_skip.dtype} and shape {should_skip.shape}."
      )
    out = accumulation_step(
        updates,
        acc_grads=state.acc_grads,
        acc_weight=jnp.zeros([], jnp.float32),
        mini_step=state.mini_step,
        gradient_step=state.gradient_step,
        inner_opt_state=state.inner_opt_state,
        params=params,
        k=self._k,
        inner=self._opt,
        reduction=self._reduction,
        weight=None,
        accept=None if self._should_skip is _never_skip else jnp.logical_not(should_skip),
        axis_name=None,
        extra_args=extra_args,
    )
    return out.updates, MultiStepsState(
        mini_step=out.mini_step,
        gradient_step=out.gradient_step,
        inner_opt_state=out.inner_opt_state,
        acc_grads=out.acc_grads,
        skip_state=skip_state,
    )

  def has_updated(self, state: MultiStepsState | Any) -> jax.Array:
    return jnp.logical_and(state.mini_step == 0, state.gradient_step > 0)

  def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
    return optax.GradientTransformationExtraArgs(init=self.init, update=self.update)
