"""The accumulation window: the one algorithm behind ``accumulate`` and ``MultiSteps``.

:func:`micro_step` reads top to bottom:

1. **decide**: does this micro-batch count (``accept``, from the caller), and
   does the window close (``k`` micro-batches, or ``emit_now``);
2. **add**: write it into the buffer, unless the window closes (then the
   emitting branch sums it where the inner optimizer reads it; the layout
   can add it first);
3. **emit or not**: one ``lax.cond``. The emitting branch (:func:`emit`)
   reduces the window's sum, runs the inner optimizer once and folds the
   noise estimate; the other returns zeros (or the params, when applying);
4. **advance** the counters.

:func:`emit` is traced once (``jax.jit`` + ``jax.eval_shape``); its output shapes give the
mid-step's zeros, and the conditional calls the traced function.

What the compilers need (which conditional branch passes the buffer through,
the barriers, the updates parked in the dead buffer, where the window's sum
is made, zeros XLA cannot merge)
is the *layout*, kept in its own section below with its HLO evidence in
``benchmarks/NOTES.md``. The array-type facts every module reads (shardings,
unreduced and device-varying axes, the buffer dtype) close the file.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_accum import _arrays
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


class Operands(NamedTuple):
  """What both branches of the window's conditional read."""

  acc: optax.Updates
  mini_step: jax.Array
  grads: optax.Updates
  count: jax.Array
  total_weight: jax.Array  # the window's, over every device
  noise: Any
  inner_state: Any
  params: Any
  emits: jax.Array


def init_window(config: Config, params: optax.Params) -> Window:
  """An empty window: a zero buffer shaped (and sharded) like ``params``.

  Under ``jax.jit`` with explicit sharding and ``axis_name`` naming data axes,
  the buffer is typed *unreduced* over them: each device keeps its partial sum.
  """
  unreduced = _arrays.explicit_axes(config.axis_name, check=False)

  def zeros(p: jax.Array) -> jax.Array:
    dtype = _arrays.accumulator_dtype(jnp.result_type(p), config.acc_dtype)
    if unreduced is None:
      return jnp.zeros_like(p, dtype=dtype)
    spec = jax.sharding.PartitionSpec(
        *_arrays.strip_axes(_arrays.spec_of(p).partitions, unreduced), unreduced=set(unreduced))
    return jnp.zeros(jnp.shape(p), dtype, out_sharding=spec)

  return Window(
      mini_step=jnp.zeros([], jnp.int32),
      gradient_step=jnp.zeros([], jnp.int32),
      acc_grads=jax.tree.map(zeros, params),
      # Unused state costs host time on every call: only weighted windows keep it.
      acc_weight=jnp.zeros([], jnp.float32) if config.reduction == "weighted" else (),
      noise=() if config.noise_decay is None else noise_lib.init(),
  )


