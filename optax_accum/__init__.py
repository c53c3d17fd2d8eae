"""optax_accum: exact gradient accumulation for JAX and Optax.

Train with a large effective batch on a device that holds a small one:

* across jitted calls, :func:`accumulate` (``optax.GradientTransformation``;
  the drop-in :class:`MultiSteps`), with :func:`update_and_apply` as the fast
  path that never touches the params on mid-steps, :func:`flush` for a partial
  window and :func:`has_updated` for logging;
* inside one step, :func:`microbatched` (a ``lax.scan`` over micro-batches), and
  :func:`cached_microbatched` for a loss that couples the examples (contrastive
  losses: gradient caching);
* around both, :class:`Policy` / :func:`mixed_precision`; dynamic loss
  scaling in :mod:`optax_accum.precision`;
* on many devices, ``axis_name=`` and :mod:`optax_accum.sharding`;
* the inner optimizer's state in host memory between optimizer steps:
  :func:`host_state` (:mod:`optax_accum.offload`);
* how many micro-batches: the gradient noise scale of every window
  (:func:`noise_scale`, :func:`adaptive_k`).

Flax users get the fast path from :mod:`optax_accum.flax`; what a compiled step
does can be checked with :mod:`optax_accum.debug`.
"""

import importlib
import warnings
from typing import Any

# The public submodules, reachable as attributes (optax_accum.sharding.X).
from optax_accum import debug, gradient_noise, microbatching, offload, precision, sharding  # noqa: F401
from optax_accum.accumulation import (
    AccumulateState,
    accumulate,
    flush,
    has_updated,
    update_and_apply,
)
from optax_accum.contrastive import cached_microbatched
from optax_accum.gradient_noise import adaptive_k, noise_scale
from optax_accum.microbatching import microbatched
from optax_accum.multi_steps import MultiSteps
from optax_accum.offload import host_state
from optax_accum.precision import Policy, mixed_precision

__version__ = "0.2.0"

__all__ = [
    "AccumulateState",
    "MultiSteps",
    "Policy",
    "accumulate",
    "adaptive_k",
    "cached_microbatched",
    "flush",
    "has_updated",
    "host_state",
    "microbatched",
    "mixed_precision",
    "noise_scale",
    "update_and_apply",
]

# Names 0.2.0 exported at the top level, kept for one release: where each lives now.
_MOVED = {
    "AdaptiveK": "optax_accum.gradient_noise",
    "NoiseScaleState": "optax_accum.gradient_noise",
    "AuxRule": "optax_accum.microbatching",
    "split_microbatches": "optax_accum.microbatching",
    "DynamicLossScale": "optax_accum.precision",
    "LossScaler": "optax_accum.precision",
    "all_finite": "optax_accum.precision",
    "cast_floating": "optax_accum.precision",
    "dynamic_loss_scale": "optax_accum.precision",
    "scaled_value_and_grad": "optax_accum.precision",
    "per_device_state": "optax_accum.sharding",
    "shard_map_specs": "optax_accum.sharding",
    "state_shardings": "optax_accum.sharding",
    # optax's own names, which 0.2.0 re-exported:
    "MultiStepsState": "optax",
    "ShouldSkipUpdateFunction": "optax",
    "skip_large_updates": "optax",
    "skip_not_finite": "optax",
}


def __getattr__(name: str) -> Any:
  if name in _MOVED:
    where = _MOVED[name]
    warnings.warn(
        f"`optax_accum.{name}` is deprecated and goes in the next release: use"
        f" `{where}.{name}`.", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(where), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
