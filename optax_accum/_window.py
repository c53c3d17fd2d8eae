"""One accumulation window: the micro-step behind ``accumulate`` and ``MultiSteps``.

Read top to bottom. :func:`micro_step` counts the micro-batch, decides whether
the window closes (:func:`window_closes`, the only place that decides it) and
then runs two conditionals:

* :func:`add_to_buffer` writes this micro-batch into the buffer, only when
  the window stays open;
* :func:`emit` reduces the window (the buffer plus this micro-batch, summed on
  the fly by :func:`buffer_after`) and runs the inner optimizer, or
  :func:`mid` returns zeros.

:func:`advance` moves the counters. Whether a micro-batch counts at all
(finite? positive weight?) is decided by the caller and passed in as
``accept``.

So the closing micro-batch is not written to the buffer: the emitting step
reads the buffer inside the inner optimizer's loops. Once read, the buffer is
dead, so the emitting step writes the updates there (:func:`parking`) and
``update`` returns them masked by "a step was taken": no parameter-sized
value leaves a conditional. The buffer is reset lazily: between windows it
holds leftovers (updates, or a partial sum) that the next window's first
micro-batch ignores. Branch order matters to the compilers' copy insertion:
every pass-through branch sits where XLA:CPU, or XLA:GPU, needs it to copy
nothing (benchmarks/NOTES.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
import optax
from jax import lax

from optax_accum import _validation
from optax_accum import gradient_noise as noise_lib

KSchedule = Callable[[jax.Array], Any]

# Named scopes of the branches: they reach the compiled program's op_name
# metadata, so a profile (or benchmarks/gpu_hlo.py) can tell which kernels
# run on mid-steps (add, mid) and which on emitting steps.
SCOPES = {"add": "optax_accum_add", "mid": "optax_accum_mid", "emit": "optax_accum_emit"}


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a micro-step needs to know, validated once.

  Attributes:
    k: micro-batches per window: an int, a schedule ``f(gradient_step)``, or
      an :class:`~optax_accum.gradient_noise.AdaptiveK` policy.
    inner: the inner optimizer, or None (the chain form: emit the reduced
      gradient itself).
    reduction: ``"mean"``, ``"sum"`` or ``"weighted"``.
    running_mean: the buffer holds the running mean of the window (what
      ``optax.MultiSteps`` keeps in ``acc_grads``) instead of its sum.
    acc_dtype: the requested buffer dtype, or None for the default rule.
    axis_name: a ``pmap``/``shard_map`` axis (or tuple) to reduce over at emit.
    noise_decay: the decay of the noise-scale averages, or None (not tracked).
  """

  k: int | KSchedule | noise_lib.AdaptiveK
  inner: optax.GradientTransformationExtraArgs | None
  reduction: str = "mean"
  running_mean: bool = False
  acc_dtype: jnp.dtype | None = None
  axis_name: Any = None
  noise_decay: float | None = None


class Window(NamedTuple):
  """The accumulation state one micro-step reads and writes (inner state aside)."""

  mini_step: jax.Array
  gradient_step: jax.Array
  acc_grads: optax.Updates
  acc_weight: jax.Array | tuple[()]  # () unless reduction="weighted"
  noise: noise_lib.NoiseScaleState | tuple[()]


class StepOut(NamedTuple):
  """What :func:`micro_step` returns."""

  out: Any  # the updates, or the new params when applying
  window: Window
  inner_state: optax.OptState
  emitted: jax.Array  # this call took an optimizer step


