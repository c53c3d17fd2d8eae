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
  label: dict  # var -> the param leaves it is computed from
  reads: set  # the vars computed from the state (an input in host memory)
  stage: dict  # var -> the pass that computes it
  once: set  # the vars computed once, from `whole`: of no leaf, or of several, or reduced rows
  pieces: list[_Piece]
  passes: int  # 0 where a value of several leaves reads their whole state: no streaming
  prefer: frozenset = frozenset()  # inputs a leaf streamed by rows writes its outputs into


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
  jaxpr = whole
  while blocks:
    cut = [a.update(shape=(1, *a.shape[1:])) if o in blocks and a.ndim and
           a.shape[0] == lead[o] else a for a, o in zip(avals, owners, strict=True)]
    try:
      jaxpr = _inlined(jax.make_jaxpr(flat)(*cut))
      kept = _separable(whole, jaxpr, hosted, owners, out_owners, blocks)
    except Exception:  # the update fails on a row: its leaves stream whole
      kept = set()
    if kept == blocks:
      break
    blocks, jaxpr = kept, whole
  label, reads, stage = _labels(jaxpr, hosted, owners)
  twin = dict(zip(_vars(jaxpr), _vars(whole), strict=True))
  moved = lambda v: twin[v].aval.shape != v.aval.shape
  once = set()
  for eqn in jaxpr.jaxpr.eqns:
    narrowed = any(not isinstance(i, jax_core.Literal) and moved(i) for i in eqn.invars)
    for v in eqn.outvars:
      if (not label[v] and not moved(v)) or (v not in reads and (
          len(label[v]) > 1 or (narrowed and not moved(v)))):
        once.add(v)
  couples = [e for e in jaxpr.jaxpr.eqns if any(len(label[v]) > 1 and v in reads
                                                 for v in e.outvars)]
  if any(not isinstance(i, jax_core.Literal) and len(label[i]) == 1 and i in reads and i.aval.ndim
         for e in couples for i in e.invars):  # a value of several leaves' whole state
    return _Plan(whole, whole, *_labels(whole, hosted, owners), set(),
                 [_Piece(tuple(range(len(sizes))))], 0)
  last = max([stage[v] for v, o in zip(jaxpr.jaxpr.outvars, out_owners, strict=True)
              if not isinstance(v, jax_core.Literal) and o is not None], default=0)
  return _Plan(jaxpr, whole, label, reads, stage, once, _pieces(sizes, blocks, budget), last + 1)


def _one_device(leaves: list) -> bool:
  """Whether blocks of these leaves' rows stay on each device: one device in all, a leaf on
  one device, or typed on a mesh that does not shard its leading axis."""
  def one(x: Any) -> bool:
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
      return len(x.sharding.device_set) == 1
    s = jax.typeof(x).sharding
    return s.mesh.size > 0 and not (s.spec and s.spec[0])
  return jax.device_count() == 1 or all(map(one, leaves))


def _vars(closed: Any) -> list:
  """Every variable of a jaxpr, in order: constants, inputs, each equation's outputs."""
  j = closed.jaxpr
  return [*j.constvars, *j.invars, *(v for e in j.eqns for v in e.outvars)]


def _labels(closed: Any, hosted: list, owners: list) -> tuple[dict, set, dict]:
  """Each variable's owners (the param leaves it is computed from), which read the state,
  and the pass each is computed in: one after the values of several leaves it reads."""
  j = closed.jaxpr
  label = {v: frozenset() for v in j.constvars}
  label.update({v: frozenset() if o is None else frozenset([o])
                for v, o in zip(j.invars, owners, strict=True)})
  reads = {v for v, h in zip(j.invars, hosted, strict=True) if h}
  stage = dict.fromkeys(label, 0)
  for eqn in j.eqns:
    ins = [v for v in eqn.invars if not isinstance(v, jax_core.Literal)]
    # A leaf's value scaled by a number of several leaves (a global norm's) is still the
    # leaf's: that number is computed between passes.
    own = frozenset().union(*(label[v] for v in ins if len(label[v]) < 2 or v.aval.size > 1))
    own = own or frozenset().union(*(label[v] for v in ins))
    s = max([stage[v] + (len(own) > 1 and len(label[v]) == 1 and v in reads) for v in ins],
            default=0)
    for v in eqn.outvars:
      label[v], stage[v] = own, s
      if any(v in reads for v in ins):
        reads.add(v)
  return label, reads, stage


