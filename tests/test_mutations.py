"""Deliberately broken cores: each must make the suite's reference tests fail.

A test that passes on a wrong implementation checks nothing. Each mutant
below patches one step of :mod:`optax_accum._window` with a plausible bug (a
wrong divisor, an ignored weight, a buffer that is never reset, ...) and runs
the tests that ought to catch it; at least one must fail. The same tests pass
on the real core in the rest of the suite.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from optax_accum import _validation, _window
from tests import (
  test_accumulate,
  test_distributed,
  test_memory,
  test_microbatching,
  test_parking,
  test_trust,
)

# The microbatched detectors pass 0.2's `split=` (their own module filters the warning too).
pytestmark = pytest.mark.filterwarnings(
    "ignore:`microbatched`'s .* is deprecated:DeprecationWarning")

_real = types.SimpleNamespace(
    buffer_after=_window.buffer_after,
    emit=_window.emit,
    unpark=_window.unpark,
    parking=_window.parking,
    check_weight=_validation.check_weight,
    reduction_scale=_window.reduction_scale,
    all_reduce=_window.all_reduce,
)


def _mean_divides_by_k(config, operands, window_sum, **kwargs):
  if config.reduction == "mean" and isinstance(config.k, int):
    operands = operands._replace(count=jnp.full_like(operands.count, config.k))
  return _real.emit(config, operands, window_sum, **kwargs)


def _weighted_divides_by_count(config, operands, window_sum, **kwargs):
  """The weighted scale 1 / count."""
  if config.reduction != "weighted":
    return _real.emit(config, operands, window_sum, **kwargs)
  return _real.emit(config, operands._replace(
      total_weight=operands.count.astype(jnp.float32)), window_sum, **kwargs)


def _mean_over_one_more(reduction, count, total_weight, dtype):
  """The shared scale of a mean off by one micro-batch."""
  if reduction == "mean":
    count = count + 1
  return _real.reduction_scale(reduction, count, total_weight, dtype)


def _weighted_scale_is_the_mean(reduction, count, total_weight, dtype):
  """The shared scale of a weighted window 1 / count (a mean of means)."""
  return _real.reduction_scale("mean" if reduction == "weighted" else reduction, count,
                               total_weight, dtype)


def _scalars_averaged(axis_name, scalars, tree, scatter=None):
  """The cross-device reduction averages the scalars (counts, weights) instead of summing."""
  _, tree = _real.all_reduce(axis_name, scalars, tree, scatter)
  return jax.lax.pmean(scalars, axis_name), tree


def _fixtures() -> tuple[Any, Any]:
  """``test_microbatching``'s ``params`` and ``batch`` fixtures' values."""
  return (test_microbatching.init_mlp(jax.random.key(0)),
          test_microbatching.make_batch(jax.random.key(1), 16))


def _weights_ignored(config, acc, mini_step, grads, accept, weight, **kw):
  return _real.buffer_after(config, acc, mini_step, grads, accept, None, **kw)


def _never_reset(config, acc, mini_step, grads, accept, weight, **kw):
  return _real.buffer_after(config, acc, jnp.maximum(mini_step, 1), grads, accept, weight, **kw)


def _reset_by_multiplying(config, acc, mini_step, grads, accept, weight, **kw):
  """optax.MultiSteps' ``(1 - emit) * acc``: 0 * NaN is NaN."""
  keep = (mini_step > 0).astype(jnp.float32)
  acc = jax.tree.map(lambda a: a * keep.astype(a.dtype), acc)
  return _real.buffer_after(config, acc, jnp.maximum(mini_step, 1), grads, accept, weight, **kw)


def _closing_micro_batch_dropped(config, operands, window_sum, **kwargs):
  """The emitting step reads the buffer but forgets to add its own micro-batch."""
  return _real.emit(config, operands, operands.acc, **kwargs)


def _zero_weights_made_positive(weight, reduction):
  """A weight of 0 nudged to a tiny positive one: a window of padding becomes a step."""
  checked = _real.check_weight(weight, reduction)
  return checked if checked is None else jnp.maximum(checked, 1e-30)


def _parked_updates_unmasked(kept, buffer, parks, stepped, shapes):
  """Updates read back from the buffer on every call, not only when a step was taken."""
  return _real.unpark(kept, buffer, parks, jnp.asarray(True), shapes)