def init_window(config: Config, params: optax.Params) -> Window:
  """An empty window: a zero buffer shaped (and sharded) like ``params``.

  Under ``jax.jit`` with explicit sharding and ``axis_name`` naming data axes,
  the buffer is typed *unreduced* over them: each device keeps its partial sum.
  """
  unreduced = _validation.explicit_axes(config.axis_name, check=False)

  def zeros(p: jax.Array) -> jax.Array:
    dtype = _validation.accumulator_dtype(jnp.result_type(p), config.acc_dtype)
    if unreduced is None:
      return jnp.zeros_like(p, dtype=dtype)
    spec = jax.sharding.PartitionSpec(
        *strip_axes(_spec(p).partitions, unreduced), unreduced=set(unreduced))
    return jnp.zeros(jnp.shape(p), dtype, out_sharding=spec)

  return Window(
      mini_step=jnp.zeros([], jnp.int32),
      gradient_step=jnp.zeros([], jnp.int32),
      acc_grads=jax.tree.map(zeros, params),
      # Unused state costs host time on every call: only weighted windows keep it.
      acc_weight=jnp.zeros([], jnp.float32) if config.reduction == "weighted" else (),
      noise=() if config.noise_decay is None else noise_lib.init(),
  )


def _spec(x: Any) -> jax.sharding.PartitionSpec:
  sharding = getattr(jax.typeof(x), "sharding", None)
  return getattr(sharding, "spec", None) or jax.sharding.PartitionSpec()


def strip_axes(partitions: tuple[Any, ...], axes: tuple[Any, ...]) -> tuple[Any, ...]:
  """A spec's partitions with ``axes`` removed (those dims all-gathered over them)."""
  def one(entry: Any) -> Any:
    if entry is None:
      return None
    names = tuple(n for n in (entry if isinstance(entry, tuple) else (entry,)) if n not in axes)
    return None if not names else names[0] if len(names) == 1 else names
  return tuple(one(e) for e in partitions)


def window_length(k: int | KSchedule | noise_lib.AdaptiveK, window: Window) -> jax.Array:
  """``k`` for this window; a schedule is checked when concrete, clamped under jit."""
  if isinstance(k, int):
    return jnp.asarray(k, jnp.int32)
  if isinstance(k, noise_lib.AdaptiveK):
    return k(window.noise)
  gradient_step = window.gradient_step
  value = k(gradient_step)
  if not isinstance(value, jax.core.Tracer):
    concrete = int(jnp.asarray(value))
    if concrete < 1:
      raise ValueError(
          f"The `k` schedule returned {concrete} at gradient_step"
          f" {int(gradient_step)}; a window needs at least 1 micro-batch. Make"
          " the schedule return an int >= 1 for every step. (Under jit such"
          " values are clamped to 1.)"
      )
  return jnp.maximum(jnp.asarray(value).astype(jnp.int32), 1)


def buffer_after(
    config: Config, window: Window, grads: optax.Updates, accept: Any, weight: jax.Array | None,
) -> optax.Updates:
  """The buffer with this micro-batch added: one fused expression per leaf.

  The buffer's old contents count only while ``mini_step > 0``; they are
  discarded with a select, never multiplied, so a NaN left behind never
  reaches a later window. A micro-batch of weight 0 adds nothing (its
  gradient may be NaN: the mean loss of pure padding). A rejected one
  (``accept`` False) leaves the buffer as it is.
  """
  if accept is False:
    return window.acc_grads
  stale = window.mini_step == 0
  inv_next = 1.0 / (window.mini_step + 1).astype(jnp.float32)

  def add(acc: jax.Array, g: jax.Array) -> jax.Array:
    g = g.astype(acc.dtype)
    zero = jnp.zeros_like(acc)  # (a scalar 0 is not allowed with unreduced types)
    old = jnp.where(stale, zero, acc)
    if weight is not None:
      g = jnp.where(weight != 0, g * _scalar_like(weight.astype(acc.dtype), acc), zero)
    if config.running_mean:  # optax.MultiSteps' Welford update
      new = old + (g - old) * inv_next.astype(acc.dtype)
    else:
      new = old + g
    return new if accept is True else jnp.where(accept, new, acc)

  return jax.tree.map(add, window.acc_grads, grads)