# ---------------------------------------------------------------- the algorithm


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
      cannot fail, ``False`` for a flush). A rejected one changes no buffer
      and no counter.
    weight: the micro-batch's weight (``reduction="weighted"`` only).
    emit_now: close the window after this micro-batch even if short.
    apply: return the new params instead of the updates, applied inside the
      emitting branch (mid-steps then never touch the params).
    extra_args: passed to the inner optimizer.
  """
  # 1. Decide: does the window close with this micro-batch?
  k_now = jnp.asarray(config.k, jnp.int32) if isinstance(config.k, int) else window_length(
      config.k, window)
  count = window.mini_step + jnp.asarray(accept, window.mini_step.dtype)
  full = count >= k_now if emit_now is False else jnp.logical_or(count >= k_now, emit_now)
  closes = jnp.logical_and(full, count > 0)
  weighted = config.reduction == "weighted"
  total_weight = window.acc_weight if weighted else jnp.zeros([], jnp.float32)
  if weight is not None:
    total_weight = total_weight + jnp.where(accept, weight, 0.0)
  window_weight = total_weight
  if weighted and config.axis_name is not None and _arrays.explicit_axes(config.axis_name) is None:
    # Per-device weights (shard_map / pmap): the devices agree on the
    # window's total with one scalar all-reduce per micro-step.
    window_weight = lax.psum(total_weight, config.axis_name)
  # A window of total weight 0 (only padding) is not a step: it closes without
  # emitting (zero updates, the inner state kept). The only place that rule lives.
  emits = jnp.logical_and(closes, window_weight != 0) if weighted else closes
  noise = window.noise
  if config.noise_decay is not None:
    noise = noise_lib.add_micro_batch(noise, noise_lib.sq_norm(grads), accept, weight)

  # The emitting branch, traced once: its outputs shape the mid-step's zeros
  # and decide where the updates live (the layout, below).
  ops = Operands(window.acc_grads, window.mini_step, grads, count, window_weight, noise,
                 inner_state, params, emits)
  # Wrapped in jax.jit and traced here by eval_shape, each branch below binds
  # the cached trace as one nested call, which XLA inlines: the inner
  # optimizer's Python runs once per traced update, the program is the same.
  # (Replaying the jaxpr eqn by eqn cost as much as tracing it.)
  run_emit = jax.jit(lambda ops, window_sum: emit(config, ops, window_sum, apply=apply,
                                                  extra_args=extra_args or {}))
  shapes = jax.eval_shape(run_emit, ops, ops.acc)
  layout = choose_layout(config, shapes.out, window.acc_grads, apply=apply)

  # 2. Add: the buffer takes this micro-batch unless the window closes (then
  # the emitting branch gets the window's sum from `window_sum`).
  acc, window_sum = add_to_buffer(config, ops, closes, accept, weight, layout)
  ops = ops._replace(acc=acc)

  # 3. Emit or not.
  def conditional(parks: list[bool] | None) -> Emitted:
    # "A step was taken" leaves the conditional as an output of each branch,
    # not as its predicate: libtpu then fuses the parked updates' read-back
    # with 12 fewer kernels in the chain form (the same passes either way).
    (out, new_inner, new_noise, buffer), stepped = lax.cond(
        emits,
        jax.named_scope(SCOPES["emit"])(lambda ops: (park(
            run_emit(ops, window_sum(ops.acc, ops.mini_step, ops.grads)), ops.acc, parks, layout),
            jnp.asarray(True))),
        jax.named_scope(SCOPES["mid"])(
            lambda ops: (mid(ops, shapes.out, parks, layout, apply), jnp.asarray(False))),
        ops)
    buffer = buffer if layout.emit_writes else acc
    return Emitted(unpark(out, buffer, parks, stepped, shapes.out), new_inner, new_noise, buffer)

  if not layout.writes_sum:
    result = conditional(layout.parks)
  else:  # with the noise estimate, the TPU keeps the window's sum in the buffer (see parking)
    result = lax.platform_dependent(tpu=lambda: conditional(None),
                                    default=lambda: conditional(layout.parks_with_noise))

  # 4. Advance.
  new_window = Window(
      mini_step=jnp.where(closes, jnp.zeros_like(count), count),
      gradient_step=jnp.where(emits, optax.safe_increment(window.gradient_step),
                              window.gradient_step),
      acc_grads=result.buffer,
      acc_weight=jnp.where(closes, jnp.zeros_like(total_weight), total_weight)
      if weighted else window.acc_weight,
      noise=result.noise)
  return StepOut(result.out, new_window, result.inner_state, emits)


def window_length(k: KSchedule | noise_lib.AdaptiveK, window: Window) -> jax.Array:
  """``k`` for this window; a schedule is checked when concrete, clamped under jit."""
  if isinstance(k, noise_lib.AdaptiveK):
    return k(window.noise)
  value = k(window.gradient_step)
  if not isinstance(value, jax.core.Tracer):
    concrete = int(jnp.asarray(value))
    if concrete < 1:
      raise ValueError(
          f"The `k` schedule returned {concrete} at gradient_step"
          f" {int(window.gradient_step)}; a window needs at least 1 micro-batch. Make"
          " the schedule return an int >= 1 for every step. (Under jit such"
          " values are clamped to 1.)"
      )
  return jnp.maximum(jnp.asarray(value).astype(jnp.int32), 1)


def buffer_after(config: Config, acc: optax.Updates, mini_step: jax.Array, grads: optax.Updates,
                 accept: Any, weight: jax.Array | None) -> optax.Updates:
  """The buffer with this micro-batch added: one fused expression per leaf.

  The buffer's old contents count only while ``mini_step > 0``; they are
  discarded with a select, never multiplied, so a NaN left behind never
  reaches a later window. A micro-batch of weight 0 adds nothing (its
  gradient may be NaN: the mean loss of pure padding). A rejected one
  (``accept`` False) leaves the buffer as it is.
  """
  if accept is False:
    return acc
  stale = mini_step == 0
  inv_next = 1.0 / (mini_step + 1).astype(jnp.float32)

  # lax, not jnp: this runs on every leaf twice per traced step.
  def add(acc: jax.Array, g: jax.Array) -> jax.Array:
    g = lax.convert_element_type(g, acc.dtype)
    zero = lax.full_like(acc, 0)  # (a scalar 0 is not allowed with unreduced types)
    old = lax.select(stale, zero, acc)
    if weight is not None:
      w = lax.convert_element_type(weight, acc.dtype)
      unreduced = _arrays.array_type(acc).unreduced
      if unreduced:  # an unreduced array multiplies by a *reduced* scalar
        w = jax.reshard(w, jax.sharding.PartitionSpec(reduced=set(unreduced)))
      g = lax.select(weight != 0, g * w, zero)
    if config.running_mean:  # optax.MultiSteps' Welford update
      new = old + (g - old) * inv_next.astype(acc.dtype)
    else:
      new = lax.add(old, g)
    return new if accept is True else lax.select(jnp.asarray(accept), new, acc)

  return jax.tree.map(add, acc, grads)


def emit(config: Config, ops: Operands, window_sum: optax.Updates, *, apply: bool,
         extra_args: dict[str, Any]) -> Emitted:
  """The emitting branch: reduce the window, run the inner optimizer once.

  The reduced gradient is the window's sum (this device's ``window_sum``,
  reduced across devices with ``axis_name``) times its scale (1 / count,
  1 / total weight, or 1), in the wider of each gradient's and param's dtype.
  The window's sum is returned too, for the layout that keeps it in the
  buffer.
  """
  tracking = config.noise_decay is not None
  window_k = ops.noise.window_count if tracking else ops.count
  # Per device under shard_map / pmap (the total weight is global already).
  totals = jnp.stack([ops.count.astype(jnp.float32), window_k.astype(jnp.float32),
                      ops.noise.window_sq_norms if tracking else jnp.zeros([], jnp.float32)])
  if config.axis_name is not None and _arrays.explicit_axes(config.axis_name) is None:
    # shard_map / pmap: the scalars are per device
    totals, window_sum = all_reduce(config.axis_name, totals, window_sum)
  elif config.axis_name is not None:
    # jit with unreduced buffers: an all-reduce, or a reduce-scatter to sharded params
    window_sum = jax.tree.map(
        lambda a, t: jax.reshard(a, jax.sharding.PartitionSpec(*_arrays.spec_of(t).partitions)),
        window_sum, ops.acc if ops.params is None else ops.params)
  total_weight, count, window_k, window_sq = ops.total_weight, totals[0], totals[1], totals[2]
  # In the buffer's precision (float64 buffers would lose digits to a float32 1/3).
  wide = jnp.finfo(jnp.result_type(jnp.float32, *filter(
      lambda a: jnp.issubdtype(a.dtype, jnp.inexact), jax.tree.leaves(ops.acc)))).dtype
  # (A window of total weight 0 does not emit; a running mean is a mean already.)
  scale = reduction_scale("sum" if config.running_mean else config.reduction, count,
                          total_weight, wide)
  # XLA's GPU compiler turns a conditional whose branches hold only cheap
  # elementwise work into selects, and then the inner optimizer would run on
  # every micro-step. A barrier is not elementwise: the conditional stays.
  kept_scale = lax.optimization_barrier(scale)
  noise = ops.noise
  if tracking:
    leaf_sq = jax.tree.map(noise_lib.sq_norm, window_sum)
    total_sq = functools.reduce(lax.add, jax.tree.leaves(leaf_sq), jnp.zeros([], jnp.float32))
    mean = scale if config.reduction != "sum" else 1.0 / count
    noise = noise_lib.fold_window(noise, noise_lib.WindowStats(
        window_sq_norms=window_sq, window_count=window_k.astype(jnp.int32),
        total_weight=total_weight if config.reduction == "weighted" else window_k,
        mean_sq_norm=total_sq * mean**2), config.noise_decay)
    # Each leaf's norm reads the sum before that leaf's updates overwrite it.
    scales = ordered_after(kept_scale, leaf_sq)
  else:
    scales = jax.tree.map(lambda _: kept_scale, window_sum)
  dtypes = ops.grads if ops.params is None else ops.params
  reduced = jax.tree.map(
      lambda a, scale, g, d: (a * scale.astype(a.dtype)).astype(
          jnp.promote_types(jnp.result_type(g), jnp.result_type(d))),
      window_sum, scales, ops.grads, dtypes)

  out, new_inner = reduced, ops.inner_state  # the chain form emits the reduced gradient
  if config.inner is not None:
    updates, new_inner = config.inner.update(reduced, ops.inner_state, ops.params, **extra_args)
    # Optimizers may promote their state (Adam's f16 moments on f32 gradients);
    # both branches of the cond, and lax.scan, need stable dtypes.
    new_inner = optax.tree.cast_like(new_inner, ops.inner_state)
    out = optax.apply_updates(ops.params, updates) if apply else updates
  return Emitted(out, new_inner, noise, window_sum)


def reduction_scale(reduction: str, count: jax.Array, total_weight: jax.Array | None,
                    dtype: Any) -> jax.Array:
  """The factor that turns a window's sum into its reduction, in ``dtype``.

  ``1 / count`` for ``"mean"``, ``1 / total_weight`` for ``"weighted"`` (0 for
  a total weight of 0, a window of only padding), 1 for ``"sum"``. The one
  rule behind ``accumulate``, ``MultiSteps`` and ``microbatched``.
  """
  if reduction == "weighted":
    total = jnp.asarray(total_weight).astype(dtype)
    return jnp.where(total == 0, jnp.zeros([], dtype), 1.0 / jnp.where(total == 0, 1, total))
  if reduction == "mean":
    return 1.0 / jnp.asarray(count).astype(dtype)
  return jnp.ones([], dtype)


def all_reduce(axis_name: Any, scalars: Any, tree: Any,
               scatter: list[Any] | None = None) -> tuple[Any, Any]:
  """``scalars`` and ``tree`` summed over the manual axes ``axis_name``: one ``psum``.

  The cross-device reduction of ``accumulate``/``MultiSteps`` under
  ``shard_map``/``pmap`` and of ``microbatched`` alike. ``scatter`` (one entry
  per leaf of ``tree``, or None) names leaves to reduce-scatter instead,
  ``(dim, axes)``: tiled onto that dimension, one ``psum_scatter`` each.
  """
  leaves, treedef = jax.tree.flatten(tree)
  scatter = scatter or [None] * len(leaves)
  plain = [g for g, s in zip(leaves, scatter, strict=True) if s is None]
  scalars, plain = lax.psum((scalars, plain), axis_name)
  summed = iter(plain)
  leaves = [next(summed) if s is None else
            lax.psum_scatter(g, s[1], scatter_dimension=s[0], tiled=True)
            for g, s in zip(leaves, scatter, strict=True)]
  return scalars, jax.tree.unflatten(treedef, leaves)


class Emitted(NamedTuple):
  """What a branch of the window's conditional returns."""

  out: Any
  inner_state: Any
  noise: Any
  # From emit, the window's sum; once laid out (park, mid), the buffer the
  # branch leaves: the sum, the parked updates, the buffer itself, or ().
  buffer: Any


