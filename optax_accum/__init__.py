"""optax_accum: exact gradient accumulation for JAX and Optax."""

from optax_accum.accumulation import AccumulateState, accumulate, has_updated, update_and_apply
from optax_accum.multi_steps import (
    MultiSteps,
    MultiStepsState,
    ShouldSkipUpdateFunction,
    skip_large_updates,
    skip_not_finite,
)

__version__ = "0.1.0"

__all__ = [
    "AccumulateState",
    "MultiSteps",
    "MultiStepsState",
    "ShouldSkipUpdateFunction",
    "accumulate",
    "has_updated",
    "skip_large_updates",
    "skip_not_finite",
    "update_and_apply",
]