def add_to_buffer(
    config: Config, window: Window, grads: optax.Updates, accept: Any, weight: jax.Array | None,
    closes: jax.Array, *, emit_writes: bool,
) -> optax.Updates:
  """The buffer after this call: written in place, unless the window closes.

  The closing micro-batch goes straight into :func:`emit`, which sums it
  with the buffer on the fly. ``emit_writes``: the emitting conditional
  writes the buffer too (parked updates, or the sum the noise estimate
  reads), which decides the branch order the compiler needs.
  """
  if accept is False:
    return window.acc_grads
  writes = jnp.logical_not(closes)
  if accept is not True:
    writes = jnp.logical_and(writes, accept)

  @jax.named_scope(SCOPES["add"])
  def write(acc: optax.Updates, grads: optax.Updates) -> optax.Updates:
    # A conditional whose branch is cheap elementwise work becomes selects on
    # XLA:GPU (a pass on every step); a barrier is not elementwise.
    mini_step = lax.optimization_barrier(window.mini_step)
    return buffer_after(config, window._replace(acc_grads=acc, mini_step=mini_step), grads,
                        True, weight)

  keep = lambda acc, _: acc
  pass_through_false = lambda acc, g: lax.cond(writes, write, keep, acc, g)
  if not emit_writes:
    return pass_through_false(window.acc_grads, grads)
  # Which branch passes the buffer through decides whether the compiler
  # copies every buffer of the two conditionals: XLA:CPU needs it in the
  # false slot always; XLA:GPU in the true one when the emitting conditional
  # writes the buffer too (benchmarks/NOTES.md has the HLO of both).
  pass_through_true = lambda acc, g: lax.cond(jnp.logical_not(writes), keep, write, acc, g)
  return lax.platform_dependent(window.acc_grads, grads, cpu=pass_through_false,
                                default=pass_through_true)


def window_closes(count: jax.Array, k_now: jax.Array, emit_now: Any) -> jax.Array:
  """Whether this call closes the window: ``k`` micro-batches, or ``emit_now``."""
  full = count >= k_now
  if emit_now is not False:
    full = jnp.logical_or(full, emit_now)
  return jnp.logical_and(full, count > 0)


def _scalar_like(w: jax.Array, acc: jax.Array) -> jax.Array:
  """``w`` typed to multiply ``acc``: an unreduced array needs a *reduced* scalar."""
  axes = _validation.unreduced_axes(acc)
  if not axes:
    return w
  return jax.reshard(w, jax.sharding.PartitionSpec(reduced=set(axes)))


def _cross_device(
    config: Config, acc: Any, scalars: jax.Array, params: Any) -> tuple[Any, jax.Array]:
  """The window summed over ``axis_name``, and a vector of scalars with it.

  Under ``shard_map``/``pmap`` two ``psum``s (the scalars are per device).
  Under jit with unreduced buffers, one ``jax.reshard`` per leaf to the
  params' sharding: an all-reduce, or a reduce-scatter for sharded params;
  the scalars are global values there already.
  """
  if config.axis_name is None:
    return acc, scalars
  if _validation.explicit_axes(config.axis_name) is None:
    return lax.psum(acc, config.axis_name), lax.psum(scalars, config.axis_name)
  targets = acc if params is None else params
  acc = jax.tree.map(
      lambda a, t: jax.reshard(a, jax.sharding.PartitionSpec(*_spec(t).partitions)), acc, targets)
  return acc, scalars