def _separable(whole: Any, cut: Any, hosted: list, owners: list, out_owners: list,
               blocks: set[int]) -> set[int]:
  """The leaves of ``blocks`` whose update, traced on one row (``cut``), computes each row
  from that row alone where it reads the state: the same equations as ``whole``, the rows
  the leading axis of every value that follows them, of each output of the leaf too."""
  if [e.primitive for e in whole.jaxpr.eqns] != [e.primitive for e in cut.jaxpr.eqns] or (
      [v.aval for v in whole.jaxpr.constvars] != [v.aval for v in cut.jaxpr.constvars]):
    return set()
  label, reads, _ = _labels(cut, hosted, owners)
  kept = {j for j in blocks if all(
      isinstance(v, jax_core.Literal) or v.aval.shape[:1] != w.aval.shape[:1]
      for v, w, o in zip(cut.jaxpr.outvars, whole.jaxpr.outvars, out_owners, strict=True)
      if o == j)}
  for a, b in zip(whole.jaxpr.eqns, cut.jaxpr.eqns, strict=True):
    moved_in = [not isinstance(v, jax_core.Literal) and v.aval.shape != w.aval.shape
                for v, w in zip(b.invars, a.invars, strict=True)]
    moved_out = [v.aval.shape != w.aval.shape for v, w in zip(b.outvars, a.outvars, strict=True)]
    if not any(moved_in + moved_out):
      continue
    here = frozenset().union(*(label[v] for v in b.outvars))
    if (any(moved_out) or any(v in reads for v in b.outvars)) and (
        len(here) > 1 or not _keeps_rows(a, b)):
      kept -= here or kept  # (a value of no leaf that follows the rows: a zeros_like)
  return kept


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

  rules = _jaxpr.Rules({_jaxpr.CALL: call}, lambda _, eqn, ins: _bind(eqn, ins), lambda v: v.val)
  return jax.make_jaxpr(lambda *a: _jaxpr.interpret(rules, closed.jaxpr, closed.consts, a))(
      *closed.in_avals)


def _bind(eqn: Any, ins: list) -> list:
  """``eqn`` bound to ``ins``. In ``shard_map`` a jaxpr traced from types leaves a value that
  does not vary over the manual axes unmarked: it is marked as varying where the others are."""
  vmas = [_varying(jax.typeof(x)) for x in ins]
  every = frozenset().union(*vmas)
  if every and eqn.primitive.name in _ELEMENTWISE:
    ins = [lax.pcast(x, tuple(every - v), to="varying") if every - v else x
           for x, v in zip(ins, vmas, strict=True)]
  out = eqn.primitive.bind(*ins, **eqn.params)
  return out if eqn.primitive.multiple_results else [out]


def _passes(plan: _Plan, out_owners: list) -> tuple[dict, list]:
  """The pass that computes each leaf's outputs, and per pass the values of one leaf that
  the next pass's values of several leaves read."""
  jaxpr, last = plan.jaxpr.jaxpr, {}
  for v, o in zip(jaxpr.outvars, out_owners, strict=True):
    if o is not None and not isinstance(v, jax_core.Literal):
      last[o] = max(last.get(o, 0), plan.stage[v])
  return last, [[i for e in jaxpr.eqns if any(plan.stage[o] == p + 1 and len(plan.label[o]) > 1
                                              for o in e.outvars)
                 for i in e.invars if not isinstance(i, jax_core.Literal)
                 and len(plan.label[i]) == 1 and i in plan.reads]
                for p in range(max(plan.passes, 1))]


def _varying(aval: Any) -> frozenset:
  """The manual axes ``aval`` varies over (JAX 0.10.2 names them in ``manual_axis_type``)."""
  axes = getattr(aval, "manual_axis_type", None)
  return axes.varying if axes is not None else frozenset(getattr(aval, "vma", ()))