def mid(ops: Operands, shapes: Any, parks: list[bool] | None, layout: Layout, apply: bool,
        ) -> Emitted:
  """The non-emitting branch: zero updates (or the params untouched).

  The zeros are one independent broadcast per leaf: plain ``zeros_like``
  leaves are identical HLO that XLA merges into one buffer and then copies
  into each output (nearly two passes instead of one). ``emits`` is False
  here, but XLA cannot know it, so no two leaves look alike. Each leaf takes
  its target's type (sharding, device variance): both branches of a cond
  must agree. Parked leaves get none: they are read back, masked, after the
  conditional.
  """
  out = ops.params
  if not apply:
    leaves, treedef = jax.tree.flatten(shapes)
    out = []
    for i, s in enumerate(leaves):
      if parks is not None and parks[i]:
        out.append(None)
        continue
      like = _arrays.array_type(s)
      value = lax.convert_element_type(ops.emits, s.dtype) * (i + 1)  # i + 1 if emits, else 0
      z = lax.broadcast_in_dim(value, s.shape, (), out_sharding=like.explicit_spec)
      out.append(_arrays.match_varying(z, s))
    out = out if parks is not None else jax.tree.unflatten(treedef, out)
  buffer = ops.acc if layout.emit_writes else ()
  return Emitted(out, ops.inner_state, ops.noise, buffer)


