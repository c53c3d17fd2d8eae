"""The accumulation window: the one algorithm behind ``accumulate`` and ``MultiSteps``.

:func:`micro_step` reads top to bottom, the same on every backend:

1. **decide** (:func:`decide`): does this micro-batch count (``accept``, from
   the caller), and does the window close (``k`` micro-batches, or
   ``emit_now``), and emit (not a window of weight 0);
2. **add** it to the buffer (:func:`buffer_after`): one fused pass per leaf,
   ``where(mini_step == 0, 0, acc) + g`` (the lazy reset: a NaN from a past
   window is dropped by a select, never multiplied), inside step 3's branches;
3. **emit or not**: the emitting branch (:func:`emit`, traced once under
   ``jax.jit``: ``jax.eval_shape`` reads its types, the branch reuses the
   trace) reduces the buffer and runs the inner optimizer once; the other
   (:func:`mid`) returns zeros, or the params when applying. Where the updates
   fit the buffer exactly, one ``lax.cond`` whose emitting branch writes them
   into it, dead once its window closed (:func:`parking`, :func:`park`,
   :func:`unpark`). Otherwise two: the add's on mid-steps, then the update's,
   which adds the closing micro-batch where the optimizer reads it;
4. **advance** the counters.

Around it, the apply protocol both transforms share (:class:`Applied`,
:func:`stepped`).

Each compiler-facing choice names, at its line, the section of
``docs/development/compiler_evidence.md`` that holds its evidence.
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

from optax_accum import _arrays, _copies, _rounding, _state, _validation
from optax_accum import gradient_noise as noise_lib

KSchedule = Callable[[jax.Array], Any]

# Named scopes: they reach the compiled program's op_name metadata, so a
# profile tells which kernels run on mid-steps (add, mid) and which on
# emitting steps.
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
    axis_name: the data axis (or tuple) to reduce over at emit: of ``pmap``/``shard_map``,
      or Explicit mesh axes under plain jit (``layout`` says which).
    noise_decay: the decay of the noise-scale averages, or None (not tracked).
    layout: where this call's per-device values live for ``axis_name`` on its mesh (one
      device, manual axes, per-device copies): the transform sets it once per call.
  """

  k: int | KSchedule | noise_lib.AdaptiveK
  inner: optax.GradientTransformationExtraArgs | None
  reduction: str = "mean"
  running_mean: bool = False
  acc_dtype: jnp.dtype | None = None
  axis_name: Any = None
  noise_decay: float | None = None
  layout: _arrays.Layout = _arrays.ONE_DEVICE


class Window(NamedTuple):
  """The accumulation state one micro-step reads and writes (inner state aside)."""

  mini_step: jax.Array
  gradient_step: jax.Array
  acc_grads: optax.Updates
  acc_weight: jax.Array | tuple[()]  # () unless reduction="weighted"
  noise_stats: noise_lib.NoiseScaleState | tuple[()]


class StepOut(NamedTuple):
  """What :func:`micro_step` returns."""

  out: Any  # the updates, or the new params when applying
  window: Window
  inner_state: optax.OptState
  emitted: jax.Array  # this call took an optimizer step
  closes: jax.Array  # the window closed with this call (a window of weight 0 too)


class Operands(NamedTuple):
  """What both branches of the window's conditional read, besides the buffer."""

  count: jax.Array  # the window's micro-batches, this one included (per device under shard_map)
  total_weight: jax.Array  # the window's, over every device
  noise: Any
  inner_state: Any
  params: Any
  grads: optax.Updates  # this micro-batch's: added in the branches when updates park


class Emitted(NamedTuple):
  """What a branch of the window's conditional computes."""

  out: Any  # the updates (None where a leaf parks), or the params when applying
  inner_state: Any
  noise: Any


class Decision(NamedTuple):
  """Whether the window closes with this micro-batch, and what it weighs."""

  count: jax.Array  # micro-batches in the window, this one included
  closes: jax.Array  # the window closes: its counters restart
  emits: jax.Array  # ... and takes an optimizer step (not a window of weight 0)
  total_weight: jax.Array  # this device's weight total (0 unless weighted)
  window_weight: jax.Array  # the window's, over every device