def _parks_regardless_of_dtype(config, updates, buffer, **kwargs):
  """f32 updates parked in a bf16 buffer: rounded on the way back."""
  if _real.parking(config, updates, buffer, **kwargs) is None and any(
      jnp.dtype(u.dtype) == jnp.dtype(b.dtype)
      for u, b in zip(jax.tree.leaves(updates), jax.tree.leaves(buffer), strict=True)):
    return None  # not parked for another reason than the dtype
  return [tuple(u.shape) == tuple(b.shape)
          for u, b in zip(jax.tree.leaves(updates), jax.tree.leaves(buffer), strict=True)]


def _cond_as_selects(pred, true_fn, false_fn, *operands):
  """What XLA's GPU compiler does to a cheap conditional: run both, select."""
  t, f = true_fn(*operands), false_fn(*operands)
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), t, f)


MUTANTS: dict[str, tuple[dict[str, Any], list[Callable[[], None]]]] = {
    "mean divides by k, not the micro-batches accumulated": (
        {"emit": _mean_divides_by_k},
        [test_accumulate.test_emit_now_flushes_a_partial_window,
         lambda: test_accumulate.test_flush_closes_a_partial_window_without_a_new_micro_batch(
             True)],
    ),
    "weighted divides by the count of micro-batches": (
        {"emit": _weighted_divides_by_count},
        [test_accumulate.test_weighted_reduction_with_uneven_weights,
         test_accumulate.test_flush_weighted_window_and_bad_transform],
    ),
    "the shared mean scale is off by one (accumulate)": (
        {"reduction_scale": _mean_over_one_more},
        [lambda: test_accumulate.test_equals_large_batch_for_every_optimizer("sgd")],
    ),
    "the shared mean scale is off by one (microbatched)": (
        {"reduction_scale": _mean_over_one_more},
        [lambda: test_microbatching.test_mean_equals_full_batch(
             *_fixtures(), k=4, split="strided", jit=True)],
    ),
    "the shared weighted scale is the mean's (microbatched)": (
        {"reduction_scale": _weighted_scale_is_the_mean},
        [lambda: test_microbatching.test_weighted_equals_full_batch_and_mean_of_means_does_not(
            _fixtures()[0], split="strided", jit=True)],
    ),
    "the shared cross-device sum averages the scalars (accumulate, microbatched)": (
        {"all_reduce": _scalars_averaged},
        [lambda: test_microbatching.test_axis_name_shard_map_weighted_is_global(_fixtures()[0]),
         test_distributed.test_shard_map_matches_large_batch_and_accumulates_locally],
    ),
    "weights ignored": (
        {"buffer_after": _weights_ignored},
        [test_accumulate.test_weighted_reduction_with_uneven_weights],
    ),
    "buffer never reset between windows": (
        {"buffer_after": _never_reset},
        [lambda: test_accumulate.test_equals_large_batch_for_every_optimizer("sgd")],
    ),
    "reset by multiplying (NaN poisons later windows)": (
        {"buffer_after": _reset_by_multiplying},
        [test_accumulate.test_nan_never_poisons_a_later_window],
    ),
    "the closing micro-batch never reaches the window": (
        {"emit": _closing_micro_batch_dropped},
        [lambda: test_accumulate.test_equals_large_batch_for_every_optimizer("sgd")],
    ),
    "the noise estimate reads a window without its closing micro-batch": (
        {"emit": _closing_micro_batch_dropped},
        [test_parking.test_noise_tracking_equals_large_batch],
    ),
    "a window of total weight 0 counts as a step": (
        {"_validation.check_weight": _zero_weights_made_positive},
        [lambda: test_trust.test_zero_weight_window_is_not_a_step(False)],
    ),
    "parked updates read back on mid-steps": (
        {"unpark": _parked_updates_unmasked},
        [lambda: test_accumulate.test_equals_large_batch_for_every_optimizer("sgd")],
    ),
    "updates parked in a narrower buffer": (
        {"parking": _parks_regardless_of_dtype},
        [test_parking.test_updates_keep_their_precision_with_a_narrow_buffer],
    ),
    "the inner optimizer runs on every micro-step (selects)": (
        {"lax": types.SimpleNamespace(**{**vars(jax.lax), "cond": _cond_as_selects})},
        [lambda: test_memory.test_inner_optimizer_sits_in_a_conditional("adam")],
    ),
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_caught(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
  patches, detectors = MUTANTS[name]
  for attr, value in patches.items():
    module, _, attr = attr.rpartition(".")
    monkeypatch.setattr(_validation if module == "_validation" else _window, attr, value)
  caught = []
  for detector in detectors:
    try:
      detector()
    except AssertionError as e:
      caught.append(type(e).__name__)
  assert caught, f"no test caught the mutant {name!r}"