# ------------------------------------------------------------------- the layout
#
# Where the updates live and which branch passes the buffer through: what
# XLA:CPU, XLA:GPU and libtpu need to copy nothing and hold no temporaries
# (benchmarks/NOTES.md has the HLO of each; tests/test_parking.py pins the
# choices). Besides the barrier and the distinct zeros above, the algorithm
# calls these names only: choose_layout, add_to_buffer, park, unpark,
# ordered_after.


class Layout(NamedTuple):
  """Where the emitting step's outputs go.

  Attributes:
    parks: per leaf of the updates, whether it is written into the dead
      buffer (None: none parks).
    parks_with_noise: the same with the noise estimate (None without it),
      except on a TPU, where the window's sum goes into the buffer instead.
    writes_sum: with the noise estimate, the buffer holds the window's sum
      where the updates do not park: XLA:CPU adds the closing micro-batch
      into it before the conditional, the other backends' emitting branch
      writes the sum it makes on the fly.
    emit_writes: the emitting branch writes the buffer at all, which decides
      the branch order of the buffer's conditional.
  """

  parks: list[bool] | None
  parks_with_noise: list[bool] | None
  writes_sum: bool
  emit_writes: bool


def choose_layout(config: Config, updates: Any, buffer: optax.Updates, *, apply: bool) -> Layout:
  """The layout for these updates (see :func:`parking`)."""
  noise = config.noise_decay is not None and config.axis_name is None
  parks = None if apply else parking(config, updates, buffer)
  with_noise = None if apply or not noise else parking(config, updates, buffer, noise_parks=True)
  return Layout(parks=parks, parks_with_noise=with_noise, writes_sum=noise,
                emit_writes=noise or parks is not None)