def init_window(config: Config, params: optax.Params) -> Window:
  """An empty window: a zero buffer shaped (and sharded) like ``params``.

  Under plain jit with ``axis_name`` naming Explicit axes each device keeps its
  own partial sums: every per-device leaf (``_state.STATE``; the weight
  total aside, a global scalar there) holds one copy per device, stacked along
  a leading axis sharded over them (``_copies.zeros``).
  """
  def empty(params: optax.Params) -> Window:
    return Window(
        mini_step=jnp.zeros([], jnp.int32),
        gradient_step=jnp.zeros([], jnp.int32),
        acc_grads=jax.tree.map(lambda p: jnp.zeros_like(p, dtype=_arrays.accumulator_dtype(
            jnp.result_type(p), config.acc_dtype)), params),
        # Unused state costs host time on every call: only weighted windows keep it.
        acc_weight=jnp.zeros([], jnp.float32) if config.reduction == "weighted" else (),
        noise_stats=() if config.noise_decay is None else noise_lib.init())

  if config.layout.stacked is None:
    return empty(params)
  copies = _state.map_state(lambda s: _copies.zeros(
      s.shape, s.dtype, _arrays.array_type(s).spec, config.layout.stacked), jax.eval_shape(
          empty, params), skip=("acc_weight",))
  return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype) if isinstance(
      x, jax.ShapeDtypeStruct) else x, copies)


class Applied:
  """The new params, in place of updates: what ``update(..., apply=True)`` returns.

  :func:`~optax_accum.update_and_apply` unwraps it (``.params``). Deliberately not a
  pytree: a transform placed after the accumulation in a chain would otherwise
  treat params as updates; it fails loudly instead.
  """

  __slots__ = ("params",)

  def __init__(self, params: optax.Params):
    self.params = params

  def __jax_array__(self) -> None:
    raise TypeError(
        "`update_and_apply`: a transform after `accumulate(k, optimizer)` in a"
        " chain tried to use its output. Put such transforms inside:"
        " `accumulate(k, optax.chain(...))`, or use `tx.update` +"
        " `optax.apply_updates`."
    )


def stepped(state: Any) -> jax.Array:
  """Whether the last update took an optimizer step, as optax defines it (``MultiStepsState``)."""
  return jnp.logical_and(jnp.asarray(state.mini_step) == 0, jnp.asarray(state.gradient_step) > 0)


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
  # 1. Decide: does the window close, and does it emit?
  layout = config.layout  # one device, manual axes, or plain jit's per-device copies
  d = decide(config, window, accept, weight, emit_now)
  noise = window.noise_stats
  if config.noise_decay is not None:
    sq_norm, device_weight = (noise_lib.sq_norm(grads), weight) if layout.stacked is None else (
        noise_lib.per_device_micro_batch(grads, weight))
    noise = noise_lib.add_micro_batch(noise, sq_norm, accept, device_weight)
  ops = Operands(d.count, d.window_weight, noise, inner_state, params, grads)

  # 2. Add this micro-batch: where(mini_step == 0, 0, acc) + w * g.
  seed = (window.gradient_step, window.mini_step)  # the narrow buffer's rounding
  if layout.manual:  # shard_map / pmap: each device rounds independently
    seed += (lax.axis_index(config.axis_name),)
  add = jax.named_scope(SCOPES["add"])(functools.partial(
      buffer_after, config, mini_step=window.mini_step, accept=accept, weight=weight, seed=seed))

  # 3. Emit or not: one conditional where updates park, else the add's (mid-steps) and the
  # update's. Each passes what it does not write through as branch 0, the one whose operands
  # the TPU compiler keeps in place (docs/development/compiler_evidence.md, "Two conditionals").
  # Under jax.jit the trace that gives the types of the updates (or params) is cached: the
  # conditional's branch binds it again, and the inner optimizer's Python runs once.
  run_emit = jax.jit(functools.partial(emit, config, apply=apply, extra_args=extra_args or {}))
  updates_like = jax.eval_shape(run_emit, ops, window.acc_grads).out
  parks = parking(config, updates_like, window.acc_grads, apply=apply)
  parked = any(jax.tree.leaves(parks))
  waiting = functools.partial(mid, updates_like=updates_like, parks=parks, apply=apply)

  if parked:
    # Both branches add: a buffer one branch passes through is copied by the H200 compiler
    # (the same page); the emitting one parks the updates in it.
    def emitting(ops: Operands, acc: optax.Updates) -> tuple[Emitted, optax.Updates]:
      window_sum = add(acc, ops.grads)
      emitted = run_emit(ops, window_sum)
      updates, buffer = park(emitted.out, window_sum, parks)
      return emitted._replace(out=updates), buffer

    (out, new_inner, new_noise), buffer = lax.cond(
        d.emits,
        jax.named_scope(SCOPES["emit"])(streamed(emitting, inner_state, parked=True)),
        jax.named_scope(SCOPES["mid"])(lambda ops, acc: (waiting(ops), add(acc, ops.grads))),
        ops, window.acc_grads)
    out = unpark(out, buffer, parks, d.emits, updates_like)
  else:
    # The add's conditional writes the buffer on mid-steps; the emitting branch adds the
    # micro-batch where the inner optimizer reads it (no pass of its own, no write of the
    # buffer, dead once the window closed). The noise estimate reads the window's sum twice:
    # there it is the buffer (else a temporary: the TPU compiler's, "Two conditionals").
    closing = lambda ops, acc: run_emit(ops, add(acc, ops.grads))
    if config.noise_decay is None:
      buffer = lax.cond(jnp.logical_not(d.emits), add, lambda acc, grads: acc,
                        window.acc_grads, grads)
    else:
      buffer, closing = add(window.acc_grads, grads), run_emit
    out, new_inner, new_noise = lax.cond(
        d.emits,
        jax.named_scope(SCOPES["emit"])(streamed(closing, inner_state, parked=False)),
        jax.named_scope(SCOPES["mid"])(lambda ops, acc: waiting(ops)), ops, buffer)

  # 4. Advance.
  new_window = Window(
      mini_step=jnp.where(d.closes, jnp.zeros_like(d.count), d.count),
      gradient_step=jnp.where(d.emits, optax.safe_increment(window.gradient_step),
                              window.gradient_step),
      acc_grads=buffer,
      acc_weight=jnp.where(d.closes, jnp.zeros_like(d.total_weight), d.total_weight)
      if config.reduction == "weighted" else window.acc_weight,
      noise_stats=new_noise)
  return StepOut(out, new_window, new_inner, d.emits, d.closes)