def emit(
    config: Config,
    operands: tuple[Any, ...],
    *,
    apply: bool,
    inner: Callable[[Any, Any, Any], tuple[Any, Any]],
    dtypes: Any,
    accept: Any,
    weight: jax.Array | None,
    parks: list[bool] | None = None,
) -> tuple[Any, ...]:
  """The emitting branch: reduce the window, run the inner optimizer once.

  The window is the buffer plus this micro-batch (``accept``, ``weight``),
  summed on the fly: XLA fuses that sum into the inner optimizer's reads.
  A window whose total weight is 0 (only padding) is not a step: the inner
  state is kept, the updates are zeros and ``stepped`` is False. This is the
  only place that rule lives. With ``parks`` (see :func:`parking`) the
  updates of those leaves are written into the buffer, which is returned.
  """
  window, grads, count, total_weight, noise, inner_state, params, _ = operands
  tracking = config.noise_decay is not None
  window_k = noise.window_count if tracking else count
  totals = jnp.stack([total_weight, count.astype(jnp.float32), window_k.astype(jnp.float32),
                      noise.window_sq_norms if tracking else jnp.zeros([], jnp.float32)])
  written: Any = ()
  if _emit_writes_buffer(config) and parks is None:
    written = buffer_after(config, window, grads, accept, weight)
    window_sum = lambda: written
  elif config.axis_name is None:
    # Summed where it is read (inside the weighted rule's conditional too):
    # a sum computed out here would be a parameter-sized temporary.
    window_sum = lambda: buffer_after(config, window, grads, accept, weight)
  else:
    reduced_sum, totals = _cross_device(
        config, buffer_after(config, window, grads, accept, weight), totals, params)
    window_sum = lambda: reduced_sum
  total_weight, count_f, window_k, window_sq = totals[0], totals[1], totals[2], totals[3]
  # In the buffer's precision (float64 buffers would lose digits to a float32 1/3).
  wide = jnp.result_type(jnp.float32, *(jnp.finfo(a.dtype).dtype
                                        for a in jax.tree.leaves(window.acc_grads)
                                        if jnp.issubdtype(a.dtype, jnp.inexact)))
  scale = _window_scale(config, count_f.astype(wide), total_weight.astype(wide))

  def step(inner_state: Any, params: Any, buffer: Any) -> tuple[Any, Any, Any]:
    # XLA's GPU compiler turns a conditional whose branches hold only cheap
    # elementwise work into selects, and then the inner optimizer runs on
    # every micro-step. A barrier is not elementwise: the conditional stays.
    s = lax.optimization_barrier(scale)
    reduced = jax.tree.map(lambda a, d: (a * s.astype(a.dtype)).astype(d), window_sum(), dtypes)
    out, new_inner = inner(reduced, inner_state, params)
    if parks is not None:
      out, buffer = park(out, buffer, parks)
    return out, new_inner, buffer

  buffer = window.acc_grads if parks is not None else ()
  if config.reduction == "weighted":
    stepped = total_weight != 0
    out_shapes = jax.eval_shape(step, inner_state, params, buffer)[0]
    # Passes the buffer through (parked updates are masked by ``stepped``).
    skip = lambda s, p, b: (p if apply else _distinct_zeros(out_shapes, stepped), s, b)
    out, new_inner, buffer = lax.cond(stepped, step, skip, inner_state, params, buffer)
  else:
    stepped = jnp.asarray(True)
    out, new_inner, buffer = step(inner_state, params, buffer)
  if parks is not None:
    written = buffer
  if tracking:
    mean = scale if config.reduction != "sum" else 1.0 / count_f
    noise = noise_lib.fold_window(
        noise, window_sq_norms=window_sq, window_count=window_k.astype(jnp.int32),
        total_weight=total_weight if config.reduction == "weighted" else window_k,
        mean_sq_norm=noise_lib.sq_norm(window_sum()) * mean**2, decay=config.noise_decay)
  return out, new_inner, stepped, noise, written


def _window_scale(config: Config, count: jax.Array, total_weight: jax.Array) -> jax.Array:
  """The factor that turns the buffer into the window's reduced gradient."""
  if config.reduction == "weighted":
    return 1.0 / jnp.where(total_weight == 0, 1.0, total_weight)
  if config.reduction == "mean" and not config.running_mean:
    return 1.0 / count
  return jnp.ones([], count.dtype)  # a sum, or a running mean already


