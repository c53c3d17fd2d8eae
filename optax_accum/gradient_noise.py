r"""The gradient noise scale, estimated for free from accumulation windows.

McCandlish, Kaplan, Amodei et al., "An Empirical Model of Large-Batch
Training" (2018), define the simple noise scale
:math:`B_\text{simple} = \operatorname{tr}(\Sigma) / |G|^2` (per-example
gradient covariance over the squared true gradient). Batches well below it
waste optimizer steps; batches well above it waste compute.

A window of ``k`` micro-batch gradients :math:`g_i` (each the mean over ``b``
examples) and their mean :math:`\bar g` holds what an estimate needs. With
:math:`S = \frac1k\sum_i |g_i|^2` and :math:`M = |\bar g|^2`,
:math:`E[S] = |G|^2 + \operatorname{tr}(\Sigma)/b` and
:math:`E[M] = |G|^2 + \operatorname{tr}(\Sigma)/(kb)`, so each window gives

* :math:`|G|^2 \approx (kM - S)/(k - 1)` (the signal) and
* :math:`\operatorname{tr}(\Sigma)/b \approx k(S - M)/(k - 1)` (the noise).

Both are averaged separately over windows (exponential moving averages with
the same decay, so their bias corrections cancel in the ratio) and the noise
scale in **micro-batches** is noise / signal: multiply by the examples per
micro-batch for examples. Weighted windows (``reduction="weighted"``, weights
proportional to the examples or tokens in each micro-batch) use
:math:`S = \sum_i w_i |g_i|^2 / \sum_i w_i` and the weighted mean for
:math:`\bar g`; then ``k`` counts the micro-batches of nonzero weight and the
unit is the average micro-batch. The estimate is invariant to the loss scale.

This module holds the state and the arithmetic; ``accumulate``,
``MultiSteps`` (``track_noise_scale=``) and ``microbatched``
(``return_noise_stats=True``) feed it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_accum import _arrays, _copies

__all__ = [
    "MIN_WINDOWS",
    "AdaptiveK",
    "NoiseScaleState",
    "WindowStats",
    "adaptive_k",
    "fold",
    "init",
    "noise_scale",
    "scale_by_schedule_in_examples",
    "sq_norm",
]

#: Windows folded in before :func:`noise_scale` returns a number (NaN before).
MIN_WINDOWS = 10
DEFAULT_DECAY = 0.99


class NoiseScaleState(NamedTuple):
  r"""Running estimate of the gradient noise scale.

  Attributes:
    window_sq_norms: :math:`\sum_i w_i |g_i|^2` over the open window (float32;
      ``w_i = 1`` for unweighted windows).
    window_count: micro-batches of nonzero weight in the open window (int32).
    signal: moving average of the per-window estimates of :math:`|G|^2`.
    noise: moving average of the per-window estimates of
      :math:`\operatorname{tr}(\Sigma)/b`.
    num_windows: windows folded into the averages (int32). Windows with fewer
      than two micro-batches, or with a non-finite estimate, are left out.
  """

  window_sq_norms: jax.Array
  window_count: jax.Array
  signal: jax.Array
  noise: jax.Array
  num_windows: jax.Array


def init() -> NoiseScaleState:
  """An empty estimate (one buffer per field, so the state can be donated)."""
  f32, i32 = (lambda: jnp.zeros([], jnp.float32)), (lambda: jnp.zeros([], jnp.int32))
  return NoiseScaleState(f32(), i32(), f32(), f32(), i32())


def check_decay(value: Any, k: Any = None) -> float | None:
  """``track_noise_scale`` as an EMA decay: None (off), or a float in (0, 1).

  An :class:`AdaptiveK` window length ``k`` turns the estimate on: it reads it.
  """
  if value is False or value is None:
    return DEFAULT_DECAY if isinstance(k, AdaptiveK) else None
  if value is True:
    return DEFAULT_DECAY
  if isinstance(value, (int, float)) and 0.0 < float(value) < 1.0:
    return float(value)
  raise ValueError(
      "`track_noise_scale` must be a bool, or a float in (0, 1) giving the decay"
      f" of the moving averages (True means {DEFAULT_DECAY}); got {value!r}."
  )


def sq_norm(tree: Any) -> jax.Array:
  r""":math:`\sum |x|^2` over every leaf of ``tree``, as a float32 scalar.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_accum.gradient_noise import sq_norm
    >>> float(sq_norm({"a": jnp.array([3.0, 4.0]), "b": jnp.array([1j])}))
    26.0
  """
  # lax, not jnp: this runs on every leaf twice per traced step; with jnp's
  # checks it was 0.67 s of a 300-leaf noise step's 3.8 s trace (cProfile).
  total = None
  for x in jax.tree.leaves(tree):
    x = jnp.asarray(x)
    if jnp.iscomplexobj(x):
      x = lax.abs(x)
    x = lax.convert_element_type(x, _arrays.promote_types(x.dtype, jnp.float32))
    leaf = lax.convert_element_type(lax.reduce_sum(lax.mul(x, x), tuple(range(x.ndim))),
                                    jnp.float32)
    total = leaf if total is None else lax.add(total, leaf)
  return jnp.zeros([], jnp.float32) if total is None else total


def add_micro_batch(state: NoiseScaleState, sq_norm: jax.Array, accept: Any,
                    weight: jax.Array | None) -> NoiseScaleState:
  r"""The open window with one micro-batch's :math:`w |g|^2` added, if it counts.

  ``sq_norm`` is :math:`|g|^2`, the squared norm of the micro-batch's mean
  gradient. The rule ``accumulate``, ``MultiSteps`` and ``microbatched``
  share: a micro-batch counts when ``accept`` and, with a ``weight``, when
  that is nonzero; one that does not adds nothing, not even the NaN a weight-0
  micro-batch's mean gradient may be.
  """
  counted = jnp.logical_and(accept, True if weight is None else weight != 0)
  if weight is not None:
    sq_norm = sq_norm * weight
  return state._replace(
      window_sq_norms=state.window_sq_norms + jnp.where(counted, sq_norm, 0.0),
      window_count=state.window_count + jnp.asarray(counted, jnp.int32),
  )


def per_device_micro_batch(grads: Any, weight: jax.Array | None) -> tuple[jax.Array, Any]:
  """Each device's micro-batch, from one copy per device of its gradient: ``|g|^2`` and weight.

  A device's copy in ``grads`` is its share of the mean over every device's
  rows, ``1 / n`` of its own micro-batch's mean (``n`` devices), and it
  holds ``1 / n`` of the weight, as when the devices' micro-batches are alike.
  """
  n = jax.tree.leaves(grads)[0].shape[0]
  sq = _copies.each_device(sq_norm, grads, jnp.zeros([], jnp.float32))
  return sq * n**2, None if weight is None else weight / n


def add_value_and_grad(state: NoiseScaleState, grads: Any, den: Any) -> NoiseScaleState:
  r"""The open window with one ``microbatched`` micro-batch added: ``fn``'s ``grads``, ``den``.

  Weighted (a denominator ``d``): ``grads`` are those of the numerator ``n``,
  the micro-batch's mean gradient is ``g = grad n / d`` and its weight
  ``w = d``, so :math:`w |g|^2 = |\nabla n|^2 / d` (NaN for ``d = 0``, which does
  not count). A scalar per micro-batch: no gradient-sized buffer.
  """
  sq = sq_norm(grads)
  den = None if den is None else jnp.asarray(den).astype(jnp.float32)
  return add_micro_batch(state, sq if den is None else sq / den / den, True, den)


def window_of(sq_norms: jax.Array, count: jax.Array, mean_sq_norm: jax.Array, reduction: str,
              den: Any) -> WindowStats:
  """``microbatched``'s micro-batches (over every device) as the window ``accumulate`` folds.

  ``mean_sq_norm`` is that of the reduced output: the window's mean gradient
  for ``"mean"`` and ``"weighted"``; for ``"sum"`` the sum, divided here by the
  count squared. ``count`` is a float (it crossed devices with the sums).
  """
  if reduction == "sum":
    mean_sq_norm = mean_sq_norm / jnp.maximum(count, 1.0) ** 2
  total = den.astype(jnp.float32) if reduction == "weighted" else count
  return WindowStats(sq_norms, count.astype(jnp.int32), total, mean_sq_norm)


def fold_window(state: NoiseScaleState, stats: WindowStats, decay: float) -> NoiseScaleState:
  r"""Closes a window: folds its estimates into the averages, empties the window.

  Args:
    state: the state to update.
    stats: the window's statistics (``window_sq_norms`` summed over devices
      when the window spans several).
    decay: the decay of the moving averages.
  """
  k = stats.window_count.astype(jnp.float32)
  s = stats.window_sq_norms / jnp.where(stats.total_weight == 0, 1.0, stats.total_weight)
  m = stats.mean_sq_norm
  denom = jnp.maximum(k - 1.0, 1.0)
  signal = (k * m - s) / denom
  noise = k * (s - m) / denom
  use = (stats.window_count >= 2) & jnp.isfinite(signal) & jnp.isfinite(noise)
  return NoiseScaleState(
      window_sq_norms=jnp.zeros_like(state.window_sq_norms),
      window_count=jnp.zeros_like(state.window_count),
      signal=jnp.where(use, decay * state.signal + (1.0 - decay) * signal, state.signal),
      noise=jnp.where(use, decay * state.noise + (1.0 - decay) * noise, state.noise),
      num_windows=state.num_windows + use.astype(jnp.int32),
  )


class WindowStats(NamedTuple):
  r"""What one window tells about the noise scale (``microbatched`` returns it).

  Attributes:
    window_sq_norms: :math:`\sum_i w_i |g_i|^2` over the window's micro-batch
      gradients (``w_i = 1`` unweighted).
    window_count: ``k``, the micro-batches of nonzero weight.
    total_weight: :math:`\sum_i w_i` (``k`` unweighted).
    mean_sq_norm: :math:`|\bar g|^2`, the squared norm of the window's mean.
  """

  window_sq_norms: jax.Array
  window_count: jax.Array
  total_weight: jax.Array
  mean_sq_norm: jax.Array


def fold(state: NoiseScaleState, stats: WindowStats, decay: float = DEFAULT_DECAY
         ) -> NoiseScaleState:
  """Folds one window's statistics (e.g. from ``microbatched``) into ``state``.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_accum import gradient_noise as ns
    >>> state = ns.init()
    >>> stats = ns.WindowStats(jnp.float32(20.0), jnp.int32(4), jnp.float32(4.0),
    ...                        jnp.float32(2.0))   # S = 5, M = 2, k = 4
    >>> state = ns.fold(state, stats, decay=0.5)
    >>> float(state.signal / 0.5), float(state.noise / 0.5)   # (4*2 - 5)/3, 4*(5 - 2)/3
    (1.0, 4.0)
  """
  check_decay(decay)
  dtypes = WindowStats(jnp.float32, jnp.int32, jnp.float32, jnp.float32)
  return fold_window(state, WindowStats(*map(jnp.asarray, stats, dtypes)), decay)


def noise_scale(state: Any, min_windows: int = MIN_WINDOWS) -> jax.Array:
  r"""The simple gradient noise scale, in micro-batches (a float32 scalar).

  Multiply by the examples (or tokens) per micro-batch to get it in
  examples. It is NaN until ``min_windows`` windows of at least two
  micro-batches have been folded in, and while the signal estimate is not
  positive (early in training, or with very noisy windows): never a silent 0.

  Args:
    state: the state of ``accumulate(..., track_noise_scale=True)`` or of
      ``MultiSteps(..., track_noise_scale=True)``, or any state (a chain's
      tuple, a Flax optimizer's ``opt_state``) that holds one.
    min_windows: windows needed before a number is returned.

  Returns:
    The estimate of :math:`B_\text{simple} / b`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_accum as oa
    >>> tx = oa.accumulate(4, optax.sgd(0.0), track_noise_scale=True)
    >>> params = {"w": jnp.zeros(64)}
    >>> state = tx.init(params)
    >>> key = jax.random.key(0)
    >>> step = jax.jit(tx.update)
    >>> for i in range(4 * 50):   # true gradient 1, per-element noise variance 4
    ...   g = {"w": 1.0 + 2.0 * jax.random.normal(jax.random.fold_in(key, i), (64,))}
    ...   _, state = step(g, state, params)
    >>> b = float(oa.noise_scale(state))   # tr(Sigma) / |G|^2 = 64 * 4 / 64 = 4
    >>> 2.5 < b < 6.0
    True
  """
  found = _arrays.first_node(state, lambda n: isinstance(n, NoiseScaleState))
  if found is None:
    raise TypeError(
        "`noise_scale` needs the state of a transform built with"
        " `track_noise_scale=True` (or a state holding one); got"
        f" {type(state).__name__}."
    )
  ready = (jnp.asarray(found.num_windows) >= min_windows) & (jnp.asarray(found.signal) > 0)
  ratio = jnp.asarray(found.noise) / jnp.where(ready, jnp.asarray(found.signal), 1.0)
  return jnp.where(ready, ratio, jnp.nan).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class AdaptiveK:
  """A window length driven by the noise scale; build it with :func:`adaptive_k`.

  Attributes:
    k_min: the shortest window (also used until the estimate is ready).
    k_max: the longest window.
    fraction: the window aims at ``fraction`` times the noise scale.
    min_windows: windows folded in before the estimate is trusted.
  """

  k_min: int
  k_max: int
  fraction: float = 1.0
  min_windows: int = MIN_WINDOWS

  def __call__(self, state: NoiseScaleState) -> jax.Array:
    """``k`` for the next window, from the estimate in ``state`` (an int32 scalar)."""
    b = noise_scale(state, self.min_windows)
    wanted = jnp.clip(jnp.round(self.fraction * b), self.k_min, self.k_max)
    return jnp.where(jnp.isfinite(b), wanted, self.k_min).astype(jnp.int32)


def adaptive_k(k_min: int, k_max: int, *, fraction: float = 1.0,
               min_windows: int = MIN_WINDOWS) -> AdaptiveK:
  r"""A ``k`` for :func:`~optax_accum.accumulate` that follows the noise scale.

  Each window holds :math:`k = \operatorname{clip}(\operatorname{round}(
  \text{fraction} \cdot B_\text{noise} / b), k_\min, k_\max)` micro-batches,
  with :math:`B_\text{noise}/b` the estimate of :func:`noise_scale` (in
  micro-batches). It is re-evaluated on the traced state at each window
  boundary (the estimate only changes when a window closes), so changing
  values never recompile. Until the estimate is ready the window holds
  ``k_min``. Passing it as ``k`` turns on ``track_noise_scale``.

  Training near the noise scale spends the fewest examples per unit of
  progress for the steps it takes (McCandlish et al., 2018); ``fraction``
  below 1 favours fewer examples, above 1 fewer optimizer steps. The inner
  optimizer's schedules still count optimizer steps; to count examples
  instead, see the README ("How large should k be?").

  Args:
    k_min: the shortest window, >= 1 (2 or more lets the estimate start).
    k_max: the longest window, >= ``k_min``.
    fraction: the target window length as a fraction of the noise scale.
    min_windows: windows folded in before the estimate is used.

  Returns:
    An :class:`AdaptiveK`, to pass as ``accumulate``'s ``k``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_accum as oa
    >>> tx = oa.accumulate(oa.adaptive_k(2, 64), optax.sgd(0.0))
    >>> params = {"w": jnp.zeros(64)}
    >>> state = tx.init(params)
    >>> step = jax.jit(tx.update)
    >>> key = jax.random.key(0)
    >>> for i in range(400):   # noise scale 4 micro-batches (see noise_scale)
    ...   g = {"w": 1.0 + 2.0 * jax.random.normal(jax.random.fold_in(key, i), (64,))}
    ...   _, state = step(g, state, params)
    >>> 2 <= int(oa.adaptive_k(2, 64)(state.noise_stats)) <= 8
    True
  """
  for name, value in (("k_min", k_min), ("k_max", k_max), ("min_windows", min_windows)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"`{name}` must be an int >= 1; got {value!r}.")
  if k_max < k_min or k_max > 2**31 - 1:
    raise ValueError(f"Need k_min <= k_max < 2**31; got k_min={k_min}, k_max={k_max}.")
  if not (isinstance(fraction, (int, float)) and fraction > 0 and math.isfinite(fraction)):
    raise ValueError(f"`fraction` must be a positive number; got {fraction!r}.")
  return AdaptiveK(k_min, k_max, float(fraction), min_windows)


def scale_by_schedule_in_examples(
    schedule: optax.Schedule) -> optax.GradientTransformationExtraArgs:
  """Multiplies the updates by ``-schedule(examples)``: a learning rate counted in examples.

  Optax schedules count the inner optimizer's own steps. With a window
  length that changes (``adaptive_k``, a ``k`` schedule) the steps no longer
  track the data seen; count examples instead. Chain this after a direction
  (``optax.scale_by_adam()``), put the chain inside ``accumulate`` and pass
  ``examples=`` (seen so far, this micro-batch included) to every update:
  ``accumulate`` hands extra arguments to its inner optimizer only when a
  window closes, so the schedule is read once per optimizer step.

  Args:
    schedule: the learning rate as a function of examples seen.

  Returns:
    A transform whose ``update`` takes ``examples=`` (a scalar; traced is fine).

  Example:
    >>> import jax.numpy as jnp, optax, optax_accum as oa
    >>> from optax_accum.gradient_noise import scale_by_schedule_in_examples
    >>> lr = lambda n: 0.5 / (1.0 + n / 8)   # halves after 8 examples
    >>> tx = oa.accumulate(2, optax.chain(optax.scale_by_sign(),
    ...                                   scale_by_schedule_in_examples(lr)))
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> for seen in (4.0, 8.0):   # two micro-batches of 4 examples: one step
    ...   updates, state = tx.update({"w": jnp.ones(2)}, state, params, examples=seen)
    >>> updates["w"].tolist()   # -lr(8) * sign(1)
    [-0.25, -0.25]
  """
  def update_fn(updates: optax.Updates, state: optax.EmptyState, params: Any = None, *,
                examples: Any, **extra_args: Any) -> tuple[optax.Updates, optax.EmptyState]:
    lr = schedule(examples)
    return jax.tree.map(lambda u: (-lr * u).astype(u.dtype), updates), state

  return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)
