"""How many micro-batches: the smallest ``k`` whose compiled step fits, chosen before anything runs.

XLA states a program's memory when it compiles it
(``jax.jit(f).lower(*args).compile().memory_analysis()``), so the number of
micro-batches can be chosen from compiled programs instead of from
out-of-memory crashes. :func:`plan_k` compiles the train step for a few
candidate ``k`` (a binary search over them, on ``jax.ShapeDtypeStruct``
arguments if you like: nothing is allocated and nothing runs) and returns the
smallest ``k`` whose compiled peak is within a memory limit.

**The peak** of a compiled program, per device (:func:`compiled_peak_bytes`):
``argument + output + temp - alias`` bytes of its ``memory_analysis()``. The
arguments and outputs are the step's inputs and results, the temporaries are
the one block XLA allocates for everything in between, and the alias bytes
are outputs written into donated arguments (counted once, not twice). The
same definition is used on every backend. XLA's own ``peak_memory_in_bytes``
is not used: on XLA:CPU it is ``argument + output - alias`` (to within a few
bytes of alignment) and leaves the temporaries out (verified in
``tests/test_planning.py``; also reported in bartz-org/bartz PR #157). Under
a mesh every size is per device. Host-offloaded bytes (``host_*``) and the
generated code are not counted.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from optax_accum import _batch, _validation

__all__ = ["HEADROOM", "Plan", "PlanRow", "compiled_peak_bytes", "plan_k"]

#: With ``memory_limit=None`` the limit is this fraction of the device's
#: ``memory_stats()["bytes_limit"]``: the rest is headroom for fragmentation,
#: the runtime's own buffers and arrays that are live but not the step's arguments
#: (the next batch being prefetched, an evaluation copy of the params).
HEADROOM = 0.9

_OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")
_TRY = ("`jax.checkpoint` around each block of the model, bf16 activations"
        " (`optax_accum.mixed_precision`), sharding the params and optimizer state over more"
        " devices (`optax_accum.sharding`), or a larger global batch (or more `candidates`) so"
        " that k can split it further")


class PlanRow(NamedTuple):
  """One compiled candidate of a :class:`Plan`.

  Attributes:
    k: the number of micro-batches.
    micro_batch_size: rows of the global batch per micro-batch, ``global // k``
      (over all devices: a device holds ``micro_batch_size / devices`` of them).
    peak_bytes: the compiled program's peak per device
      (:func:`compiled_peak_bytes`), or None when the compiler itself ran out
      of memory.
    fits: whether ``peak_bytes <= memory_limit``.
    note: ``"chosen"``, or why the row breaks monotonicity, or ``""``.
  """

  k: int
  micro_batch_size: int
  peak_bytes: int | None
  fits: bool
  note: str = ""


class Plan(NamedTuple):
  """What :func:`plan_k` chose, and the compiled candidates it chose from.

  Attributes:
    k: the smallest compiled candidate whose peak fits ``memory_limit``.
    micro_batch_size: ``global // k`` rows per micro-batch.
    peak_bytes: the chosen program's peak per device.
    memory_limit: the limit in bytes per device.
    table: one :class:`PlanRow` per compiled candidate, in increasing ``k``.
    candidates: every ``k`` the search chose from, in increasing order.
    monotone: False when the compiled peaks do not decrease as ``k`` grows
      (the offending rows say so in their ``note``): then an uncompiled ``k``
      smaller than the chosen one may fit too; pass ``candidates=`` to check.
    compile_s: seconds spent building, lowering and compiling the candidates.
  """

  k: int
  micro_batch_size: int
  peak_bytes: int
  memory_limit: int
  table: tuple[PlanRow, ...]
  candidates: tuple[int, ...]
  monotone: bool
  compile_s: float

  def __str__(self) -> str:
    """The plan for a person: one line of summary, then the table."""
    shown = self.candidates if len(self.candidates) <= 8 else (
        *self.candidates[:3], "...", *self.candidates[-2:])
    lines = [
        f"plan_k: k = {self.k} (micro-batches of {self.micro_batch_size}), peak"
        f" {_mib(self.peak_bytes)} MiB within {_mib(self.memory_limit)} MiB per device;"
        f" {len(self.table)} of {len(self.candidates)} candidates compiled"
        f" in {self.compile_s:.1f} s (candidates: {', '.join(map(str, shown))})",
        _table(self.table),
    ]
    if not self.monotone:
      lines.append("peaks not monotone in k: an uncompiled k below the chosen one may fit;"
                   " pass candidates= to compile it")
    return "\n".join(lines)


def _mib(n: int | None) -> str:
  return "n/a" if n is None else f"{n / 2**20:.2f}"


def _table(rows: Sequence[PlanRow]) -> str:
  out = [f"{'k':>6}  {'micro-batch':>11}  {'peak (MiB)':>10}  {'fits':<4}  note"]
  out += [f"{r.k:>6}  {r.micro_batch_size:>11}  {_mib(r.peak_bytes):>10}"
          f"  {'yes' if r.fits else 'no':<4}  {r.note}".rstrip() for r in rows]
  return "\n".join(out)


def compiled_peak_bytes(compiled: Any) -> int:
  """``argument + output + temp - alias`` bytes of a compiled program, per device.

  Args:
    compiled: what ``jax.jit(f).lower(*args).compile()`` returns.

  Returns:
    The peak in bytes (see the module's docstring for why not XLA's
    ``peak_memory_in_bytes``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax_accum.planning import compiled_peak_bytes
    >>> x = jax.ShapeDtypeStruct((1024,), jnp.float32)
    >>> compiled = jax.jit(lambda x: x * 2, donate_argnums=0).lower(x).compile()
    >>> compiled_peak_bytes(compiled)   # 4 KiB in, 4 KiB out into the donated input
    4096
  """
  stats = compiled.memory_analysis()
  if stats is None:
    raise ValueError(
        f"The {jax.default_backend()} backend returns no memory_analysis() for compiled"
        " programs, so plan_k cannot measure them; plan on a backend that does (CPU, GPU, TPU).")
  return int(stats.argument_size_in_bytes + stats.output_size_in_bytes
             + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


def plan_k(
    make_step: Callable[[int], Callable[..., Any]],
    *args: Any,
    batch_argnums: int | Sequence[int] = 1,
    memory_limit: int | float | None = None,
    across_steps: bool = False,
    candidates: Sequence[int] | None = None,
) -> Plan:
  """The smallest number of micro-batches whose compiled train step fits in memory.

  Compiles ``make_step(k)`` for candidate ``k`` (nothing is run on a device)
  and returns the smallest ``k`` whose compiled peak per device
  (:func:`compiled_peak_bytes`) is at most ``memory_limit``. The search is a
  binary search over the sorted candidates, which assumes that a larger ``k``
  never needs more memory: it compiles at most ``ceil(log2(n)) + 1`` of ``n``
  candidates. That assumption is usually true but not always (XLA may pick
  other kernels for a micro-batch of one): the returned ``k`` is always one
  that was compiled and fits, and where the compiled peaks do not decrease
  with ``k`` the plan's ``monotone`` is False and the table's ``note`` names
  the rows.

  Two ways to use ``k`` (``across_steps``):

  * in-step (default): ``make_step(k)`` runs the whole global batch in one
    call, with :func:`~optax_accum.microbatched` over ``k`` micro-batches; it
    is compiled with ``args`` as given.
  * across steps (``across_steps=True``): ``make_step(k)`` is the step of
    :func:`~optax_accum.accumulate` that sees one micro-batch per call; the
    planner cuts each batch argument's leading axis to ``global // k`` rows
    (shardings kept) before compiling it.

  Args:
    make_step: ``k -> step``. A plain function is compiled with ``jax.jit``;
      a ``jax.jit``-wrapped one (anything with ``.lower``) is lowered as it
      is, so its ``donate_argnums``, shardings and other options are kept
      (donated arguments written by outputs count once: the alias bytes).
    *args: the step's arguments, with the **global** batch at
      ``batch_argnums``: arrays or ``jax.ShapeDtypeStruct`` (with their
      shardings), so nothing needs to be allocated. Each batch argument is a
      pytree of arrays with a common leading (batch) axis.
    batch_argnums: position(s) in ``args`` of the batch argument(s)
      (default 1): never 0, the params. The batch rules are
      :func:`~optax_accum.microbatched`'s (the same input, the same error).
    memory_limit: bytes per device. None (default) reads the devices'
      ``memory_stats()["bytes_limit"]`` and keeps :data:`HEADROOM` of it (the
      smallest over the local devices); XLA:CPU reports no limit, so there it
      must be given.
    across_steps: whether ``k`` splits the batch across jitted calls (see
      above) rather than inside one.
    candidates: the ``k`` to choose from. Default: every ``k`` that divides
      the global batch (the rows per device under a mesh, so each device
      splits its own rows evenly). Each must divide it.

  Returns:
    A :class:`Plan`: ``k``, ``micro_batch_size``, ``peak_bytes``,
    ``memory_limit``, the ``table`` of compiled candidates (``str(plan)``
    renders it) and whether the compiled peaks were ``monotone``.

  Raises:
    ValueError: for bad arguments, or when no candidate fits (the message
      gives the smallest peak found and what to try).
    RuntimeError: when ``make_step(k)`` fails to build, lower or compile for
      one candidate (the message names ``k``).

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_accum as oa
    >>> def loss(w, x):
    ...   return jnp.mean(jnp.tanh(jnp.tanh(x @ w) @ w) ** 2)
    >>> opt = optax.adam(1e-3)
    >>> def make_step(k):
    ...   grad_fn = oa.microbatched(jax.value_and_grad(loss), k)
    ...   def step(w, opt_state, x):
    ...     value, grads = grad_fn(w, x)
    ...     updates, opt_state = opt.update(grads, opt_state, w)
    ...     return optax.apply_updates(w, updates), opt_state, value
    ...   return step
    >>> w = jax.ShapeDtypeStruct((128, 128), jnp.float32)       # nothing allocated
    >>> x = jax.ShapeDtypeStruct((4096, 128), jnp.float32)      # the global batch: 2 MiB
    >>> plan = oa.plan_k(make_step, w, jax.eval_shape(opt.init, w), x,
    ...                  batch_argnums=2, memory_limit=4 * 2**20, candidates=[1, 2, 4, 8, 16])
    >>> plan.k, plan.micro_batch_size, plan.peak_bytes <= plan.memory_limit
    (8, 512, True)
    >>> [(row.k, row.fits) for row in plan.table]   # 3 compiles of 5 candidates
    [(4, False), (8, True), (16, True)]
  """
  if not callable(make_step):
    raise TypeError(f"`make_step` must be a function k -> step; got {type(make_step).__name__}.")
  across_steps = _validation.check_flag(across_steps, "across_steps")
  batch = _batch.of(args, _validation.check_argnums(batch_argnums, "batch_argnums"))
  nums, rows = batch.positions, batch.rows
  ks = _check_candidates(candidates, batch)
  limit = _resolve_limit(memory_limit)

  seen: dict[int, PlanRow] = {}
  t0 = time.perf_counter()

  def fits(k: int) -> bool:
    peak = _compile_peak(make_step, k, args, nums, rows // k if across_steps else None)
    seen[k] = PlanRow(k, rows // k, peak, peak is not None and peak <= limit)
    return seen[k].fits

  # The first k that fits (at len(ks): none), by bisection: only the k it probes compile.
  first = bisect.bisect_left(ks, True, key=fits)
  compile_s = time.perf_counter() - t0
  chosen = ks[first] if first < len(ks) else None
  table, monotone = _annotate([seen[k] for k in sorted(seen)], chosen)
  if chosen is None:
    raise ValueError(_nothing_fits(table, limit, ks, across_steps))
  row = seen[chosen]  # compiled, and it fits: the search only stops on one
  return Plan(chosen, row.micro_batch_size, row.peak_bytes, limit, table, ks, monotone,
              compile_s)


# ----------------------------------------------------------------------------- checks

def _check_candidates(candidates: Any, batch: _batch.Batch) -> tuple[int, ...]:
  """The candidate ``k``, each a positive int that splits the batch on each device."""
  if candidates is None:
    return tuple(_batch.divisors(batch.per_device_rows))
  try:
    ks = list(candidates)
  except TypeError:
    raise ValueError(f"`candidates` must be a sequence of ints; got {candidates!r}.") from None
  if not ks:
    raise ValueError("`candidates` is empty; pass the k to consider, or None for every k that"
                     " divides the batch on each device.")
  for k in ks:
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)) or k < 1:
      raise ValueError(f"`candidates` must be positive ints; got {k!r}.")
    batch.check_divides(int(k), "a k in `candidates`")
  return tuple(sorted({int(k) for k in ks}))


def _resolve_limit(memory_limit: Any) -> int:
  """``memory_limit`` checked, or (None) :data:`HEADROOM` of the local devices' smallest
  ``bytes_limit``."""
  if memory_limit is not None:
    if (isinstance(memory_limit, (bool, np.bool_))
        or not isinstance(memory_limit, (int, float, np.integer, np.floating))
        or not math.isfinite(memory_limit) or memory_limit <= 0):
      raise ValueError("`memory_limit` must be a positive number of bytes per device (e.g."
                       f" 8 * 2**30 for 8 GiB); got {memory_limit!r}.")
    return int(memory_limit)
  limits = []
  for device in jax.local_devices():
    try:
      stats = device.memory_stats()
    except Exception:  # backends without memory stats
      stats = None
    if stats and stats.get("bytes_limit"):
      limits.append(int(stats["bytes_limit"]))
  if not limits:
    raise ValueError(
        f"memory_limit=None reads the device's memory_stats()['bytes_limit'], but the"
        f" {jax.default_backend()} backend reports none (XLA:CPU never does); pass"
        " `memory_limit` in bytes per device, e.g. memory_limit=8 * 2**30.")
  return int(HEADROOM * min(limits))


# ----------------------------------------------------------------------------- compiling

def _cut(leaf: Any, rows: int) -> jax.ShapeDtypeStruct:
  """``leaf``'s type with ``rows`` rows: a ``ShapeDtypeStruct``, sharding kept."""
  sharding = getattr(leaf, "sharding", None)
  if not isinstance(sharding, jax.sharding.Sharding):
    sharding = None
  return jax.ShapeDtypeStruct((rows, *leaf.shape[1:]), leaf.dtype, sharding=sharding,
                              weak_type=bool(getattr(leaf, "weak_type", False)))


def _compile_peak(make_step: Callable[[int], Any], k: int, args: tuple[Any, ...],
                  nums: tuple[int, ...], micro_rows: int | None) -> int | None:
  """The compiled peak of ``make_step(k)``; None when the compiler ran out of memory."""
  if micro_rows is not None:
    args = tuple(jax.tree.map(lambda x: _cut(x, micro_rows), a) if i in nums else a
                 for i, a in enumerate(args))
  stage = "make_step"
  try:
    step = make_step(k)
    stage = "lowering its step"
    lowered = (step if hasattr(step, "lower") else jax.jit(step)).lower(*args)
    stage = "compiling its step"
    compiled = lowered.compile()
  except Exception as e:
    if stage == "compiling its step" and any(m in str(e) for m in _OOM_MARKERS):
      return None  # (TPU compilers refuse programs that exceed the memory)
    raise RuntimeError(
        f"plan_k: make_step({k}) failed ({stage}): {type(e).__name__}: {e}\nFix make_step for"
        f" k={k}, or leave {k} out of `candidates`.") from e
  return compiled_peak_bytes(compiled)


def _annotate(rows: list[PlanRow], chosen: int | None) -> tuple[tuple[PlanRow, ...], bool]:
  """Notes the chosen row and every row that breaks monotonicity (rows sorted by k)."""
  out, monotone = [], True
  for j, r in enumerate(rows):
    notes = ["chosen"] if r.k == chosen else []
    if r.peak_bytes is None:
      notes.append("the compiler ran out of memory")
    below = [e for e in rows[:j] if None not in (e.peak_bytes, r.peak_bytes)
             and r.peak_bytes > e.peak_bytes]  # a smaller k with a smaller peak
    if below:
      notes.append(f"not monotone: peak above k={below[0].k}'s {_mib(below[0].peak_bytes)} MiB")
    # (A fitting k beside a larger one that does not fit is never compiled: the search
    # only compiles below a k that fits and above one that does not.)
    monotone = monotone and not below
    out.append(r._replace(note="; ".join(notes)))
  return tuple(out), monotone


def _nothing_fits(table: Sequence[PlanRow], limit: int, ks: Sequence[int],
                  across_steps: bool) -> str:
  measured = [r for r in table if r.peak_bytes is not None]
  if measured:
    best = min(measured, key=lambda r: r.peak_bytes)
    found = (f"the smallest compiled peak is {best.peak_bytes:,} bytes"
             f" ({_mib(best.peak_bytes)} MiB) at k={best.k} (micro-batches of"
             f" {best.micro_batch_size})")
  else:
    found = "the compiler ran out of memory for every candidate it compiled"
  mode = "across steps" if across_steps else "in-step"
  return (f"plan_k: no candidate k fits memory_limit={limit:,} bytes ({_mib(limit)} MiB) per"
          f" device ({mode}, largest candidate k={ks[-1]}): {found}. Try {_TRY}.\n"
          + _table(table))