def traced_once(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn``, whose Python runs at its first call; later calls replay its jaxpr.

  The replay binds the same primitives (the compiled program is the same)
  without running ``fn``'s Python again: an optimizer's tracing is most of a
  train step's trace time. A call with arguments of other types traces anew.
  ``fn`` must not close over values traced after its first call (here it
  closes over the configuration and the caller's extra arguments only).
  """
  cache: dict[Any, tuple[Any, Any]] = {}

  def call(*args: Any) -> Any:
    leaves, treedef = jax.tree.flatten(args)
    key = (treedef, tuple(jax.typeof(x) for x in leaves))
    if key not in cache:
      closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
      cache[key] = (jax.extend.core.jaxpr_as_fun(closed), jax.tree.structure(shapes))
    replay, out_tree = cache[key]
    return jax.tree.unflatten(out_tree, replay(*leaves))

  return call


def run_inner(config: Config, reduced: Any, inner_state: Any, params: Any, *, apply: bool,
              extra_args: dict[str, Any]) -> tuple[Any, Any]:
  """The inner optimizer on the reduced gradient: ``(updates or new params, state)``."""
  if config.inner is None:
    return reduced, inner_state
  updates, new_inner = config.inner.update(reduced, inner_state, params, **extra_args)
  # Optimizers may promote their state (Adam's f16 moments on f32 gradients);
  # both branches of the cond, and lax.scan, need stable dtypes.
  new_inner = optax.tree.cast_like(new_inner, inner_state)
  return (optax.apply_updates(params, updates) if apply else updates), new_inner


def mid(operands: tuple[Any, ...], *, apply: bool, zeros: Any, emit_writes: bool,
        ) -> tuple[Any, ...]:
  """The non-emitting branch: zero updates (or the params untouched).

  Updates parked in the buffer (see :func:`parking`) get no zeros here: they
  are read back, masked, after the conditional.
  """
  window, _, _, _, noise, inner_state, params, closes = operands
  out = params if apply else _distinct_zeros(zeros, closes)  # closes is False here
  buffer = window.acc_grads if emit_writes else ()
  return out, inner_state, jnp.asarray(False), noise, buffer


def parking(config: Config, updates: Any, buffer: optax.Updates, *, noise_parks: bool = False,
            ) -> list[bool] | None:
  """Which leaves of the updates the emitting branch writes into the buffer.

  Once the window closes the buffer is dead (the next window resets it
  lazily), so the updates can live there: ``update`` then returns
  ``where(stepped, buffer, 0)``, which XLA fuses into ``apply_updates``. The
  conditional then outputs no parameter-sized updates: no temporaries, and
  the mid-step writes no zeros (6 passes over the params instead of 7). A
  leaf parks when the buffer leaf holds its value exactly (same shape, same
  sharding and device variance, the same dtype or an exact widening); the
  others are returned as usual. Not under ``axis_name`` (the reduction
  materialises the sum elsewhere), and with the noise estimate only when
  ``noise_parks`` (else the buffer keeps the window's sum for the norm).
  None when no leaf parks.
  """
  if config.axis_name is not None or (_emit_writes_buffer(config) and not noise_parks):
    return None
  if jax.tree.structure(updates) != jax.tree.structure(buffer):
    return None
  outs, bufs = jax.tree.leaves(updates), jax.tree.leaves(buffer)
  parks = [_holds_exactly(a, u) for u, a in zip(outs, bufs, strict=True)]
  return parks if any(parks) else None


_EXACT_WIDENINGS = {
    (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)),
    (jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)),
    (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float64)),
    (jnp.dtype(jnp.float16), jnp.dtype(jnp.float64)),
    (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)),
}


def _holds_exactly(buffer: Any, updates: Any) -> bool:
  """Whether ``updates`` stored in ``buffer`` reads back bit for bit, in place."""
  same_dtype = jnp.dtype(updates.dtype) == jnp.dtype(buffer.dtype)
  if not same_dtype and (jnp.dtype(updates.dtype), jnp.dtype(buffer.dtype)) not in _EXACT_WIDENINGS:
    return False
  return (tuple(updates.shape) == tuple(buffer.shape)
          and _validation.varying_axes(updates) == _validation.varying_axes(buffer)
          and _validation.explicit_spec(updates) == _validation.explicit_spec(buffer)
          and not _validation.unreduced_axes(buffer))


def park(updates: Any, buffer: optax.Updates, parks: list[bool]) -> tuple[list[Any], Any]:
  """``(the updates with parked leaves None, the buffer holding them)``."""
  leaves = jax.tree.leaves(updates)
  bufs, treedef = jax.tree.flatten(buffer)
  kept = [None if p else u for u, p in zip(leaves, parks, strict=True)]
  stored = [u.astype(b.dtype) if p else b for u, b, p in zip(leaves, bufs, parks, strict=True)]
  return kept, jax.tree.unflatten(treedef, stored)


def unpark(kept: list[Any], buffer: optax.Updates, parks: list[bool], stepped: jax.Array,
           shapes: Any) -> Any:
  """The updates: parked leaves read back from the buffer, zeros unless ``stepped``."""
  like, treedef = jax.tree.flatten(shapes)
  out = [jnp.where(stepped, b.astype(s.dtype), jnp.zeros((), s.dtype)) if p else u
         for u, b, p, s in zip(kept, jax.tree.leaves(buffer), parks, like, strict=True)]
  return jax.tree.unflatten(treedef, out)


def _emit_writes_buffer(config: Config) -> bool:
  """Whether :func:`emit` writes the window's sum into the buffer.

  Only when the noise estimate reads the sum too: XLA:CPU (and libtpu, in
  part) keeps a sum with two readers (the inner optimizer and the norm) as a
  parameter-sized temporary, so it goes into the buffer instead, whose
  window is over. Where the updates park instead (XLA:GPU, see
  :func:`micro_step`) it is not written. (A cross-device sum is
  materialised by its collective anyway.)
  """
  return config.noise_decay is not None and config.axis_name is None


def _distinct_zeros(shapes: Any, false: jax.Array) -> Any:
  """Zeros shaped (and typed) like ``shapes``, one independent broadcast per leaf.

  Plain ``zeros_like`` leaves are identical HLO that XLA merges into one
  buffer and then copies into each output: nearly two passes instead of one.
  ``false`` is a traced bool that is False where this runs; XLA cannot know
  it, so no two leaves look alike. Both branches of a cond need equal types,
  so each leaf also takes its target's sharding (explicit mode) or the mesh
  axes it varies over (inside ``shard_map``).
  """
  leaves, treedef = jax.tree.flatten(shapes)
  out = []
  for i, s in enumerate(leaves):
    fill = jnp.where(false, jnp.asarray(i + 1, s.dtype), jnp.zeros((), s.dtype))
    z = jnp.broadcast_to(fill, s.shape, out_sharding=_validation.explicit_spec(s))
    out.append(_validation.match_varying(z, s))
  return jax.tree.unflatten(treedef, out)


def advance(window: Window, *, count: jax.Array, total_weight: jax.Array, closes: jax.Array,
            stepped: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(mini_step, gradient_step, acc_weight)`` after this call."""
  return (
      jnp.where(closes, jnp.zeros_like(count), count),
      jnp.where(stepped, optax.safe_increment(window.gradient_step), window.gradient_step),
      jnp.where(closes, jnp.zeros_like(total_weight), total_weight),
  )


def micro_step(
    config: Config,
    grads: optax.Updates,
    window: Window,
    inner_state: optax.OptState,
    params: optax.Params | None,
    *,
    accept: Any = True,
    weight: jax.Array | None = None,
    emit_now: Any = False,
    apply: bool = False,
    extra_args: dict[str, Any] | None = None,
) -> StepOut:
  """One micro-batch into the window; one optimizer step when the window closes.

  Args:
    config: the validated configuration.
    grads: this micro-batch's gradients (already checked against the buffer).
    window: the accumulation state.
    inner_state: the inner optimizer's state.
    params: the params (needed by some optimizers, and to apply).
    accept: whether this micro-batch counts (a bool scalar; ``True`` when it
      cannot fail). A rejected one changes no buffer and no counter.
    weight: the micro-batch's weight (``reduction="weighted"`` only).
    emit_now: close the window after this micro-batch even if short.
    apply: return the new params instead of the updates, applied inside the
      emitting branch (mid-steps then never touch the params).
    extra_args: passed to the inner optimizer.
  """
  k_now = window_length(config.k, window)
  count = window.mini_step + jnp.asarray(accept, window.mini_step.dtype)
  closes = window_closes(count, k_now, emit_now)
  weighted = config.reduction == "weighted"
  total_weight = window.acc_weight if weighted else jnp.zeros([], jnp.float32)
  if weight is not None:
    total_weight = total_weight + jnp.where(accept, weight, 0.0)
  noise = window.noise
  if config.noise_decay is not None:
    sq = noise_lib.sq_norm(grads)
    counted = jnp.logical_and(accept, True if weight is None else weight != 0)
    if weight is not None:
      sq = jnp.where(weight != 0, sq * weight, 0.0)
    noise = noise_lib.add_micro_batch(noise, sq, counted)

  dtypes = _reduced_dtypes(grads, params)
  operands = (window, grads, count, total_weight, noise, inner_state, params, closes)
  # The emitting branch is traced several times (for its output shapes, for
  # each backend's layout, inside the weighted rule's conditional); the inner
  # optimizer's Python runs once and is replayed from its jaxpr after that.
  inner = traced_once(functools.partial(run_inner, config, apply=apply,
                                        extra_args=extra_args or {}))
  emit_fn = lambda ops, parks=None: emit(
      config, ops, apply=apply, inner=inner, dtypes=dtypes, accept=accept,
      weight=weight, parks=parks)
  shapes = None if apply else jax.eval_shape(emit_fn, operands)[0]
  # Which leaves park, without and with the noise estimate's parking.
  parks_for = {noise_parks: None if apply else parking(config, shapes, window.acc_grads,
                                                        noise_parks=noise_parks)
               for noise_parks in (False, True)}
  emit_writes = _emit_writes_buffer(config) or parks_for[False] is not None
  acc = add_to_buffer(config, window, grads, accept, weight, closes, emit_writes=emit_writes)
  # The emitting branch reads the buffer as add_to_buffer leaves it
  # (unchanged when the window closes).
  operands = (window._replace(acc_grads=acc), *operands[1:])

  def conditional(noise_parks: bool) -> tuple[Any, ...]:
    parks = parks_for[noise_parks]
    zeros, run_emit = shapes, emit_fn
    if parks is not None:
      zeros = [None if p else z for z, p in zip(jax.tree.leaves(shapes), parks, strict=True)]
      run_emit = functools.partial(emit_fn, parks=parks)
    mid_fn = lambda ops: mid(ops, apply=apply, zeros=zeros, emit_writes=emit_writes)
    out, inner, stepped, noise, written = lax.cond(
        closes, jax.named_scope(SCOPES["emit"])(run_emit),
        jax.named_scope(SCOPES["mid"])(mid_fn), operands)
    buffer = written if emit_writes else acc
    if parks is not None:
      out = unpark(out, buffer, parks, stepped, shapes)
    return out, buffer, inner, stepped, noise

  if _emit_writes_buffer(config) and not apply:
    # The noise estimate reads the window's sum too. Computed on the fly for
    # both readers, XLA:GPU fuses it (no temporaries); XLA:CPU materialises
    # it (1.0x) and libtpu holds more (0.49x -> 0.79x on a v5e) than with
    # the sum kept in the buffer and the updates out of the conditional.
    out, acc, inner_state, stepped, noise = lax.platform_dependent(
        cuda=lambda: conditional(True), default=lambda: conditional(False))
  else:
    out, acc, inner_state, stepped, noise = conditional(False)

  mini_step, gradient_step, acc_weight = advance(
      window, count=count, total_weight=total_weight, closes=closes, stepped=stepped)
  acc_weight = acc_weight if weighted else window.acc_weight
  new_window = Window(mini_step, gradient_step, acc, acc_weight, noise)
  return StepOut(out, new_window, inner_state, stepped)


def _reduced_dtypes(grads: optax.Updates, params: optax.Params | None) -> Any:
  """The dtype the reduced gradient takes: the wider of the gradient's and the param's."""
  if params is None:
    return jax.tree.map(lambda g: jnp.result_type(g), grads)
  return jax.tree.map(lambda g, p: jnp.promote_types(jnp.result_type(g), jnp.result_type(p)),
                      grads, params)