def _run(plan: _Plan, leaves: list, hosted: list, owners: list, out_owners: list,
         to_host: list[bool]) -> list:
  """The update's outputs: values of no leaf or several once, each piece's in a chain of
  pieces (its state in once the last piece's new state is out), pass by pass."""
  host, device = jax.memory.Space.Host, jax.memory.Space.Device
  jaxpr, whole = plan.jaxpr.jaxpr, plan.whole.jaxpr
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}
  whole_producer = {v: e for e in whole.eqns for v in e.outvars}
  twin = dict(zip(_vars(plan.jaxpr), _vars(plan.whole), strict=True))
  whole_env = dict(zip(whole.constvars, plan.whole.consts, strict=True))
  whole_env.update((v, jax.device_put(x, device) if h else x)
                   for v, x, h in zip(whole.invars, leaves, hosted, strict=True) if not h)

  def whole_value(w: Any) -> Any:  # computed once, on whole leaves
    if isinstance(w, jax_core.Literal):
      return w.val
    if w not in whole_env:
      if w in whole.invars:  # a value of the state read whole (a count)
        whole_env[w] = jax.device_put(leaves[whole.invars.index(w)], device)
      else:
        e = whole_producer[w]
        whole_env.update(zip(e.outvars, _bind(e, [whole_value(i) for i in e.invars]),
                             strict=True))
    return whole_env[w]

  shared: dict = {}  # values of several leaves that read the state, and what they read

  def value(v: Any, local: dict) -> Any:
    if isinstance(v, jax_core.Literal):
      return v.val
    for env in (local, shared):
      if v in env:
        return env[v]
    if v in plan.once or v not in producer:
      return whole_value(twin[v])
    e = producer[v]
    out = _bind(e, [value(i, local) for i in e.invars])
    (shared if len(plan.label[v]) > 1 else local).update(zip(e.outvars, out, strict=True))
    return value(v, local)

  def needs(targets: list, inputs: dict) -> tuple[list, list]:
    """The piece's inputs and the values of no leaf or several that ``targets`` read."""
    seen, stack, found, outside = set(), list(targets), [], []
    while stack:
      v = stack.pop()
      if isinstance(v, jax_core.Literal) or v in seen:
        continue
      seen.add(v)
      if v in inputs:
        found.append(v)
      elif v in shared or v in plan.once or v not in producer:
        outside.append(v)
      else:
        stack += producer[v].invars
    return found, outside

  last, coupled_in = _passes(plan, out_owners)
  parts: dict[int, Any] = {}
  for p in range(max(plan.passes, 1)):
    previous: list = []
    for piece in plan.pieces:
      mine = set(piece.leaves)
      outs = [i for i, (v, o) in enumerate(zip(jaxpr.outvars, out_owners, strict=True))
              if o in mine and (plan.passes == 0 or last[o] == p)]
      targets = [jaxpr.outvars[i] for i in outs] + [
          i for i in coupled_in[p] if next(iter(plan.label[i])) in mine]
      inputs = {v: x for v, x, o in zip(jaxpr.invars, leaves, owners, strict=True) if o in mine}
      if not targets:
        continue
      found, outside = needs([t for t in targets if not isinstance(t, jax_core.Literal)], inputs)
      # The piece's state comes in once the last piece's new state is back in host memory
      # (an order, not a value: no gradient flows from one piece to the next).
      state = [v for v in found if jax.typeof(inputs[v]).memory_space == host]
      moved, _ = lax.optimization_barrier(([inputs[v] for v in state],
                                           lax.stop_gradient(previous)))
      ins = {**{v: inputs[v] for v in found}, **dict(zip(state, moved, strict=True))}
      outer = {v: value(v, {}) for v in outside}  # (computed here, outside any scan)
      sent = []
      if piece.by_rows:
        new = _by_rows(outs, ins, outer, jaxpr, twin, value, to_host, plan.prefer)
      else:
        local = {v: jax.device_put(x, device) if jax.typeof(x).memory_space == host else x
                 for v, x in ins.items()}
        local.update(outer)
        new = [value(jaxpr.outvars[i], local) for i in outs]
        new = [jax.device_put(x, host) if to_host[i] else x for i, x in zip(outs, new,
                                                                             strict=True)]
      for i, x in zip(outs, new, strict=True):
        parts[i] = x
        if to_host[i]:
          sent.append(x)
      for v in targets[len(outs):]:  # (no leaf streamed by rows reads a value of several)
        shared[v] = value(v, local)
      previous = sent or previous
  result = []
  for i, v in enumerate(jaxpr.outvars):
    if i in parts:
      result.append(parts[i])
    elif isinstance(v, jax_core.Literal):
      result.append(v.val)
    elif v in jaxpr.invars and hosted[jaxpr.invars.index(v)]:
      result.append(leaves[jaxpr.invars.index(v)])  # the state passed through
    else:
      x = whole_value(twin[v])
      result.append(jax.device_put(x, host) if to_host[i] else x)
  return result