def streamed(branch: Callable[..., Any], inner_state: Any, *, parked: bool) -> Callable[..., Any]:
  """The emitting ``branch``, its inner state streamed through the device where it is kept in
  host memory (``host_state``): each piece of the state comes to the device for the branch's
  own arithmetic on that piece (the window's mean, the update, its application) and goes back.
  The params and the buffer are written in place, a piece at a time. Else ``branch`` itself."""
  if not any(jax.typeof(x).memory_space == jax.memory.Space.Host
             for x in jax.tree.leaves(inner_state)):
    return branch
  from optax_accum import offload

  state = Emitted(False, True, False)  # the new inner state goes back to host memory
  return lambda ops, acc: offload.streamed(branch, acc, (ops, acc),
                                           lambda out: (state, False) if parked else state)


def decide(config: Config, window: Window, accept: Any, weight: jax.Array | None,
           emit_now: Any) -> Decision:
  """Does the window close with this micro-batch (``k`` of them, or ``emit_now``)?

  A window of total weight 0 (only padding) is not a step: it closes without
  emitting (zero updates, the inner state kept). The only place that rule lives.
  """
  k_now = (jnp.asarray(config.k, jnp.int32) if isinstance(config.k, int)
           else window_length(config.k, window))
  count = window.mini_step + jnp.asarray(accept, window.mini_step.dtype)
  full = count >= k_now if emit_now is False else jnp.logical_or(count >= k_now, emit_now)
  closes = jnp.logical_and(full, count > 0)
  weighted = config.reduction == "weighted"
  total_weight = window.acc_weight if weighted else jnp.zeros([], jnp.float32)
  if weight is not None:
    total_weight = total_weight + jnp.where(accept, weight, 0.0)
  window_weight = total_weight
  if weighted and config.layout.manual:
    # Per-device weights (shard_map / pmap): the devices agree on the
    # window's total with one scalar all-reduce per micro-step.
    window_weight = lax.psum(total_weight, config.axis_name)
  emits = jnp.logical_and(closes, window_weight != 0) if weighted else closes
  return Decision(count, closes, emits, total_weight, window_weight)


def window_length(k: KSchedule | noise_lib.AdaptiveK, window: Window) -> jax.Array:
  """``k`` for this window; a schedule is checked when concrete, clamped under jit."""
  if isinstance(k, noise_lib.AdaptiveK):
    return k(window.noise_stats)
  return _validation.check_schedule_value(k(window.gradient_step), window.gradient_step)


