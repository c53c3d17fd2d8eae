"""The inner optimizer's state in host memory, streamed through the device for its update.

Between optimizer steps Adam's ``mu`` and ``nu`` (8 bytes per float32 parameter)
sit idle on the device; :func:`host_state` keeps every leaf of the state in host
memory (``pinned_host``). Its update is the device's own arithmetic, run on the
state a piece at a time: a piece's state comes to the device, is updated there
with its gradients and params, and goes back before the next piece's comes in
(a chain of ``lax.optimization_barrier`` s). A piece is a few whole leaves, or a
block of a large leaf's leading rows, of at most :data:`PIECE_BYTES` of state.

Which pieces the update may be cut into is read from its jaxpr (:func:`_plan`),
never from the optimizer's name: each value is labelled with the param leaves it
is computed from. A value of one leaf is computed in that leaf's piece; a value
of none (a count, a schedule) once; a value of several (a global norm) between
passes, from the pieces' values. Where such a value reads the state (Adam's
updates clipped inside ``host_state``), the state streams once more. A leaf is
cut into blocks of rows where the update, traced again on a block, computes each
row from that row alone; a reduction over its rows of the gradients or params
alone is computed on the whole leaf, as the device computes it.
"""

from __future__ import annotations

import collections
import importlib.metadata
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend import core as jax_core

from optax_accum import _arrays, _jaxpr

__all__ = ["PIECE_BYTES", "HostState", "host_state"]

# True while `streamed` traces what it streams: `host_state`'s update inside is the device's.
_INSIDE = jax.make_user_context(False)

HOST = "pinned_host"
# The state one piece brings to the device (a 4096 x 4096 float32 leaf's Adam state: one piece),
# and at most an eighth of the whole (a small model's state is not on the device twice, in and
# out). Its new state goes back while the next comes in: a few pieces are on the device at once.
PIECE_BYTES = 128 << 20


class HostState(NamedTuple):
  """State of :func:`host_state`.

  Attributes:
    inner_state: the inner optimizer's state, every array leaf in host memory
      (``pinned_host``) between updates.
  """

  inner_state: optax.OptState