def _by_rows(outs: list[int], ins: dict, outer: dict, jaxpr: Any, twin: dict,
             value: Callable, to_host: list[bool], prefer: set) -> list:
  """A leaf's outputs ``outs``, a ``lax.scan`` over its rows: each row's state comes to the
  device, is computed there and goes back (the scan's outputs, in host memory). Each output on
  the device is written row by row, in place, into an input it fits (the params the row
  updates, the buffer that holds the updates), else into zeros."""
  host, device = jax.memory.Space.Host, jax.memory.Space.Device
  rows = [v for v in ins if v.aval.shape != twin[v].aval.shape]  # (1, ...) of (R, ...)
  fixed = {**{v: ins[v] for v in ins if v not in rows}, **outer}
  kept = [i for i in outs if not to_host[i]]
  carried, free = [], [v for v in rows if jax.typeof(ins[v]).memory_space != host]
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}
  for i in kept:
    aval, depth = twin[jaxpr.outvars[i]].aval, _depths(jaxpr.outvars[i], producer)
    # In place into the input nearest the output (the params of `p + u`), the later on a tie
    # (the buffer, after the params); then the gradients (`host_state` alone: optax's own).
    fits = [v for v in free if (twin[v].aval.shape, twin[v].aval.dtype) == (aval.shape, aval.dtype)]
    into = min(fits, key=lambda v: (v not in prefer, depth.get(v, len(depth)), -free.index(v)),
               default=None)
    if into is not None:
      free.remove(into)
    carried.append(into)
  streamed = [v for v in rows if v not in carried]

  def body(buffers: list, xs: tuple) -> tuple[list, list]:
    r, xs = xs
    local = dict(fixed)
    local.update((v, (jax.device_put(x, device) if jax.typeof(x).memory_space == host else x)[
        None]) for v, x in zip(streamed, xs, strict=True))
    local.update((v, lax.dynamic_index_in_dim(b, r)) for v, b in zip(carried, buffers,
                                                                        strict=True) if v)
    new = {i: value(jaxpr.outvars[i], local)[0] for i in outs}
    return ([lax.dynamic_update_index_in_dim(b, new[i], r, 0) for i, b in zip(
        kept, buffers, strict=True)], [jax.device_put(new[i], host) for i in outs if to_host[i]])

  n = twin[rows[0]].aval.shape[0]
  start = [ins[v] if v is not None else jnp.zeros(twin[jaxpr.outvars[i]].aval.shape,
                                                  twin[jaxpr.outvars[i]].aval.dtype)
           for i, v in zip(kept, carried, strict=True)]
  buffers, states = lax.scan(body, start, (jnp.arange(n), [ins[v] for v in streamed]))
  done = dict(zip(kept, buffers, strict=True)) | dict(zip(
      [i for i in outs if to_host[i]], states, strict=True))
  return [done[i] for i in outs]


def _depths(out: Any, producer: dict) -> dict:
  """How many equations each variable is from ``out``, through the equations that compute it."""
  depth, frontier = {out: 0}, [out]
  while frontier:
    nxt = []
    for v in frontier:
      for i in producer[v].invars if v in producer else ():
        if not isinstance(i, jax_core.Literal) and i not in depth:
          depth[i] = depth[v] + 1
          nxt.append(i)
    frontier = nxt
  return depth