def buffer_after(config: Config, acc: optax.Updates, grads: optax.Updates, *,
                 mini_step: jax.Array, accept: Any, weight: jax.Array | None,
                 seed: tuple[Any, ...] = ()) -> optax.Updates:
  """The buffer with this micro-batch added: one fused expression per leaf.

  The buffer's old contents count only while ``mini_step > 0``; they are
  discarded with a select, never multiplied, so a NaN left behind never
  reaches a later window. A micro-batch of weight 0 adds nothing (its
  gradient may be NaN: the mean loss of pure padding). A rejected one
  (``accept`` False) leaves the buffer as it is. A 16-bit buffer computes the
  new value in float32 and rounds it stochastically (unbiased; round to
  nearest would stall the sum), with random bits hashed from ``seed`` (the
  window's counters), the leaf and the element: reruns are bit-identical.
  """
  if accept is False:
    return acc
  stale = mini_step == 0
  inv_next = 1.0 / (mini_step + 1).astype(jnp.float32)

  # lax, not jnp: this runs on every leaf of every traced step.
  def add(acc: jax.Array, g: jax.Array, leaf: int) -> jax.Array:
    wide = _arrays.accumulator_dtype(acc.dtype)  # a 16-bit buffer adds in float32
    g = lax.convert_element_type(g, wide)
    zero = lax.full_like(acc, 0, wide)
    old = lax.select(stale, zero, lax.convert_element_type(acc, wide))
    if weight is not None:
      g = lax.select(weight != 0, g * lax.convert_element_type(weight, wide), zero)
    if config.running_mean:  # optax.MultiSteps' Welford update
      new = old + (g - old) * inv_next.astype(wide)
    else:
      new = lax.add(old, g)
    if wide != acc.dtype:
      bits = _rounding.random_bits(acc.shape, [*seed, leaf], _arrays.array_type(acc).explicit_spec)
      new = _rounding.round_stochastic(new, acc.dtype, bits)
    return new if accept is True else lax.select(jnp.asarray(accept), new, acc)

  leaf_ids = jax.tree.unflatten(jax.tree.structure(acc), range(len(jax.tree.leaves(acc))))
  return jax.tree.map(add, acc, grads, leaf_ids)


def emit(config: Config, ops: Operands, window_sum: optax.Updates, *, apply: bool,
         extra_args: dict[str, Any]) -> Emitted:
  """The emitting branch: reduce the window, run the inner optimizer once.

  The reduced gradient is the window's sum (this device's ``window_sum``,
  reduced across devices with ``axis_name``) times its scale (1 / count,
  1 / total weight, or 1), in the wider of each gradient's and param's dtype.
  """
  tracking = config.noise_decay is not None
  window_k = ops.noise.window_count if tracking else ops.count
  window_sq = ops.noise.window_sq_norms if tracking else jnp.zeros([], jnp.float32)
  if config.layout.stacked is not None:  # plain jit: the copies summed, laid out like the params
    window_sum = jax.tree.map(_copies.total, window_sum, _copies.param_layout(
        window_sum, ops.params))
    window_k, window_sq = jnp.sum(window_k), jnp.sum(window_sq)
  # Per device under shard_map / pmap (the total weight is global already).
  totals = jnp.stack([ops.count.astype(jnp.float32), window_k.astype(jnp.float32), window_sq])
  if config.layout.manual:
    totals, window_sum = all_reduce(config.axis_name, totals, window_sum)
  total_weight, count, window_k, window_sq = ops.total_weight, totals[0], totals[1], totals[2]
  # In the buffer's precision (float64 buffers would lose digits to a float32 1/3).
  wide = jnp.finfo(jnp.result_type(jnp.float32, *filter(
      lambda a: jnp.issubdtype(a.dtype, jnp.inexact), jax.tree.leaves(window_sum)))).dtype
  # (A window of total weight 0 does not emit; a running mean is a mean already.)
  scale = reduction_scale("sum" if config.running_mean else config.reduction, count,
                          total_weight, wide)
  # Keeps the conditional: XLA's GPU compiler turns one of cheap elementwise branches into
  # selects (docs/development/compiler_evidence.md, "The barrier that keeps the conditional").
  scale = lax.optimization_barrier(scale)
  noise = ops.noise
  if tracking:
    window_sq_norm = noise_lib.sq_norm(window_sum)
    mean = scale if config.reduction != "sum" else 1.0 / count
    noise = noise_lib.fold_window(noise, noise_lib.WindowStats(
        window_sq_norms=window_sq, window_count=window_k.astype(jnp.int32),
        total_weight=total_weight if config.reduction == "weighted" else window_k,
        mean_sq_norm=window_sq_norm * mean**2), config.noise_decay)
  # (A 16-bit buffer's sum is scaled in float32.)
  reduced = jax.tree.map(
      lambda a, g, p: (a.astype(jnp.promote_types(a.dtype, wide)) * scale).astype(
          _arrays.promote_types(jnp.result_type(g), jnp.result_type(p))),
      window_sum, ops.grads, ops.grads if ops.params is None else ops.params)

  out, new_inner = reduced, ops.inner_state  # the chain form emits the reduced gradient
  if config.inner is not None:
    updates, new_inner = config.inner.update(reduced, ops.inner_state, ops.params, **extra_args)
    # Optimizers may promote their state (Adam's f16 moments on f32 gradients);
    # both branches of the cond, and lax.scan, need stable dtypes.
    new_inner = optax.tree.cast_like(new_inner, ops.inner_state)
    if ops.params is not None:  # a state laid out apart from the params (ZeRO-1): the params'
      updates = jax.tree.map(_arrays.laid_out_like, updates, ops.params)
    out = optax.apply_updates(ops.params, updates) if apply else updates
  return Emitted(out, new_inner, noise)