def parking(config: Config, updates: Any, buffer: optax.Updates, *, noise_parks: bool = False,
            ) -> list[bool] | None:
  """Which leaves of the updates the emitting branch writes into the buffer.

  Once the window closes the buffer is dead (the next window resets it
  lazily), so the updates can live there: ``update`` then returns
  ``where(stepped, buffer, 0)``, which XLA fuses into ``apply_updates``. The
  conditional then outputs no parameter-sized updates: no temporaries, and
  the mid-step writes no zeros (6 passes over the params instead of 7). A
  leaf parks when the buffer leaf holds its value bit for bit, in place:
  same shape, sharding and device variance, the same dtype or an exact
  widening; the others are returned as usual. Not under ``axis_name`` (the
  reduction materialises the sum elsewhere).

  The noise estimate reads the window's sum too. Computed on the fly for both
  readers, XLA:GPU fuses it (no temporaries), XLA:CPU materialises it (1.0x)
  and libtpu holds more (0.49x -> 0.79x on a v5e) than with the sum kept in
  the buffer and the updates out of the conditional. XLA:CPU holds nothing
  when the buffer takes the closing micro-batch first and the updates
  overwrite the sum once its norm is read (:func:`ordered_after`). So with the
  noise estimate the updates park only when ``noise_parks`` (every backend
  but the TPU). None when no leaf parks.
  """
  if config.axis_name is not None or (config.noise_decay is not None and not noise_parks):
    return None
  if jax.tree.structure(updates) != jax.tree.structure(buffer):
    return None
  parks = []
  for u, b in zip(jax.tree.leaves(updates), jax.tree.leaves(buffer), strict=True):
    u_dtype, b_dtype = jnp.dtype(u.dtype), jnp.dtype(b.dtype)
    u_type, b_type = _arrays.array_type(u), _arrays.array_type(b)
    parks.append((u_dtype == b_dtype or (u_dtype, b_dtype) in _EXACT_WIDENINGS)
                 and tuple(u.shape) == tuple(b.shape) and u_type.varying == b_type.varying
                 and u_type.explicit_spec == b_type.explicit_spec and not b_type.unreduced)
  return parks if any(parks) else None


