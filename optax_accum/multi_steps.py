"""A drop-in replacement for ``optax.MultiSteps`` built on the same core as ``accumulate``.

Same constructor, methods and state: ``init`` returns an
``optax.MultiStepsState`` whose ``acc_grads`` means what optax's means while a
window is open (the running mean with ``use_grad_mean=True``, the sum
otherwise), so checkpoints move between the two mid-window and code that
dispatches on ``optax.MultiStepsState`` accepts it. What differs:

* between windows (``mini_step == 0``) ``acc_grads`` holds leftovers of
  the last window (usually the updates just returned), ignored by the next
  mini-step (optax writes zeros: a pass per window). optax ignores it too
  with ``use_grad_mean=True``; to move a boundary checkpoint into
  ``optax.MultiSteps(use_grad_mean=False)``, zero it:
  ``state._replace(acc_grads=optax.tree.zeros_like(state.acc_grads))``;

* the inner optimizer runs only on emitting steps (``optax.MultiSteps`` runs
  it on every mini-step and masks the result);
* one NaN mini-step reaches that window's update only (optax multiplies the
  buffer by ``1 - emit``, so ``0 * NaN`` poisons every later window);
* the reduced gradient handed to the inner optimizer has the wider of the
  gradient's and the param's dtype (optax: the gradient's), and the buffer
  is never narrower than the gradients unless ``accumulator_dtype`` says so;
* ``track_noise_scale=True`` adds the gradient noise scale, kept in
  ``skip_state`` as ``(skip_state, NoiseScaleState)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from optax.transforms import ShouldSkipUpdateFunction

from optax_accum import _arrays, _validation, _window
from optax_accum import gradient_noise as noise_lib

__all__ = ["MultiSteps"]


class MultiSteps:
  """Accumulates gradients over ``every_k_schedule`` mini-steps (drop-in for optax's).

  Example:
    >>> import jax.numpy as jnp, optax, optax_accum as oa
    >>> ms = oa.MultiSteps(optax.sgd(1.0), every_k_schedule=2)
    >>> params = {"a": jnp.zeros([])}
    >>> state = ms.init(params)
    >>> isinstance(state, optax.MultiStepsState)
    True
    >>> _, state = ms.update({"a": jnp.ones([])}, state, params)
    >>> float(state.acc_grads["a"])   # the running mean, as optax keeps it
    1.0
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
      accumulator_dtype: Any = None,
      *,
      track_noise_scale: bool | float = False,
  ):
    """Same arguments as ``optax.MultiSteps``, plus ``track_noise_scale``.

    Args:
      opt: the wrapped optimizer, run once per window.
      every_k_schedule: mini-steps per update: an int (or integral float),
        ``f(gradient_step) -> int``, or :func:`~optax_accum.adaptive_k`.
      use_grad_mean: average (True) or sum (False) the window's gradients.
      should_skip_update_fn: ``f(updates, gradient_step, params) -> (skip,
        skip_state)``, e.g. ``optax.skip_not_finite``. A skipped
        mini-step changes nothing and does not count toward ``k``.
      accumulator_dtype: dtype of the buffer; None (default) is never
        narrower than the gradients (float32 for bfloat16 ones). optax's
        default is float32.
      track_noise_scale: estimate the gradient noise scale (see
        :func:`optax_accum.gradient_noise.noise_scale`).
    """
    _validation.check_optimizer(opt, "opt")
    self._strict_kwargs = not isinstance(opt, optax.GradientTransformationExtraArgs)
    self._config = _window.Config(
        k=_validation.check_k(every_k_schedule, "every_k_schedule"),
        inner=optax.with_extra_args_support(opt),
        reduction="mean" if use_grad_mean else "sum",
        running_mean=use_grad_mean,
        acc_dtype=_validation.check_accumulator_dtype(accumulator_dtype),
        noise_decay=noise_lib.check_decay(track_noise_scale, every_k_schedule),
    )
    self._should_skip = should_skip_update_fn

  @property
  def inner_opt(self) -> optax.GradientTransformationExtraArgs:
    """The wrapped optimizer (with extra-args support), as in optax."""
    return self._config.inner

  def init(self, params: optax.Params) -> optax.MultiStepsState:
    """The initial ``optax.MultiStepsState``: empty buffer, counters at 0."""
    with _arrays.mesh_context(params):  # every leaf on the params' mesh, as `update` returns it
      window = _window.init_window(self._config, params)
      skip_state = ()
      if self._should_skip is not None:
        _, skip_state = self._should_skip(
            optax.tree.zeros_like(params), window.gradient_step, params)
      return self._state(window, self._config.inner.init(params), skip_state)

  def update(
      self,
      updates: optax.Updates,
      state: optax.MultiStepsState,
      params: optax.Params | None = None,
      *,
      apply: bool = False,
      flush: bool = False,
      **extra_args: Any,
  ) -> tuple[Any, optax.MultiStepsState]:
    """Adds ``updates`` to the window; every ``k``-th call, one inner step.

    Args:
      updates: this mini-step's gradients.
      state: the ``optax.MultiStepsState`` from ``init`` or ``update``.
      params: the params, for optimizers that need them.
      apply: return :class:`~optax_accum.accumulation.Applied` (the new params)
        instead of the updates, applied inside the emitting branch (what
        :func:`~optax_accum.update_and_apply` passes).
      flush: close the open window now; ``updates`` carries no mini-step (what
        :func:`~optax_accum.flush` passes).
      **extra_args: passed to the inner optimizer.

    Returns:
      ``(updates, state)``: zeros on mid-steps, the inner optimizer's updates
      on the emitting step.
    """
    flush, apply = _validation.check_flush(flush), _validation.check_flag(apply, "apply")
    _validation.check_keywords(extra_args, self._strict_kwargs, "MultiSteps.update",
                               ("apply", "flush"))
    # (No `axis_name`: one device's layout, and the checks need no mesh.)
    skip_state, noise = state.skip_state, ()
    if self._config.noise_decay is not None:  # the noise estimate rides in `skip_state`
      skip_state, noise = state.skip_state
    window = _window.Window(state.mini_step, state.gradient_step, state.acc_grads, (), noise)
    updates = _validation.update_values(self._config, updates, window, None, False, flush)[0]
    accept: Any = not flush  # a flush carries no micro-batch
    if accept and self._should_skip is not None:
      should_skip, skip_state = self._should_skip(updates, state.gradient_step, params)
      should_skip = jnp.asarray(should_skip)
      if (should_skip.dtype, should_skip.shape) != (jnp.bool_, ()):
        raise ValueError(
            "`should_skip_update_fn` must return a boolean scalar array first;"
            f" got dtype {should_skip.dtype} and shape {should_skip.shape}."
        )
      accept = jnp.logical_not(should_skip)
    with _arrays.mesh_context((updates, params)):
      out = _window.micro_step(
          self._config, updates, window, state.inner_opt_state, params, accept=accept,
          emit_now=flush, apply=apply, extra_args=extra_args)
    new_state = self._state(out.window, out.inner_state, skip_state)
    return (_window.Applied(out.out) if apply else out.out), new_state

  def has_updated(self, state: optax.MultiStepsState | Any) -> jax.Array:
    """Whether the last ``update`` took an optimizer step (optax's definition)."""
    return _window.stepped(state)

  def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
    """``init`` and ``update`` as an ``optax.GradientTransformationExtraArgs``."""
    return optax.GradientTransformationExtraArgs(init=self.init, update=self.update)

  def _state(self, window: _window.Window, inner_state: Any, skip_state: Any
             ) -> optax.MultiStepsState:
    """optax's state of ``window``; the noise estimate rides in ``skip_state``."""
    if self._config.noise_decay is not None:
      skip_state = (skip_state, window.noise_stats)
    return optax.MultiStepsState(
        mini_step=window.mini_step,
        gradient_step=window.gradient_step,
        inner_opt_state=inner_state,
        acc_grads=window.acc_grads,
        skip_state=skip_state,
    )