def mid(ops: Operands, *, updates_like: Any, parks: Any, apply: bool) -> Emitted:
  """The non-emitting branch: zero updates (or the params untouched).

  Each leaf of zeros takes its target's type (sharding, device variance):
  both branches of a cond must agree. A parked leaf gets none (None): it is
  read back, masked, after the conditional.
  """
  out = ops.params if apply else jax.tree.map(
      lambda s, parked: None if parked else _arrays.match_varying(_arrays.filled(s, s.dtype), s),
      updates_like, parks)
  return Emitted(out, ops.inner_state, ops.noise)


def parking(config: Config, updates: Any, buffer: optax.Updates, *, apply: bool = False) -> Any:
  """Which leaves of the updates the emitting branch writes into the buffer: a tree of flags.

  Once the window closes the buffer is dead (the next window resets it
  lazily), so the updates can live there: the conditional then outputs no
  parameter-sized updates (none in temporaries), and ``update`` returns
  ``where(emitted, buffer, 0)``, which XLA fuses into ``apply_updates``. A
  leaf parks when the buffer leaf holds its value bit for bit, in place:
  same shape, sharding and device variance, the same dtype or an exact
  widening. None parks under ``axis_name`` (the reduction makes the sum
  elsewhere) or when applying (no updates leave the step). The evidence:
  docs/development/compiler_evidence.md, "The updates park in the buffer".
  """
  if apply or config.axis_name is not None or (
      jax.tree.structure(updates) != jax.tree.structure(buffer)):
    return jax.tree.map(lambda _: False, updates)

  def parks(u: Any, b: jax.Array) -> bool:
    u_dtype, b_dtype = jnp.dtype(u.dtype), jnp.dtype(b.dtype)
    u_type, b_type = _arrays.array_type(u), _arrays.array_type(b)
    # Exact: the same dtype, or a wider float of the same kind (bf16 into f32).
    exact = u_dtype == b_dtype or (jnp.issubdtype(u_dtype, jnp.floating) and jnp.issubdtype(
        b_dtype, jnp.floating) and _arrays.promote_types(u_dtype, b_dtype) == b_dtype)
    return (exact and tuple(u.shape) == tuple(b.shape) and u_type.varying == b_type.varying
            and u_type.explicit_spec == b_type.explicit_spec)

  return jax.tree.map(parks, updates, buffer)


def park(updates: Any, window_sum: optax.Updates, parks: Any) -> tuple[Any, optax.Updates]:
  """``(updates, buffer)``: each parked leaf's update written into the buffer, None in its place.

  The buffer is dead once its window closed (the next window resets it
  lazily): a leaf that does not park keeps the window's sum.
  """
  buffer = jax.tree.map(lambda u, b, parked: u.astype(b.dtype) if parked else b,
                        updates, window_sum, parks)
  return jax.tree.map(lambda u, parked: None if parked else u, updates, parks), buffer


def unpark(updates: Any, buffer: optax.Updates, parks: Any, emitted: jax.Array,
           updates_like: Any) -> Any:
  """The updates: each parked leaf read back from the buffer, zeros unless ``emitted``."""
  return jax.tree.map(
      lambda u, b, parked, s: lax.select(emitted, lax.convert_element_type(b, s.dtype),
                                         lax.full_like(b, 0, s.dtype)) if parked else u,
      updates, buffer, parks, updates_like, is_leaf=lambda x: x is None)


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
