"""Plausible bugs in optax_accum, each a test must catch.

A test that passes on a wrong implementation checks nothing. Each mutant
below is a wrong version of a public behaviour (a wrong divisor, an ignored
weight, a buffer never reset, ...), made by wrapping the public function a
test calls (``oa.accumulate``, ``oa.microbatched``: a test that claims a
mutant calls them through the package) or by replacing ``jax.lax.cond``, the
conditionals the core is built on. None touches the core's private
functions, so rewriting the core keeps them valid.

A test claims the mutants it must catch with ``@pytest.mark.catches(name,
...)`` (on a ``pytest.param`` for one case of a parametrized test);
``tests/conftest.py`` runs the test once as it is, then once under each
claimed mutant, where an assertion must fail. ``tests/test_mutations.py``
checks that every mutant is claimed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_accum as oa
from optax_accum import offload

Mutant = Callable[[pytest.MonkeyPatch], None]
MUTANTS: dict[str, Mutant] = {}
_accumulate, _microbatched = oa.accumulate, oa.microbatched  # the real ones
_host_state = oa.host_state
_MISSING = object()


def mutant(apply: Mutant) -> Mutant:
  """Registers ``apply`` under its name; its docstring says what goes wrong."""
  MUTANTS[apply.__name__] = apply
  return apply


def _scaled(tree: Any, factor: Any) -> Any:
  return jax.tree.map(
      lambda x: x * factor if jnp.issubdtype(jnp.result_type(x), jnp.inexact) else x, tree)


def _fed(optimizer: Any, change: Callable[[Any], Any]) -> optax.GradientTransformationExtraArgs:
  """``optimizer`` with ``change`` applied to the gradient it is given."""
  inner = optax.with_extra_args_support(optimizer)
  return optax.GradientTransformationExtraArgs(
      inner.init, lambda g, s, p=None, **kw: inner.update(change(g), s, p, **kw))


def _patch_accumulate(patch: pytest.MonkeyPatch, *, build: Callable | None = None,
                      grads: Callable | None = None, updates: Callable | None = None) -> None:
  """``oa.accumulate`` with a fault, at one of three places.

  ``build(k, optimizer, options) -> (optimizer, options)``: what the transform
  is built with; ``grads(k, g, state, kw) -> (g, kw)``: a micro-batch (and the
  keywords of its ``update``) on the way in; ``updates(out, state)``: the
  updates on the way out, with the new state.
  """
  def accumulate(k: Any, optimizer: Any = _MISSING, **options: Any) -> Any:
    if build is not None and optimizer is not _MISSING and optimizer is not None:
      optimizer, options = build(k, optimizer, dict(options))
    tx = _accumulate(k, **options) if optimizer is _MISSING else _accumulate(
        k, optimizer, **options)

    def update(g: Any, state: Any, params: Any = None, **kw: Any) -> tuple[Any, Any]:
      if grads is not None:
        g, kw = grads(k, g, state, dict(kw))
      out, state = tx.update(g, state, params, **kw)
      same_tree = jax.tree.structure(out) == jax.tree.structure(state.acc_grads)
      return (updates(out, state) if updates is not None and same_tree else out), state

    return optax.GradientTransformationExtraArgs(tx.init, update)

  patch.setattr(oa, "accumulate", accumulate)


def _patch_microbatched(patch: pytest.MonkeyPatch, change: Callable) -> None:
  """``oa.microbatched(fn, k, **options)`` whose wrapper's outputs pass through
  ``change(out, fn, k, options, args, kwargs)``."""
  def microbatched(fn: Any, k: int, **options: Any) -> Any:
    real = _microbatched(fn, k, **options)
    return lambda *args, **kwargs: change(real(*args, **kwargs), fn, k, options, args, kwargs)

  patch.setattr(oa, "microbatched", microbatched)


def _mean_of(options: dict[str, Any], k: Any) -> bool:
  return options.get("reduction", "mean") == "mean" and isinstance(k, int)


# ------------------------------------------------------------------ the reduction
@mutant
def mean_divides_by_k(patch: pytest.MonkeyPatch) -> None:
  """The mean divides by ``k``, not by the micro-batches accumulated: wrong for a
  window closed early (``emit_now``, ``flush``)."""
  def build(k: Any, optimizer: Any, options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    if not _mean_of(options, k):
      return optimizer, options
    return _fed(optimizer, lambda g: _scaled(g, 1 / k)), {**options, "reduction": "sum"}
  _patch_accumulate(patch, build=build)


@mutant
def mean_off_by_one_accumulate(patch: pytest.MonkeyPatch) -> None:
  """``accumulate``'s mean divides by one micro-batch more than the window holds."""
  def build(k: Any, optimizer: Any, options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    if not _mean_of(options, k):
      return optimizer, options
    return _fed(optimizer, lambda g: _scaled(g, k / (k + 1))), options
  _patch_accumulate(patch, build=build)


@mutant
def mean_off_by_one_microbatched(patch: pytest.MonkeyPatch) -> None:
  """``microbatched``'s mean divides by one micro-batch more than it ran."""
  _patch_microbatched(patch, lambda out, fn, k, options, args, kwargs: _scaled(
      out, k / (k + 1)) if options.get("normalize", "mean") == "mean" else out)


@mutant
def weighted_divides_by_count(patch: pytest.MonkeyPatch) -> None:
  """``reduction="weighted"`` divides the weighted sum by the count of
  micro-batches, not by the total weight."""
  def build(k: Any, optimizer: Any, options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    if options.get("reduction") == "weighted":
      options["reduction"] = "mean"
    return optimizer, options

  def grads(k: Any, g: Any, state: Any, kw: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    w = kw.pop("weight", None)
    if w is None:
      return g, kw
    return jax.tree.map(lambda x: jnp.where(w != 0, x * w, 0).astype(x.dtype), g), kw
  _patch_accumulate(patch, build=build, grads=grads)


@mutant
def weighted_scale_is_the_mean_microbatched(patch: pytest.MonkeyPatch) -> None:
  """``microbatched``'s token-weighted normalisation divides by the number of
  micro-batches, not by the total denominator (a mean of sums)."""
  def change(out: Any, fn: Any, k: int, options: dict[str, Any], args: Any, kwargs: Any) -> Any:
    if options.get("normalize") != "weighted" or options.get("has_aux"):
      return out
    numerator = lambda *a, **kw: (lambda out: (out[0][0], out[1]))(fn(*a, **kw))
    num, grads = _microbatched(numerator, k, **{**options, "normalize": "sum"})(*args, **kwargs)
    return _scaled((num, grads), 1 / k)
  _patch_microbatched(patch, change)


@mutant
def weights_ignored(patch: pytest.MonkeyPatch) -> None:
  """The buffer adds each micro-batch's gradient unweighted; only the total
  weight sees the weights."""
  def grads(k: Any, g: Any, state: Any, kw: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    w = kw.get("weight")
    if w is None:
      return g, kw
    return jax.tree.map(lambda x: jnp.where(w != 0, x / jnp.where(w != 0, w, 1), 0).astype(
        x.dtype), g), kw
  _patch_accumulate(patch, grads=grads)


@mutant
def zero_weight_made_positive(patch: pytest.MonkeyPatch) -> None:
  """A weight of 0 is nudged to a tiny positive one: a window of padding becomes a step."""
  def grads(k: Any, g: Any, state: Any, kw: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    if kw.get("weight") is not None:
      kw["weight"] = jnp.maximum(jnp.asarray(kw["weight"], jnp.float32), 1e-30)
    return g, kw
  _patch_accumulate(patch, grads=grads)


@mutant
def scalars_averaged_across_devices(patch: pytest.MonkeyPatch) -> None:
  """The cross-device reduction averages the counts and weights instead of
  summing them: with ``axis_name`` a mean (``accumulate``, ``microbatched``) or a
  token-weighted mean (``microbatched``) comes out devices times too large."""
  def build(k: Any, optimizer: Any, options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    axis = options.get("axis_name")
    if axis is None or not _mean_of(options, k):
      return optimizer, options
    return _fed(optimizer, lambda g: _scaled(g, jax.lax.psum(1, axis))), options
  _patch_accumulate(patch, build=build)

  def change(out: Any, fn: Any, k: int, options: dict[str, Any], args: Any, kwargs: Any) -> Any:
    axis = options.get("axis_name")
    if axis is None or options.get("normalize", "mean") == "sum":
      return out
    return _scaled(out, jax.lax.psum(1, axis))
  _patch_microbatched(patch, change)


@mutant
def global_stats_per_microbatch(patch: pytest.MonkeyPatch) -> None:
  """``microbatched(..., global_stats=s)`` gives each micro-batch its own statistics, not
  the whole batch's: a load-balancing loss balanced per micro-batch, as frameworks do."""
  def microbatched(fn: Any, k: int, **options: Any) -> Any:
    stats_fn = options.pop("global_stats", None)
    if stats_fn is None:
      return _microbatched(fn, k, **options)
    return _microbatched(lambda *a, **kw: fn(*a, stats=jax.lax.stop_gradient(stats_fn(*a)), **kw),
                         k, **options)
  patch.setattr(oa, "microbatched", microbatched)


@mutant
def causal_buffer_never_reset(patch: pytest.MonkeyPatch) -> None:
  """``accumulate``'s running statistics are not reset when a window closes: the causal
  buffer counts every earlier window too."""
  def accumulate(k: Any, *args: Any, **options: Any) -> Any:
    tx = _accumulate(k, *args, **options)

    def update(g: Any, state: Any, params: Any = None, **kw: Any) -> tuple[Any, Any]:
      out, new = tx.update(g, state, params, **kw)
      if kw.get("stats") is None or not hasattr(new.global_stats, "running"):
        return out, new
      running = jax.tree.map(lambda r, s: r + jnp.asarray(s).astype(r.dtype),
                             state.global_stats.running, kw["stats"])
      return out, new._replace(global_stats=new.global_stats._replace(running=running))

    return optax.GradientTransformationExtraArgs(tx.init, update)
  patch.setattr(oa, "accumulate", accumulate)


# --------------------------------------------------------------------- the window
def _stale(state: Any) -> jax.Array:
  """The buffer holds a past window's leftovers (the next add resets it lazily)."""
  return jnp.asarray(state.mini_step) == 0


@mutant
def buffer_never_reset(patch: pytest.MonkeyPatch) -> None:
  """A new window starts from what the last one left in the buffer."""
  def grads(k: Any, g: Any, state: Any, kw: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    return jax.tree.map(lambda x, acc: jnp.where(_stale(state), x + acc.astype(x.dtype), x),
                        g, state.acc_grads), kw
  _patch_accumulate(patch, grads=grads)


@mutant
def reset_by_multiplying(patch: pytest.MonkeyPatch) -> None:
  """optax.MultiSteps' reset ``(1 - emit) * acc``: 0 * NaN is NaN, so one NaN
  micro-batch poisons every later window."""
  def grads(k: Any, g: Any, state: Any, kw: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    zero = jnp.logical_not(_stale(state))  # a traced 0 wherever it is used
    return jax.tree.map(
        lambda x, acc: x + jnp.where(_stale(state), acc.astype(x.dtype) * zero, 0),
        g, state.acc_grads), kw
  _patch_accumulate(patch, grads=grads)


@mutant
def closing_micro_batch_dropped(patch: pytest.MonkeyPatch) -> None:
  """The closing step reads the window without its own micro-batch (the
  optimizer and the noise estimate alike)."""
  def grads(k: Any, g: Any, state: Any, kw: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    if not isinstance(k, int):
      return g, kw
    closes = jnp.logical_or(jnp.asarray(state.mini_step) + 1 >= k, kw.get("emit_now", False))
    return jax.tree.map(lambda x: jnp.where(closes, jnp.zeros_like(x), x), g), kw
  _patch_accumulate(patch, grads=grads)


@mutant
def buffer_returned_on_mid_steps(patch: pytest.MonkeyPatch) -> None:
  """The updates are read back from the buffer on every call, not only after
  an optimizer step: mid-steps return the window's running sum."""
  def updates(out: Any, state: Any) -> Any:
    return jax.tree.map(lambda u, acc: jnp.where(oa.has_updated(state), u, acc.astype(u.dtype)),
                        out, state.acc_grads)
  _patch_accumulate(patch, updates=updates)


@mutant
def updates_rounded_to_the_buffer(patch: pytest.MonkeyPatch) -> None:
  """The updates pass through a narrower buffer (``accumulator_dtype=bfloat16``
  with float32 params) and come back rounded."""
  def narrower(u: Any, acc: Any) -> bool:
    return jnp.issubdtype(acc.dtype, jnp.floating) and jnp.issubdtype(u.dtype, jnp.floating) \
        and jnp.dtype(acc.dtype).itemsize < jnp.dtype(u.dtype).itemsize

  def updates(out: Any, state: Any) -> Any:  # the barrier: XLA's GPU compiler drops a round trip
    return jax.tree.map(lambda u, acc: jax.lax.optimization_barrier(u.astype(acc.dtype)).astype(
        u.dtype) if narrower(u, acc) else u, out, state.acc_grads)
  _patch_accumulate(patch, updates=updates)


@mutant
def cond_as_selects(patch: pytest.MonkeyPatch) -> None:
  """What XLA's GPU compiler does to a conditional of cheap branches: run both
  and select, so the inner optimizer runs on every micro-step."""
  def cond(pred: Any, true_fn: Callable, false_fn: Callable, *operands: Any) -> Any:
    t, f = true_fn(*operands), false_fn(*operands)
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), t, f)
  patch.setattr(jax.lax, "cond", cond)


# ------------------------------------------------------------------ the state on the host
@mutant
def host_state_on_device(patch: pytest.MonkeyPatch) -> None:
  """``host_state`` keeps the state on the device: a silent fallback (same values, same
  state type, no memory saved)."""
  def host_state(inner: Any) -> optax.GradientTransformationExtraArgs:
    inner = optax.with_extra_args_support(inner)
    return optax.GradientTransformationExtraArgs(
        lambda p: offload.HostState(inner.init(p)), lambda g, s, p=None, **kw: (
            lambda u, s: (u, offload.HostState(s)))(*inner.update(g, s.inner_state, p, **kw)))
  patch.setattr(oa, "host_state", host_state)


@mutant
def host_state_updates_a_device_state(patch: pytest.MonkeyPatch) -> None:
  """``host_state`` updates a state the caller placed in device memory where it is: a silent
  fallback that holds the state's bytes on the device."""
  def host_state(inner: Any) -> optax.GradientTransformationExtraArgs:
    inner, real = optax.with_extra_args_support(inner), _host_state(inner)

    def update(g: Any, s: Any, p: Any = None, **kw: Any) -> Any:
      if jax.typeof(jax.tree.leaves(s)[-1]).memory_space == jax.memory.Space.Host:
        return real.update(g, s, p, **kw)
      u, new = inner.update(g, s.inner_state, p, **kw)  # where it is: on the device
      return u, offload.HostState(new)
    return optax.GradientTransformationExtraArgs(real.init, update)
  patch.setattr(oa, "host_state", host_state)


@mutant
def non_additive_statistic_unseen(patch: pytest.MonkeyPatch) -> None:
  """``microbatched`` sums a ``global_stats`` statistic that is a max or a mean over the rows
  without a word: each micro-batch's statistics (rows ``i::k`` of argument 1), summed unread."""
  def microbatched(fn: Any, k: int, global_stats: Any = None, **options: Any) -> Any:
    if global_stats is None:
      return _microbatched(fn, k, **options)

    def run(params: Any, batch: Any, *rest: Any) -> Any:
      stats = jax.tree.map(lambda *s: sum(s), *[global_stats(params, jax.tree.map(
          lambda x, i=i: x[i::k], batch), *rest) for i in range(k)])
      return _microbatched(lambda p, b, *r: fn(p, b, *r, stats=stats), k, **options)(
          params, batch, *rest)
    return run
  patch.setattr(oa, "microbatched", microbatched)


@mutant
def narrow_statistic_summed_in_its_type(patch: pytest.MonkeyPatch) -> None:
  """``microbatched`` sums integer statistics narrower than int32 in their own dtype: 512 int8
  counts wrap to 0."""
  def microbatched(fn: Any, k: int, **options: Any) -> Any:
    stats_fn = options.get("global_stats")
    if stats_fn is None:
      return _microbatched(fn, k, **options)

    def in_their_type(*a: Any, stats: Any, **kw: Any) -> Any:
      own = jax.eval_shape(stats_fn, *a)
      return fn(*a, stats=jax.tree.map(lambda s, o: s.astype(o.dtype) if o.ndim == jnp.ndim(
          s) else s, stats, own), **kw)
    return _microbatched(in_their_type, k, **options)
  patch.setattr(oa, "microbatched", microbatched)


@mutant
def host_state_moves_the_state_in(patch: pytest.MonkeyPatch) -> None:
  """``host_state`` updates on the device: the state moved in and out around the update
  (the same values and memory kinds between steps; the state's bytes on the device)."""
  def host_state(inner: Any) -> optax.GradientTransformationExtraArgs:
    inner, real = optax.with_extra_args_support(inner), _host_state(inner)
    put = lambda tree, space: jax.device_put(tree, getattr(jax.memory.Space, space))
    return optax.GradientTransformationExtraArgs(real.init, lambda g, s, p=None, **kw: (
        lambda u, s: (u, offload.HostState(put(s, "Host"))))(
            *inner.update(g, put(s.inner_state, "Device"), p, **kw)))
  patch.setattr(oa, "host_state", host_state)


@mutant
def host_state_single_device_placement(patch: pytest.MonkeyPatch) -> None:
  """``host_state`` places a one-device state with a ``SingleDeviceSharding`` in host
  memory: a ``ShapeDtypeStruct`` of its shardings, or an array restored into them, is
  typed on the device (JAX types host memory from a ``NamedSharding`` alone)."""
  def host_state(inner: Any) -> optax.GradientTransformationExtraArgs:
    real = _host_state(inner)
    return optax.GradientTransformationExtraArgs(lambda p: offload.HostState(jax.device_put(
        inner.init(p), jax.memory.Space.Host)), real.update)
  patch.setattr(oa, "host_state", host_state)