_EXACT_WIDENINGS = {
    (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)),
    (jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)),
    (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float64)),
    (jnp.dtype(jnp.float16), jnp.dtype(jnp.float64)),
    (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)),
}


def add_to_buffer(config: Config, ops: Operands, closes: jax.Array, accept: Any,
                  weight: jax.Array | None, layout: Layout,
                  ) -> tuple[optax.Updates, Callable[..., optax.Updates]]:
  """The buffer after this call, and how the emitting branch gets the window's sum.

  The buffer is written in place, unless the window closes; the window's sum
  (``window_sum(buffer, mini_step, grads)``, called in the emitting branch)
  is then made on the fly, the buffer plus the closing micro-batch, where the
  inner optimizer reads it.

  On XLA:GPU and libtpu the add is a conditional of its own, so the closing
  micro-step neither writes nor rereads the buffer (two passes fewer). Which
  branch passes the buffer through decides whether XLA:GPU copies every
  buffer of the two conditionals: the true one when the emitting conditional
  writes the buffer too. A conditional whose branch is cheap elementwise work
  becomes selects on XLA:GPU (a pass on every step); a barrier is not
  elementwise. XLA:CPU gets a select instead: there a second conditional
  costs more time than the two passes it saves (every row of
  ``benchmarks/ab_cores.py`` 0.90-0.98x with the select, benchmarks/NOTES.md).
  With the noise estimate (``layout.writes_sum``) XLA:CPU adds the closing
  micro-batch too, and the emitting branch reads the window's sum from the
  buffer (see :func:`parking`).
  """
  summed = lambda acc, mini_step, g: buffer_after(config, acc, mini_step, g, accept, weight)
  window_sum = summed
  if layout.writes_sum:  # called by the noise program's two conditionals: traced once
    summed = jax.jit(summed)
    window_sum = lambda *operands: lax.platform_dependent(
        *operands, cpu=lambda acc, *_: acc, default=summed)
  if accept is False:
    return ops.acc, window_sum
  writes = jnp.logical_not(closes)
  if accept is not True:
    writes = jnp.logical_and(writes, accept)
  cpu_writes = accept if layout.writes_sum else writes
  # Traced once (jax.jit), called by whichever form the backend gets.
  write = jax.jit(jax.named_scope(SCOPES["add"])(lambda acc, g: buffer_after(
      config, acc, lax.optimization_barrier(ops.mini_step), g, True, weight)))
  keep = lambda acc, _: acc
  select = lambda acc, g: write(acc, g) if cpu_writes is True else jax.tree.map(
      lambda new, old: lax.select(jnp.asarray(cpu_writes), new, old), write(acc, g), acc)
  if layout.emit_writes:
    conditional = lambda acc, g: lax.cond(jnp.logical_not(writes), keep, write, acc, g)
  else:
    conditional = lambda acc, g: lax.cond(writes, write, keep, acc, g)
  return lax.platform_dependent(ops.acc, ops.grads, cpu=select, default=conditional), window_sum


