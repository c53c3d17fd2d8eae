"""optax_accum: exact gradient accumulation for JAX and Optax.

Train with a large effective batch on a device that holds a small one:

* across jitted calls, :func:`accumulate` (``optax.GradientTransformation``;
  the drop-in :class:`MultiSteps`), with :func:`update_and_apply` as the fast
  path that never touches the params on mid-steps, :func:`flush` for a partial
  window and :func:`has_updated` for logging;
* inside one step, :func:`microbatched` (a ``lax.scan`` over micro-batches);
* around both, :class:`Policy` / :func:`mixed_precision` and dynamic loss
  scaling (:mod:`optax_accum.precision`);
* on many devices, ``axis_name=`` and :mod:`optax_accum.sharding`;
* the gradient noise scale of every window, :func:`noise_scale`
  (:mod:`optax_accum.gradient_noise`), to choose ``k``.

Flax users get the fast path from :mod:`optax_accum.flax`; what a compiled step
does can be checked with :mod:`optax_accum.debug`.
"""

import optax

from optax_accum.accumulation import (
    AccumulateState,
    accumulate,
    all_finite,
    flush,
    has_updated,
    update_and_apply,
)
from optax_accum.gradient_noise import AdaptiveK, NoiseScaleState, adaptive_k, noise_scale
from optax_accum.microbatching import AuxRule, microbatched, split_microbatches
from optax_accum.multi_steps import (
    MultiSteps,
    ShouldSkipUpdateFunction,
    skip_large_updates,
    skip_not_finite,
)
from optax_accum.planning import plan_k
from optax_accum.precision import (
    DynamicLossScale,
    LossScaler,
    Policy,
    cast_floating,
    dynamic_loss_scale,
    mixed_precision,
    scaled_value_and_grad,
)
from optax_accum.sharding import per_device_state, shard_map_specs, state_shardings

#: ``MultiSteps`` keeps optax's own state type (``optax.MultiStepsState``).
MultiStepsState = optax.MultiStepsState

__version__ = "0.2.0"

__all__ = [
    "AccumulateState",
    "AdaptiveK",
    "AuxRule",
    "DynamicLossScale",
    "LossScaler",
    "MultiSteps",
    "MultiStepsState",
    "NoiseScaleState",
    "Policy",
    "ShouldSkipUpdateFunction",
    "accumulate",
    "adaptive_k",
    "all_finite",
    "cast_floating",
    "dynamic_loss_scale",
    "flush",
    "has_updated",
    "microbatched",
    "mixed_precision",
    "noise_scale",
    "per_device_state",
    "plan_k",
    "scaled_value_and_grad",
    "shard_map_specs",
    "skip_large_updates",
    "skip_not_finite",
    "split_microbatches",
    "state_shardings",
    "update_and_apply",
]
