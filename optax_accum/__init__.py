"""optax_accum: exact gradient accumulation for JAX and Optax.

Across jitted calls: :func:`accumulate` (and the drop-in :class:`MultiSteps`).
Inside one step: :func:`microbatched`. Around both: :class:`Policy` and dynamic
loss scaling. On many devices: ``axis_name=`` and :mod:`optax_accum.sharding`.
"""

from optax_accum.accumulation import (
    AccumulateState,
    accumulate,
    all_finite,
    flush,
    has_updated,
    update_and_apply,
)
from optax_accum.microbatching import AuxRule, microbatched, split_microbatches
from optax_accum.multi_steps import (
    MultiSteps,
    MultiStepsState,
    ShouldSkipUpdateFunction,
    skip_large_updates,
    skip_not_finite,
)
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

__version__ = "0.1.0"

__all__ = [
    "AccumulateState",
    "AuxRule",
    "DynamicLossScale",
    "LossScaler",
    "MultiSteps",
    "MultiStepsState",
    "Policy",
    "ShouldSkipUpdateFunction",
    "accumulate",
    "all_finite",
    "cast_floating",
    "dynamic_loss_scale",
    "flush",
    "has_updated",
    "microbatched",
    "mixed_precision",
    "per_device_state",
    "scaled_value_and_grad",
    "shard_map_specs",
    "skip_large_updates",
    "skip_not_finite",
    "split_microbatches",
    "state_shardings",
    "update_and_apply",
]