def ordered_after(scale: jax.Array, sq_norms: Any) -> Any:
  """``scale`` per leaf of ``sq_norms``, each made to depend on that leaf's squared norm.

  With the window's sum in the buffer and the updates parked there, the norm
  and the inner optimizer both read the buffer that the updates overwrite.
  Nothing orders the norm's reduction before that write, so XLA:CPU's copy
  insertion copies every leaf of the buffer on every step (8 copies for 8
  leaves); an ``optimization_barrier`` over the scale and the norms does not
  help, XLA:CPU expands it first. A data dependency does: each leaf's updates
  are scaled by a value that waits for that leaf's norm. The select never
  picks ``2 * scale`` (a squared norm is never negative and NaN compares
  False), but XLA cannot know it. Per leaf, because one scale waiting for
  every norm made XLA:CPU's compile of a 300-leaf step 10x slower (64 s
  against 6.6 s). XLA:CPU only: the other backends sum on the fly, and the
  H200 compiler given the dependency launched 7 more kernels per emitting
  step (62 against 55, 13 passes against 11). Elsewhere both choices are
  ``scale``, XLA folds each select away, and the programs are as before.
  """
  other = lax.platform_dependent(scale, cpu=lambda scale: scale * 2, default=lambda scale: scale)
  zero = jnp.zeros([], jnp.float32)
  return jax.tree.map(lambda n: lax.select(lax.lt(n, zero), other, scale), sq_norms)


def park(emitted: Emitted, buffer: optax.Updates, parks: list[bool] | None,
         layout: Layout) -> Emitted:
  """The emitting branch's outputs laid out: the parked updates (or the sum) in the buffer."""
  out = emitted.out
  if parks is not None:
    leaves = jax.tree.leaves(out)
    bufs, treedef = jax.tree.flatten(buffer)
    out = [None if p else u for u, p in zip(leaves, parks, strict=True)]
    buffer = jax.tree.unflatten(treedef, [u.astype(b.dtype) if p else b
                                          for u, b, p in zip(leaves, bufs, parks, strict=True)])
  else:
    buffer = emitted.buffer if layout.writes_sum else ()
  return emitted._replace(out=out, buffer=buffer)


def unpark(out: Any, buffer: optax.Updates, parks: list[bool] | None, stepped: jax.Array,
           shapes: Any) -> Any:
  """The updates: parked leaves read back from the buffer, zeros unless ``stepped``."""
  if parks is None:
    return out
  like, treedef = jax.tree.flatten(shapes)
  return jax.tree.unflatten(treedef, [
      lax.select(stepped, lax.convert_element_type(b, s.dtype),
                 lax.full_like(b, 0, s.dtype)) if p else u
      for u, b, p, s in zip(out, jax.tree.leaves(buffer), parks, like, strict=True)])
