"""Mixed precision and dynamic loss scaling that compose with accumulation.

* :class:`Policy` — param, compute and output dtypes (the ``jmp.Policy``
  idea, and its ``"params=float32,compute=bfloat16,output=float32"`` string
  format). :func:`mixed_precision` applies one to a loss function, so that
  ``jax.value_and_grad`` of it gives float32 gradients of float32 params while
  the model runs in bfloat16. Use it inside :func:`~optax_accum.microbatching.
  microbatched` and/or in front of :func:`~optax_accum.accumulate`.
* Dynamic loss scaling for float16: a :class:`DynamicLossScale` state and a
  :class:`LossScaler` of pure functions (``init``, ``scale``, ``unscale``,
  ``adjust``). :func:`scaled_value_and_grad` returns the *unscaled* loss and
  gradients; an overflow shows up as a non-finite gradient, which
  ``accumulate(..., skip_nonfinite=True)`` drops (it does not count toward
  ``k`` and touches no buffer), while ``adjust`` shrinks the scale.

We do not depend on ``jmp``: it is a small, archived package whose policy is
the ~60 lines below, and its loss-scale objects keep their hyperparameters in
pytree aux data, which does not fit optax's NamedTuple-state style.
:func:`mixed_precision` duck-types the policy, so a ``jmp.Policy`` works too.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "DynamicLossScale",
    "LossScaler",
    "Policy",
    "all_finite",
    "cast_floating",
    "dynamic_loss_scale",
    "mixed_precision",
    "scaled_value_and_grad",
]

_DTYPE_NAMES = {
    "f32": "float32", "float32": "float32", "full": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "f16": "float16", "float16": "float16", "half": "float16",
    "f64": "float64", "float64": "float64",
}
_KEY_NAMES = {
    "p": "param_dtype", "params": "param_dtype", "param": "param_dtype",
    "c": "compute_dtype", "compute": "compute_dtype",
    "o": "output_dtype", "output": "output_dtype",
}


def all_finite(tree: Any) -> jax.Array:
  """True iff every leaf of ``tree`` is free of NaN and Inf (a bool scalar).

  The test ``accumulate(..., skip_nonfinite=True)`` applies.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_accum.precision import all_finite
    >>> bool(all_finite({"a": jnp.ones(2)})), bool(all_finite({"a": jnp.array([1., jnp.inf])}))
    (True, False)
  """
  # One reduction pass per leaf: `x - x` is 0 where finite and NaN where not, and a sum of
  # zeros never overflows. (`all(isfinite(x))` left XLA:CPU a boolean array per leaf: a
  # quarter of the params in temporaries.)
  leaves = [jnp.isfinite(jnp.sum(x - x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.stack(leaves).all() if leaves else jnp.asarray(True)


def _floating_dtype(dtype: Any, name: str) -> jnp.dtype:
  if isinstance(dtype, str) and dtype.strip().lower() in _DTYPE_NAMES:
    dtype = _DTYPE_NAMES[dtype.strip().lower()]
  try:
    canonical = jnp.dtype(dtype)
  except TypeError as e:
    raise TypeError(
        f"`{name}` must be a floating dtype such as jnp.bfloat16; got {dtype!r}.") from e
  if not jnp.issubdtype(canonical, jnp.floating):
    raise TypeError(f"`{name}` must be a floating dtype such as jnp.bfloat16; got {canonical}.")
  return canonical


def cast_floating(tree: Any, dtype: Any) -> Any:
  """Casts the floating-point leaves of ``tree`` to ``dtype``; others unchanged.

  Integer leaves (token ids, counts), booleans and PRNG keys pass through.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_accum.precision import cast_floating
    >>> out = cast_floating({"x": jnp.ones(2), "ids": jnp.arange(2)}, jnp.bfloat16)
    >>> out["x"].dtype, out["ids"].dtype
    (dtype(bfloat16), dtype('int32'))
  """
  return _map_floating(lambda x: x.astype(dtype), tree)


def _map_floating(fn: Callable[[jax.Array], jax.Array], tree: Any) -> Any:
  """``fn`` on the floating-point leaves of ``tree``; the other leaves unchanged."""
  return jax.tree.map(
      lambda x: fn(x) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) else x,
      tree)


@dataclasses.dataclass(frozen=True)
class Policy:
  """Which dtype params are stored in, computed in, and returned in.

  Attributes:
    param_dtype: dtype of the stored (master) params and of their gradients.
    compute_dtype: dtype the model runs in.
    output_dtype: dtype of the loss and other outputs.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_accum.precision import Policy
    >>> policy = Policy.from_string("params=float32,compute=bfloat16,output=float32")
    >>> policy.cast_to_compute(jnp.ones(2)).dtype
    dtype(bfloat16)
    >>> policy == Policy(jnp.float32, jnp.bfloat16, jnp.float32)
    True
  """

  param_dtype: Any = jnp.float32
  compute_dtype: Any = jnp.float32
  output_dtype: Any = jnp.float32

  def __post_init__(self) -> None:
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
      object.__setattr__(self, field, _floating_dtype(getattr(self, field), field))

  @classmethod
  def from_string(cls, spec: str) -> Policy:
    """Parses ``"params=float32,compute=bfloat16,output=float32"``.

    Short forms ``p``/``c``/``o`` and ``f32``/``bf16``/``f16`` are accepted,
    as in ``jmp.get_policy``; a bare dtype (``"bf16"``) sets all three.
    Missing entries default to float32.
    """
    if not isinstance(spec, str) or not spec.strip():
      raise ValueError(
          f"`spec` must be a string like 'params=float32,compute=bfloat16,output=float32';"
          f" got {spec!r}."
      )
    if "=" not in spec:
      d = _floating_dtype(spec, "spec")
      return cls(d, d, d)
    kwargs: dict[str, Any] = {}
    for part in spec.split(","):
      key, sep, value = part.partition("=")
      key = key.strip().lower()
      if not sep or key not in _KEY_NAMES:
        raise ValueError(
            f"Cannot parse {part!r} in policy spec {spec!r}: entries are"
            " 'params=<dtype>', 'compute=<dtype>' and 'output=<dtype>', separated by commas."
        )
      kwargs[_KEY_NAMES[key]] = _floating_dtype(value, key)
    return cls(**kwargs)

  def cast_to_param(self, tree: Any) -> Any:
    return cast_floating(tree, self.param_dtype)

  def cast_to_compute(self, tree: Any) -> Any:
    return cast_floating(tree, self.compute_dtype)

  def cast_to_output(self, tree: Any) -> Any:
    return cast_floating(tree, self.output_dtype)


def mixed_precision(
    loss_fn: Callable[..., Any], policy: Any, *, cast_inputs: bool = True,
) -> Callable[..., Any]:
  """Runs ``loss_fn`` in ``policy.compute_dtype``; returns ``policy.output_dtype``.

  ``params`` (the first argument) — and, with ``cast_inputs``, the floating
  leaves of every other argument — are cast to the compute dtype; the output
  (loss and aux) is cast to the output dtype. The casts are differentiable,
  so ``jax.value_and_grad(mixed_precision(loss_fn, policy))`` returns
  gradients in the *params'* dtype: float32 master params get float32
  gradients, ready for ``microbatched`` or ``accumulate`` (which accumulate in
  float32 anyway). ``policy`` is any object with ``cast_to_compute`` and
  ``cast_to_output`` (our :class:`Policy` or a ``jmp.Policy``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax_accum.precision import Policy, mixed_precision
    >>> from optax_accum.microbatching import microbatched
    >>> def loss_fn(w, x):
    ...   assert w.dtype == jnp.bfloat16
    ...   return jnp.mean((x @ w) ** 2)
    >>> policy = Policy.from_string("params=f32,compute=bf16,output=f32")
    >>> fn = jax.value_and_grad(mixed_precision(loss_fn, policy))
    >>> loss, g = microbatched(fn, 2)(jnp.ones(3), jnp.ones((4, 3)))
    >>> loss.dtype, g.dtype, float(loss)
    (dtype('float32'), dtype('float32'), 9.0)
  """
  if not (hasattr(policy, "cast_to_compute") and hasattr(policy, "cast_to_output")):
    raise TypeError(
        "`policy` must have `cast_to_compute` and `cast_to_output` (e.g."
        f" Policy.from_string('params=f32,compute=bf16,output=f32')); got {policy!r}."
    )

  @functools.wraps(loss_fn)
  def wrapped(params: Any, *args: Any, **kwargs: Any) -> Any:
    params = policy.cast_to_compute(params)
    if cast_inputs:
      args, kwargs = policy.cast_to_compute((args, kwargs))
    return policy.cast_to_output(loss_fn(params, *args, **kwargs))

  return wrapped


class DynamicLossScale(NamedTuple):
  """State of dynamic loss scaling.

  Attributes:
    loss_scale: the current scale (float32 scalar).
    good_steps: consecutive finite steps since the scale last changed (int32).
    num_overflows: steps with a non-finite gradient so far (int32).
  """

  loss_scale: jax.Array
  good_steps: jax.Array
  num_overflows: jax.Array


class LossScaler(NamedTuple):
  """Pure functions of a :class:`DynamicLossScale` (see :func:`dynamic_loss_scale`).

  Attributes:
    init: ``() -> DynamicLossScale``.
    scale: ``(loss, state) -> loss * loss_scale`` (floating leaves only).
    unscale: ``(grads, state) -> grads / loss_scale`` (computed in float32,
      cast back to each leaf's dtype; an Inf/NaN stays non-finite).
    adjust: ``(state, grads_finite) -> state``: shrink and reset the run on
      overflow, grow after ``growth_interval`` finite steps in a row.
  """

  init: Callable[[], DynamicLossScale]
  scale: Callable[[Any, DynamicLossScale], Any]
  unscale: Callable[[Any, DynamicLossScale], Any]
  adjust: Callable[[DynamicLossScale, jax.Array], DynamicLossScale]


def dynamic_loss_scale(
    initial_scale: float = 2.0**15,
    *,
    growth_interval: int = 2000,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
) -> LossScaler:
  """Dynamic loss scaling for float16 training.

  Scale the loss before differentiating, unscale the gradients, and call
  ``adjust`` with whether they were finite: an overflow multiplies the scale
  by ``backoff_factor`` (not below ``min_scale``) and restarts the run;
  ``growth_interval`` finite steps in a row multiply it by ``growth_factor``
  (not above ``max_scale``).

  With ``accumulate(k, opt, skip_nonfinite=True)`` call ``adjust`` once per
  *micro-batch*: each micro-batch's gradients are unscaled before they are
  added, so the scale may change inside a window without biasing the sum, and
  an overflowing micro-batch is dropped (it does not count toward ``k``) while
  everything accumulated so far is kept. With ``microbatched`` inside a step,
  one overflowing micro-batch makes that step's gradient non-finite and the
  whole step is what gets dropped.

  Args:
    initial_scale: the starting scale.
    growth_interval: finite steps in a row before the scale grows.
    growth_factor: growth multiplier (> 1).
    backoff_factor: shrink multiplier on overflow (in (0, 1)).
    min_scale: floor of the scale.
    max_scale: ceiling of the scale.

  Returns:
    A :class:`LossScaler`.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_accum.precision import dynamic_loss_scale
    >>> scaler = dynamic_loss_scale(8.0, growth_interval=2)
    >>> s = scaler.init()
    >>> float(scaler.scale(jnp.array(1.5), s))
    12.0
    >>> s = scaler.adjust(s, jnp.array(False))    # overflow: shrink
    >>> float(s.loss_scale), int(s.num_overflows)
    (4.0, 1)
    >>> s = scaler.adjust(scaler.adjust(s, jnp.array(True)), jnp.array(True))
    >>> float(s.loss_scale)                       # two good steps: grow
    8.0
  """
  if not isinstance(growth_interval, int) or isinstance(growth_interval, bool) or (
      growth_interval < 1):
    raise ValueError(f"`growth_interval` must be an int >= 1; got {growth_interval!r}.")
  if not growth_factor >= 1.0:
    raise ValueError(f"`growth_factor` must be >= 1 (e.g. 2.0); got {growth_factor!r}.")
  if not 0.0 < backoff_factor < 1.0:
    raise ValueError(f"`backoff_factor` must be in (0, 1) (e.g. 0.5); got {backoff_factor!r}.")
  if not 0.0 < min_scale <= initial_scale <= max_scale:
    raise ValueError(
        "Need 0 < min_scale <= initial_scale <= max_scale; got"
        f" min_scale={min_scale}, initial_scale={initial_scale}, max_scale={max_scale}."
    )

  def init() -> DynamicLossScale:
    return DynamicLossScale(
        loss_scale=jnp.asarray(initial_scale, jnp.float32),
        good_steps=jnp.zeros([], jnp.int32),
        num_overflows=jnp.zeros([], jnp.int32),
    )

  def scale(loss: Any, state: DynamicLossScale) -> Any:
    return _map_floating(lambda x: x * state.loss_scale.astype(x.dtype), loss)

  def unscale(grads: Any, state: DynamicLossScale) -> Any:
    inv = 1.0 / state.loss_scale
    return _map_floating(lambda g: (g.astype(jnp.float32) * inv).astype(g.dtype), grads)

  def adjust(state: DynamicLossScale, grads_finite: jax.Array) -> DynamicLossScale:
    finite = jnp.asarray(grads_finite, jnp.bool_)
    run = state.good_steps + 1
    grow = jnp.logical_and(finite, run >= growth_interval)
    grown = jnp.minimum(state.loss_scale * growth_factor, max_scale)
    shrunk = jnp.maximum(state.loss_scale * backoff_factor, min_scale)
    new_scale = jnp.where(finite, jnp.where(grow, grown, state.loss_scale), shrunk)
    return DynamicLossScale(
        loss_scale=new_scale.astype(jnp.float32),
        good_steps=jnp.where(jnp.logical_and(finite, ~grow), run, 0).astype(jnp.int32),
        num_overflows=state.num_overflows + (~finite).astype(jnp.int32),
    )

  return LossScaler(init, scale, unscale, adjust)


def scaled_value_and_grad(
    loss_fn: Callable[..., Any],
    scaler: LossScaler,
    state: DynamicLossScale,
    *,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
  """``jax.value_and_grad(loss_fn, has_aux)`` with loss scaling in between.

  The loss is multiplied by ``state.loss_scale`` before differentiation (so
  the backward pass runs on scaled cotangents, out of float16's underflow
  range) and the gradients are divided by it afterwards. The returned value is
  the true, unscaled loss (and aux). Same signature and outputs as
  ``jax.value_and_grad(loss_fn, has_aux=has_aux)``, so it can be wrapped by
  ``microbatched``. On overflow the gradients are non-finite: test them with
  :func:`all_finite`, feed that to ``scaler.adjust``, and let
  ``accumulate(..., skip_nonfinite=True)`` (or ``optax.apply_if_finite``)
  drop the step.

  With ``microbatched(..., normalize="weighted")``, pass ``has_aux=True``:
  the numerator is scaled, the denominator (the aux) is not.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax_accum.precision import dynamic_loss_scale, scaled_value_and_grad
    >>> scaler = dynamic_loss_scale(1024.0)
    >>> loss_fn = lambda w, x: jnp.sum((w * x) ** 2)
    >>> vg = scaled_value_and_grad(loss_fn, scaler, scaler.init())
    >>> loss, g = vg(jnp.ones(2), jnp.array([1.0, 2.0]))
    >>> float(loss), g.tolist()
    (5.0, [2.0, 8.0])
  """
  if not isinstance(scaler, LossScaler):
    raise TypeError(f"`scaler` must be a LossScaler from dynamic_loss_scale(); got {scaler!r}.")
  if not isinstance(state, DynamicLossScale):
    raise TypeError(
        f"`state` must be the DynamicLossScale from `scaler.init()`; got {type(state).__name__}."
    )

  def scaled(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    out = loss_fn(*args, **kwargs)
    return scaler.scale(out[0] if has_aux else out, state), out

  grad_fn = jax.grad(scaled, has_aux=True)

  @functools.wraps(loss_fn)
  def value_and_grad(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    grads, value = grad_fn(*args, **kwargs)
    return value, scaler.unscale(grads, state)

  return value_and_grad