def host_state(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """``inner`` with its state in host memory, streamed through the device for its update.

  ``init`` places ``inner``'s state in host memory (``pinned_host``, sharded
  like the params; a one-device state with a ``NamedSharding``, so that a
  ``jax.ShapeDtypeStruct`` of its shardings, or an array orbax restores into
  them, is typed in host memory too). ``update`` computes ``inner``'s update on
  the device, its state brought there a piece at a time (at most
  :data:`PIECE_BYTES` of state a piece and an eighth of the whole, a few pieces
  at once) and sent back: the updates and the new state are bit for bit
  ``inner``'s with its state on the device. The state crosses the host link
  twice per update (once more where a value that couples leaves reads it, as a
  global norm of Adam's updates does). Inside :func:`~optax_accum.accumulate` that is
  once per window. On a mesh each device streams its own shard of each leaf. Donating
  the state: JAX (0.10.2 to 0.12) pairs a donated argument with an output by shape
  alone, so return the params and the state in the order they are donated (or give
  ``out_shardings``).

  Args:
    inner: the optimizer whose state lives on the host (an
      ``optax.GradientTransformation``: ``optax.adam(1e-3)``, not ``optax.adam``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`HostState`; ``update``'s keywords go to ``inner``.

  Raises:
    TypeError: where ``inner`` is not a gradient transformation.
    ValueError: from ``init``, where the devices have no ``pinned_host``
      memory (it names the platform and the JAX version); from ``update``, where
      a leaf of the state is typed in device memory (placed there by the caller):
      it is never updated there in silence.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_accum as oa
    >>> tx = oa.accumulate(2, oa.host_state(optax.adam(1e-2)))
    >>> params = {"w": jnp.ones(3)}
    >>> state = tx.init(params)
    >>> state.inner_opt_state.inner_state[0].mu["w"].sharding.memory_kind
    'pinned_host'
    >>> step = jax.jit(lambda g, s, p: oa.update_and_apply(tx, g, s, p))
    >>> for _ in range(2):
    ...   params, state = step({"w": jnp.ones(3)}, state, params)
    >>> [round(w, 4) for w in params["w"].tolist()]
    [0.99, 0.99, 0.99]
    >>> state.inner_opt_state.inner_state[0].mu["w"].sharding.memory_kind
    'pinned_host'
  """
  if not isinstance(inner, optax.GradientTransformation):
    what = getattr(inner, "__name__", type(inner).__name__)
    raise TypeError(
        f"`host_state(inner)`: `inner` is {what}, not an optax gradient transformation. Pass"
        " the optimizer built, `host_state(optax.adam(1e-3))`, not its factory `optax.adam`.")
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: optax.Params) -> HostState:
    for device in jax.local_devices():  # each one with host memory to hold a state
      kinds = sorted(m.kind for m in device.addressable_memories())
      if HOST not in kinds:
        raise ValueError(
            f"`host_state` keeps the optimizer state in host memory ({HOST!r}), which"
            f" {device.platform} ({device.device_kind}) does not offer with jax {jax.__version__}"
            f" and jaxlib {importlib.metadata.version('jaxlib')}: its memory kinds are {kinds}.")
    state = inner.init(params)  # (a traced one's placement is its program's out_shardings)
    meshes = {s.mesh for s in (getattr(x, "sharding", None) for x in jax.tree.leaves(params))
              if isinstance(s, jax.sharding.NamedSharding) and s.mesh.size > 1}
    # A leaf `inner` made (a count) goes beside the params: on their mesh, replicated.
    made = jax.sharding.NamedSharding(meshes.pop(), jax.sharding.PartitionSpec()) if len(
        meshes) == 1 else None
    return HostState(jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host if getattr(
        x, "sharding", None) is None else in_host_memory(
            made if made is not None and _arrays.on_one_device(x.sharding) else x.sharding)),
        state))

  def update_fn(updates: optax.Updates, state: HostState, params: optax.Params | None = None,
                **extra_args: Any) -> tuple[optax.Updates, HostState]:
    if _in_optax_multi_steps():
      raise TypeError(
          "`optax.MultiSteps(host_state(...))`: optax's conditional selects between the state"
          " in host memory and its update on the device, which JAX refuses. Use"
          " `optax_accum.MultiSteps(host_state(...), k)` (or `accumulate`), its drop-in.")
    if _INSIDE.value:  # traced inside a streamed computation (`accumulate`'s emitting branch)
      new_updates, new_state = inner.update(updates, state.inner_state, params, **extra_args)
      return new_updates, HostState(new_state)
    on_device = [jax.tree_util.keystr(k) for k, x in jax.tree.leaves_with_path(state.inner_state)
                 if jax.typeof(x).memory_space != jax.memory.Space.Host]
    if on_device:  # never a silent update on the device
      raise ValueError(
          f"`host_state`: `state` holds {len(on_device)} leaves in device memory (inner_state"
          f"{on_device[0]}, ...); place it in host memory: `jax.device_put(state,"
          " optax_accum.sharding.state_shardings(tx, params))`, restore into those shardings,"
          " or build abstract states from them (`jax.ShapeDtypeStruct(..., sharding=...)`).")
    arrays = {k: v for k, v in extra_args.items() if isinstance(v, jax.Array | jax.core.Tracer)}
    run = lambda u, s, p, a: inner.update(u, s, p, **a, **{
        k: v for k, v in extra_args.items() if k not in arrays})  # (a loss function: closed over)
    new_updates, new_state = streamed(run, updates, (
        updates, state.inner_state, params, arrays), lambda out: (False, True), into=0)
    return new_updates, HostState(new_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _in_optax_multi_steps() -> bool:
  """Whether optax's ``MultiSteps`` calls this update (its frames are on the stack)."""
  frame = sys._getframe(2)
  while frame is not None:
    code = frame.f_code
    if code.co_name in ("_do_update", "_skip_update") and "optax" in code.co_filename:
      return True
    frame = frame.f_back
  return False


def in_host_memory(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
  """``sharding`` in ``pinned_host``; a single device's as a ``NamedSharding``.

  JAX (0.10.2 to 0.12) types a value in host memory from a ``NamedSharding`` alone: a
  ``ShapeDtypeStruct`` or an array orbax restores with a ``SingleDeviceSharding`` in
  ``pinned_host`` is typed on the device, and a step returns it there.
  """
  if _arrays.on_one_device(sharding):
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(list(sharding.device_set), (
        "host_state",)), jax.sharding.PartitionSpec())
  return sharding.with_memory_kind(HOST)


# ------------------------------------------------------------------ the streamed update
class _Piece(NamedTuple):
  """Leaves updated together; or one leaf, a row at a time (a ``lax.scan`` over its rows)."""

  leaves: tuple[int, ...]
  by_rows: bool = False


class _Plan(NamedTuple):
  """Where each value of the update is computed."""

  jaxpr: Any  # the update traced on blocks (where a leaf is cut into blocks), else `whole`
  whole: Any  # the update traced on whole leaves: the same equations
  once: set  # the vars computed once, from `whole`: of no leaf, or of several, or reduced rows
  keep: dict  # var -> its pass: a value of several leaves that reads the state (between passes)
  coupled: dict  # var -> (pass, leaf): a value of one leaf that the next pass's `keep` reads
  last: dict  # leaf -> the pass that computes its outputs
  twin: dict  # var of `jaxpr` -> the var of `whole` that is it on whole leaves
  pieces: list[_Piece]
  passes: int
  prefer: frozenset = frozenset()  # inputs a leaf streamed by rows writes its outputs into


class _Known(NamedTuple):
  """What the planner's walk knows of a value of the update."""

  label: frozenset = frozenset()  # the param leaves it is computed from
  reads: bool = False  # computed from the state (an input in host memory)
  stage: int = 0  # the pass that computes it: one after the values of several leaves it reads
  moved: bool = False  # its shape on a block of rows is not its shape on whole leaves


def streamed(fn: Callable[..., Any], like: Any, args: tuple, in_host: Callable[[Any], Any],
             into: int | None = None) -> Any:
  """``fn(*args)``, computed on the device with the state (its arguments in host memory)
  streamed by pieces: of the params' leaves (``like``, shaped as the params: a subtree of
  ``args`` shaped like it belongs to them). ``in_host(out)``: a prefix of ``fn``'s outputs,
  True where they are the new state (sent back to host memory). ``into``: the argument whose
  leaves a leaf streamed by rows writes its outputs into first (else the inputs nearest its
  outputs)."""
  leaves, in_tree = jax.tree.flatten(args)
  owners = _owners(args, like)
  out_tree: list[Any] = []

  def flat(*xs: Any) -> list[Any]:
    with _INSIDE(True):  # an update of `host_state` in `fn` computes as the device's
      out = fn(*jax.tree.unflatten(in_tree, xs))
    out_tree[:] = [out]
    return jax.tree.leaves(out)

  # Traced on the device: the device's arithmetic, whichever piece computes it.
  avals = [jax.typeof(x).update(memory_space=jax.memory.Space.Device) for x in leaves]
  hosted = [jax.typeof(x).memory_space == jax.memory.Space.Host for x in leaves]
  whole = _inlined(jax.make_jaxpr(flat)(*avals))
  shape, structure = out_tree[0], jax.tree.structure(out_tree[0])
  out_owners = _owners(jax.tree.unflatten(structure, whole.out_avals), like)
  to_host = jax.tree.leaves(jax.tree.map(lambda h, o: jax.tree.map(lambda _: h, o),
                                         in_host(shape), shape))
  plan = _plan(whole, flat, avals, hosted, owners, out_owners, leaves)
  first = sum(len(jax.tree.leaves(a)) for a in args[:into]) if into is not None else 0
  plan = plan._replace(prefer=frozenset(plan.jaxpr.jaxpr.invars[first:first + len(jax.tree.leaves(
      args[into]))] if into is not None else ()))
  return jax.tree.unflatten(structure, _run(plan, leaves, hosted, owners, out_owners, to_host))


def _owners(tree: Any, like: Any) -> list[int | None]:
  """For each leaf of ``tree``, the param leaf it belongs to: its place in a subtree shaped
  like ``like`` (the gradients, the params, Adam's ``mu``), else None (a count). Where the
  params are one array, a leaf of its shape."""
  treedef = jax.tree.structure(like)
  if treedef.num_nodes == 1:
    return [0 if jnp.shape(x) == jnp.shape(like) else None for x in jax.tree.leaves(tree)]
  out: list[int | None] = []
  for node in jax.tree.leaves(tree, is_leaf=lambda x: x is not None and _fits(x, treedef)):
    if _fits(node, treedef):
      out += [j for j, sub in enumerate(treedef.flatten_up_to(node))
              for _ in jax.tree.leaves(sub)]
    else:
      out.append(None)
  return out


def _fits(node: Any, treedef: Any) -> bool:
  try:
    treedef.flatten_up_to(node)
  except (ValueError, TypeError):
    return False
  return True


def _plan(whole: Any, flat: Callable, avals: list, hosted: list, owners: list,
          out_owners: list, leaves: list) -> _Plan:
  """Which values are computed where: in a piece, once, or between passes."""
  n = max([-1, *(o for o in owners if o is not None)]) + 1
  sizes = [sum(a.size * a.dtype.itemsize for a, o, h in zip(avals, owners, hosted, strict=True)
               if o == j and h) for j in range(n)]
  lead = {o: a.shape[0] for a, o in zip(avals, owners, strict=True) if o is not None and a.ndim}
  # A leaf of stacked layers streams a layer at a time (a TPU tiles a matrix: a row of one is
  # no block of its memory; libtpu 0.0.42.1 fails to compile a scan over a matrix's rows).
  ndim = {o: a.ndim for a, o in zip(avals, owners, strict=True) if o is not None}
  budget = min(PIECE_BYTES, -(-sum(sizes) // 8))  # (a leaf by layers: over PIECE_BYTES)
  blocks = {j for j, s in enumerate(sizes) if s > PIECE_BYTES and lead.get(j, 0) > 1
            and ndim[j] >= 3
            and _one_device([x for x, o in zip(leaves, owners, strict=True) if o == j])}
  plan = None
  while blocks:
    cut = [a.update(shape=(1, *a.shape[1:])) if o in blocks and a.ndim and
           a.shape[0] == lead[o] else a for a, o in zip(avals, owners, strict=True)]
    try:
      plan, kept, wide = _facts(_inlined(jax.make_jaxpr(flat)(*cut)), whole, hosted, owners,
                                out_owners, blocks)
    except Exception:  # the update fails on a row, or is another program there: whole leaves
      kept = set()
    if kept == blocks:
      break
    blocks, plan = kept, None
  if plan is None or wide:
    plan, _, wide = _facts(whole, whole, hosted, owners, out_owners, set())
  if wide:  # a value of several leaves' whole state: no streaming
    return plan._replace(keep={}, coupled={}, last=dict.fromkeys(range(n), 0),
                         pieces=[_Piece(tuple(range(n)))], passes=1)
  return plan._replace(pieces=_pieces(sizes, blocks, budget))


def _one_device(leaves: list) -> bool:
  """Whether blocks of these leaves' rows stay on each device: one device in all, a leaf on
  one device, or typed on a mesh that does not shard its leading axis."""
  def one(x: Any) -> bool:
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
      return len(x.sharding.device_set) == 1
    s = jax.typeof(x).sharding
    return s.mesh.size > 0 and not (s.spec and s.spec[0])
  return jax.device_count() == 1 or all(map(one, leaves))


def _facts(cut: Any, whole: Any, hosted: list, owners: list, out_owners: list,
           blocks: set[int]) -> tuple[_Plan, set[int], bool]:
  """A walk of the update traced on blocks of rows (``cut``; ``whole`` where no leaf is cut)
  beside ``whole``: each value's :class:`_Known`, and where it is computed (the plan, its
  pieces to come). Then the leaves of ``blocks`` that compute each row from that row alone
  where they read the state (the same equations as ``whole``, the rows the leading axis of
  every value that follows them, of each output of the leaf too); and whether a value of
  several leaves reads their whole state."""
  if [v.aval for v in cut.jaxpr.constvars] != [v.aval for v in whole.jaxpr.constvars]:
    raise ValueError("the update holds other constants on a block of rows")
  twins = _jaxpr.twins(cut.jaxpr, whole.jaxpr)
  plan = _Plan(cut, whole, set(), {}, {}, {}, dict(zip(
      [*cut.jaxpr.constvars, *cut.jaxpr.invars], [*whole.jaxpr.constvars, *whole.jaxpr.invars],
      strict=True)), [], 0)
  kept, wide = set(blocks), set()

  def learn(_: Any, eqn: Any, ins: list[_Known]) -> list[_Known]:
    twin = next(twins)
    if twin is None:
      raise ValueError("the update is another program on a block of rows")
    # A leaf's value scaled by a number of several leaves (a global norm's) is still the
    # leaf's: that number is computed between passes.
    own = frozenset().union(*(x.label for x, v in zip(ins, eqn.invars, strict=True)
                              if len(x.label) < 2 or v.aval.size > 1))
    own = own or frozenset().union(*(x.label for x in ins))
    reads, narrowed = any(x.reads for x in ins), any(x.moved for x in ins)
    stage = max([x.stage + (len(own) > 1 and len(x.label) == 1 and x.reads) for x in ins],
                default=0)
    moved = [v.aval.shape != w.aval.shape for v, w in zip(eqn.outvars, twin.outvars,
                                                          strict=True)]
    if (narrowed or any(moved)) and (any(moved) or reads) and (
        len(own) > 1 or not _keeps_rows(twin, eqn)):
      # (A value of no leaf that follows the rows, a zeros_like: none streams by rows.)
      kept.difference_update(own or kept)
    if len(own) > 1 and reads:
      plan.keep.update(dict.fromkeys(eqn.outvars, stage))
      for x, v in zip(ins, eqn.invars, strict=True):
        if len(x.label) == 1 and x.reads:
          plan.coupled[v] = (stage - 1, next(iter(x.label)))
          if v.aval.ndim:  # (not a number: the leaf's whole state)
            wide.add(v)
    plan.twin.update(zip(eqn.outvars, twin.outvars, strict=True))
    plan.once.update(v for v, m in zip(eqn.outvars, moved, strict=True) if (
        not own and not m) or (not reads and (len(own) > 1 or (narrowed and not m))))
    return [_Known(own, reads, stage, m) for m in moved]

  args = [_Known(frozenset() if o is None else frozenset([o]), h, 0, v.aval.shape != w.shape)
          for v, w, o, h in zip(cut.jaxpr.invars, whole.in_avals, owners, hosted, strict=True)]
  outs = _jaxpr.interpret(_jaxpr.Rules({}, learn, lambda v: _Known()), cut.jaxpr,
                          [_Known()] * len(cut.jaxpr.constvars), args)
  kept &= {j for j in blocks if all(
      isinstance(v, jax_core.Literal) or v.aval.shape[:1] != w.shape[:1]
      for v, w, o in zip(cut.jaxpr.outvars, whole.out_avals, out_owners, strict=True) if o == j)}
  for x, o in zip(outs, out_owners, strict=True):
    if o is not None:
      plan.last[o] = max(plan.last.get(o, 0), x.stage)
  passes = max([x.stage for x in outs], default=0) + 1  # (a norm of no leaf's: its pass)
  return plan._replace(passes=passes), kept, bool(wide)


# What computes each row of a block from that row alone: elementwise primitives, and a few
# structural ones whose rule (:func:`_keeps_rows`) checks that the rows stay the leading axis.
_ELEMENTWISE = frozenset("""abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp
  conj convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1
  floor ge gt imag integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg
  nextafter not or population_count pow real reduce_precision rem round rsqrt select_n
  shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square sub tan tanh
  xor""".split())
_REDUCTIONS = frozenset("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or "
                        "argmax argmin".split())


def _keeps_rows(a: Any, b: Any) -> bool:
  """Whether ``b`` (``a``, on whole leaves) computes each row from that row alone."""
  shaped = ("shape", "new_sizes")
  if {k: v for k, v in a.params.items() if k not in shaped} != {
      k: v for k, v in b.params.items() if k not in shaped}:
    return False
  if any(not np.array_equal(x.val, y.val) for x, y in zip(a.invars, b.invars, strict=True)
         if isinstance(x, jax_core.Literal)):
    return False
  values = [(v.aval.shape, w.aval.shape) for v, w in zip([*b.invars, *b.outvars],
                                                          [*a.invars, *a.outvars], strict=True)
            if not isinstance(v, jax_core.Literal)]
  if any(x != y and (x[1:] != y[1:] or not x) for x, y in values):
    return False  # a value that follows the rows holds them in its leading axis alone
  name, p = b.primitive.name, b.params
  if name in _ELEMENTWISE or name in ("reshape", "squeeze", "expand_dims"):
    return True
  if name in _REDUCTIONS:
    return 0 not in p["axes"]
  if name == "broadcast_in_dim":
    return not b.invars[0].aval.ndim or b.invars[0].aval.shape == a.invars[0].aval.shape or (
        p["broadcast_dimensions"][0] == 0)
  if name == "transpose":
    return p["permutation"][0] == 0
  if name == "iota":
    return p["dimension"] != 0
  return False


def _pieces(sizes: list[int], blocks: set[int], budget: int) -> list[_Piece]:
  """Whole leaves together up to a piece's bytes, in order; a leaf streamed by rows alone."""
  pieces, group, held = [], [], 0
  for j, size in enumerate(sizes):
    if group and (j in blocks or held + size > budget):
      pieces.append(_Piece(tuple(group)))
      group, held = [], 0
    if j in blocks:
      pieces.append(_Piece((j,), by_rows=True))
    else:
      group.append(j)
      held += size
  return [*pieces, _Piece(tuple(group))] if group else pieces


def _inlined(closed: Any) -> Any:
  """``closed`` with its calls (jit, checkpoint, custom rules) traced inline."""

  def call(_: Any, eqn: Any, ins: list) -> list:
    callee = _jaxpr.callee(eqn)
    return _jaxpr.interpret(rules, callee.jaxpr, callee.consts, ins)

  rules = _BIND._replace(table={_jaxpr.CALL: call})
  return jax.make_jaxpr(lambda *a: _jaxpr.interpret(rules, closed.jaxpr, closed.consts, a))(
      *closed.in_avals)


def _bind(eqn: Any, ins: list) -> list:
  """``eqn`` bound to ``ins``. In ``shard_map`` a jaxpr traced from types leaves a value that
  does not vary over the manual axes unmarked: it is marked as varying where the others are."""
  vmas = [_arrays.array_type(x).varying for x in ins]
  every = frozenset().union(*vmas)
  if every and eqn.primitive.name in _ELEMENTWISE:
    ins = [lax.pcast(x, tuple(every - v), to="varying") if every - v else x
           for x, v in zip(ins, vmas, strict=True)]
  out = eqn.primitive.bind(*ins, **eqn.params)
  return out if eqn.primitive.multiple_results else [out]


# A walk that binds each equation again: its results computed from its operands' values.
_BIND = _jaxpr.Rules({}, lambda _, eqn, ins: _bind(eqn, ins), lambda v: v.val)


def _run(plan: _Plan, leaves: list, hosted: list, owners: list, out_owners: list,
         to_host: list[bool]) -> list:
  """The update's outputs: values of no leaf or several once, each piece's in a chain of
  pieces (its state in once the last piece's new state is out), pass by pass."""
  host, device = jax.memory.Space.Host, jax.memory.Space.Device
  cut, consts, owner = plan.jaxpr.jaxpr, plan.whole.consts, dict(zip(plan.jaxpr.jaxpr.invars,
                                                                     owners, strict=True))
  passed = {v: x for v, x, h in zip(cut.invars, leaves, hosted, strict=True) if h}
  # Computed once, on whole leaves: the values `once` names that the outputs read, the inputs
  # of no leaf, and the outputs of no leaf that no pass computes (the state passed through
  # stays where it is).
  reach = _jaxpr.pruned(cut, cut.outvars, plan.once).invars
  wanted = [v for v in reach if owner.get(v) is None] + [
      v for v, o in zip(cut.outvars, out_owners, strict=True) if o is None and not isinstance(
          v, jax_core.Literal) and v not in plan.keep and v not in passed]
  whole = _jaxpr.pruned(plan.whole.jaxpr, [plan.twin[v] for v in wanted])
  inputs = dict(zip(plan.whole.jaxpr.invars, leaves, strict=True))
  known = dict(zip(wanted, _jaxpr.interpret(_BIND, whole, consts, [
      jax.device_put(inputs[w], device) if jax.typeof(inputs[w]).memory_space == host
      else inputs[w] for w in whole.invars]), strict=True))
  outs_of, coupled_of = collections.defaultdict(list), collections.defaultdict(list)
  for i, o in enumerate(out_owners):  # (pass, leaf) -> what a piece computes of the leaf then
    if o is not None:
      outs_of[plan.last[o], o].append(i)
  for v, (q, j) in plan.coupled.items():
    coupled_of[q, j].append(v)
  parts: dict[int, Any] = {}
  for p in range(plan.passes):
    # The values of several leaves that read the state, from the last pass's values.
    between = _jaxpr.pruned(cut, [v for v, s in plan.keep.items() if s == p], known)
    known.update(zip(between.outvars, _jaxpr.interpret(_BIND, between, consts, [
        known[v] for v in between.invars]), strict=True))
    previous: list = []
    for piece in plan.pieces:
      outs = sorted(i for j in piece.leaves for i in outs_of[p, j])
      coupled = [v for j in piece.leaves for v in coupled_of[p, j]]
      if not outs and not coupled:
        continue
      sub = _jaxpr.pruned(cut, [cut.outvars[i] for i in outs] + coupled, known)
      found = {v: inputs[plan.twin[v]] for v in sub.invars if owner.get(v) in piece.leaves}
      # The piece's state comes in once the last piece's new state is back in host memory
      # (an order, not a value: no gradient flows from one piece to the next).
      state = [v for v in found if v in passed]
      moved, _ = lax.optimization_barrier(([found[v] for v in state],
                                           lax.stop_gradient(previous)))
      found.update(zip(state, moved, strict=True))
      if piece.by_rows:
        new = _by_rows(plan, sub, outs, found, known, to_host)
      else:
        args = collections.ChainMap({v: jax.device_put(found[v], device) for v in state}, found,
                                    known)
        values = _jaxpr.interpret(_BIND, sub, consts, [args[v] for v in sub.invars])
        known.update(zip(coupled, values[len(outs):], strict=True))
        new = [jax.device_put(x, host) if to_host[i] else x for i, x in zip(outs, values,
                                                                              strict=False)]
      parts.update(zip(outs, new, strict=True))
      previous = [x for i, x in zip(outs, new, strict=True) if to_host[i]] or previous
  result = []
  for i, v in enumerate(cut.outvars):
    if i in parts:
      result.append(parts[i])
    elif isinstance(v, jax_core.Literal):
      result.append(v.val)
    elif v in passed:
      result.append(passed[v])  # the state passed through
    else:
      result.append(jax.device_put(known[v], host) if to_host[i] else known[v])
  return result


def _by_rows(plan: _Plan, sub: Any, outs: list[int], ins: dict, known: dict,
             to_host: list[bool]) -> list:
  """A leaf's outputs ``outs`` (``sub``'s first), a ``lax.scan`` over its rows: each row's
  state comes to the device, is computed there and goes back (the scan's outputs, in host
  memory). Each output on the device is written row by row, in place, into an input it fits
  (the params the row updates, the buffer that holds the updates), else into zeros."""
  host, device = jax.memory.Space.Host, jax.memory.Space.Device
  whole = dict(zip(plan.jaxpr.jaxpr.invars, plan.whole.in_avals, strict=True))
  rows = [v for v in ins if v.aval.shape != whole[v].shape]  # (1, ...) of (R, ...)
  fixed = collections.ChainMap({v: x for v, x in ins.items() if v not in rows}, known)
  kept = [i for i in outs if not to_host[i]]
  carried, free = [], [v for v in rows if jax.typeof(ins[v]).memory_space != host]
  depths = dict(zip(outs, _depths(sub, free), strict=False))  # (then `coupled`: none)
  for i in kept:
    aval, depth = plan.whole.out_avals[i], depths[i]
    # In place into the input nearest the output (the params of `p + u`), the later on a tie
    # (the buffer, after the params); then the gradients (`host_state` alone: optax's own).
    fits = [v for v in free if (whole[v].shape, whole[v].dtype) == (aval.shape, aval.dtype)]
    into = min(fits, key=lambda v: (v not in plan.prefer, depth.get(v, np.inf), -free.index(v)),
               default=None)
    if into is not None:
      free.remove(into)
    carried.append(into)
  streamed = [v for v in rows if v not in carried]

  def body(buffers: list, xs: tuple) -> tuple[list, list]:
    r, xs = xs
    args = fixed.new_child({v: (jax.device_put(x, device) if jax.typeof(
        x).memory_space == host else x)[None] for v, x in zip(streamed, xs, strict=True)})
    args.update((v, lax.dynamic_index_in_dim(b, r)) for v, b in zip(carried, buffers,
                                                                       strict=True) if v)
    values = _jaxpr.interpret(_BIND, sub, plan.whole.consts, [args[v] for v in sub.invars])
    new = {i: x[0] for i, x in zip(outs, values, strict=False)}
    return ([lax.dynamic_update_index_in_dim(b, new[i], r, 0) for i, b in zip(
        kept, buffers, strict=True)], [jax.device_put(new[i], host) for i in outs if to_host[i]])

  start = [ins[v] if v is not None else jnp.zeros(plan.whole.out_avals[i].shape,
                                                  plan.whole.out_avals[i].dtype)
           for i, v in zip(kept, carried, strict=True)]
  buffers, states = lax.scan(body, start, (jnp.arange(whole[rows[0]].shape[0]),
                                           [ins[v] for v in streamed]))
  done = dict(zip(kept, buffers, strict=True)) | dict(zip(
      [i for i in outs if to_host[i]], states, strict=True))
  return [done[i] for i in outs]


def _depths(jaxpr: Any, inputs: list) -> list[dict]:
  """For each output of ``jaxpr``, how many equations each of ``inputs`` is from it (along
  the shortest path), where it is computed from it."""
  def step(_: Any, eqn: Any, ins: list[dict]) -> list[dict]:
    near: dict = {}
    for d in ins:
      for v, n in d.items():
        near[v] = min(near.get(v, n + 1), n + 1)
    return [near] * len(eqn.outvars)

  return _jaxpr.interpret(_jaxpr.Rules({}, step, lambda v: {}), jaxpr,
                          [{}] * len(jaxpr.constvars),
                          [{v: 0} if v in inputs else {} for v in jaxpr.invars])
