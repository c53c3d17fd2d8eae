"""The inner optimizer's state in host memory, and its update run there.

An accumulation reads the inner optimizer's state once per window. Between
optimizer steps Adam's ``mu`` and ``nu`` (8 bytes per float32 parameter) sit
idle on the device; :func:`host_state` keeps them (every leaf of the state) in
host memory (``pinned_host``) and runs the update on the host: the state never
enters the device. A train step compiles as usual (``jax.jit``). Inside
:func:`~optax_accum.accumulate` the window's emitting branch runs on the
host: the window's sum (the buffer, the last micro-batch added on the device) and
the params are copied there, the window's mean, the update and its application
are computed there, and the new
params (or the updates) come back, stored by the host in the device's own layout
(:func:`device_ordered`): they land in place, no parameter-sized temporary on the
device; mid-steps pass the state through. Alone, the gradients go to the host and
the updates come back.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax._src import compute_on  # private: see `on_host`
from jax.experimental.layout import Layout
from jax.interpreters import mlir

from optax_accum import _arrays, _jaxpr

__all__ = ["HostState", "host_state"]

HOST = "pinned_host"
# True while `on_host` traces what runs on the host: JAX keys its trace and compile caches on it.
ON_HOST = jax.make_user_context(False)


class HostState(NamedTuple):
  """State of :func:`host_state`.

  Attributes:
    inner_state: the inner optimizer's state, every array leaf in host memory
      (``pinned_host``) between updates.
  """

  inner_state: optax.OptState


def host_state(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """``inner`` with its state in host memory and its update computed there.

  ``init`` places ``inner``'s state in host memory (``pinned_host``, sharded
  like the params; a one-device state with a ``NamedSharding``, so that a
  ``jax.ShapeDtypeStruct`` of its shardings, or an array orbax restores into
  them, is typed in host memory too). ``update`` runs ``inner``'s update on
  the host (``compute_on``'s ``"device_host"``): the gradients (and the params
  or extra arguments, where ``inner`` reads them) go to host memory, the
  updates come back to the device, the new state stays on the host. Inside
  :func:`~optax_accum.accumulate` that is the window's emitting branch, once per
  optimizer step. The updates and the state are bit for bit ``inner``'s on
  XLA:CPU. On a mesh, build the state with ``jax.jit(init, out_shardings=...)``
  from :func:`~optax_accum.sharding.state_shardings` (a plain ``init`` puts the
  scalar counters on one device). Donating the state: JAX (0.10.2 to 0.12)
  pairs a donated argument with an output by shape alone, so return the params
  and the state in the order they are donated (or give ``out_shardings``).

  Args:
    inner: the optimizer whose state lives on the host.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`HostState`; ``update``'s keywords go to ``inner``.

  Raises:
    ValueError: from ``init``, where the devices have no ``pinned_host``
      memory (it names the platform and the JAX version); from ``update``, where
      a leaf of the state is typed in device memory (placed there by the caller):
      it is never updated on the device in silence.

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
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: optax.Params) -> HostState:
    for device in jax.local_devices():  # each one with host memory to hold a state
      kinds = sorted(m.kind for m in device.addressable_memories())
      if HOST not in kinds:
        raise ValueError(
            f"`host_state` keeps the optimizer state in host memory ({HOST!r}), which"
            f" {device.platform} ({device.device_kind}) does not offer with jax {jax.__version__}"
            f" and jaxlib {importlib.metadata.version('jaxlib')}: its memory kinds are {kinds}."
            " Use the optimizer without `host_state` there (its state then stays on the device).")
    state = inner.init(params)  # (a traced one's placement is its program's out_shardings)
    return HostState(jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host if getattr(
        x, "sharding", None) is None else in_host_memory(x.sharding)), state))

  def update_fn(updates: optax.Updates, state: HostState, params: optax.Params | None = None,
                **extra_args: Any) -> tuple[optax.Updates, HostState]:
    # In: what `inner` reads (the gradients; the params, extra args where it reads them).
    # Out: the updates, to the device; the new state, in host memory.
    run = lambda u, s, p, kw: inner.update(u, s, p, **kw)
    if ON_HOST.value:  # traced for the host already (`accumulate`'s emitting branch)
      updates, new = run(updates, state.inner_state, params, extra_args)
      return updates, HostState(new)
    on_device = [jax.tree_util.keystr(k) for k, x in jax.tree.leaves_with_path(state.inner_state)
                 if jax.typeof(x).memory_space != jax.memory.Space.Host]
    if on_device:  # never a silent update on the device
      raise ValueError(
          f"`host_state`: `state` holds {len(on_device)} leaves in device memory (inner_state"
          f"{on_device[0]}, ...); place it in host memory: `jax.device_put(state,"
          " optax_accum.sharding.state_shardings(tx, params))`, or restore into those shardings.")
    updates, new = on_host(run, (jax.memory.Space.Device, jax.memory.Space.Host), updates,
                           state.inner_state, params, extra_args, copied=False)
    return updates, HostState(new)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


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


def on_the_host(inner_state: Any) -> bool:
  """Whether a leaf of ``inner_state`` is typed in host memory (:func:`host_state`'s)."""
  return any(jax.typeof(x).memory_space == jax.memory.Space.Host
             for x in jax.tree.leaves(inner_state))


def on_host(fn: Callable[..., Any], out_spaces: Any, *args: Any, copied: bool = True) -> Any:
  """``fn(*args)`` computed on the host, its outputs in ``out_spaces`` (a prefix tree).

  Only the arguments ``fn`` reads go to host memory. ``jax.experimental.compute_on`` would
  type ``fn``'s values like its arguments (host) and the arrays ``fn`` creates on the
  device, which JAX refuses to mix (``zeros_like``, ``where``: clipping, Adafactor, Lamb,
  Adagrad fail on JAX 0.10.2 to 0.12). So ``fn`` is traced on device types and bound to
  the host values with ``compute_on``'s primitive: the same arguments from JAX 0.10.2
  (where ``compute_on`` is a context manager) to 0.12 (where it takes ``out_memory_spaces``).
  An output in device memory leaves the host in the device's storage order
  (``device_order_p``): a TPU compiler (libtpu 0.0.50) lays a host's output to the device
  out linearly and copies each matrix into its tiles there (deviceless v5e, f32: +4 device
  B/param at an update's closing step, +8 in a scanned MLP's); in that order it is a bitcast.
  """
  host, device = jax.memory.Space.Host, jax.memory.Space.Device
  typed = jax.tree.map(lambda x: jax.typeof(x).update(memory_space=device), args)
  with ON_HOST(True):
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*typed)
  spaces = jax.tree.leaves(jax.tree.map(
      lambda space, out: jax.tree.map(lambda _: space, out), out_spaces, shape,
      is_leaf=lambda x: isinstance(x, jax.memory.Space)))
  # What comes back to the device leaves the host in the device's order: no relayout there.
  # The calls (jit, custom rules) are inlined: a host compiler (libtpu 0.0.42.1) aborts on a
  # computation called from two places (Lamb's norms; CHECK computation_partitioner.cc:269:
  # tests/test_host_state.py's "makes_arrays" runs on a TPU v5e show it).
  closed = jax.make_jaxpr(lambda *a: [device_order_p.bind(o, inverse=False) if s == device else o
                                      for o, s in zip(inlined(closed.jaxpr, closed.consts, a),
                                                      spaces, strict=True)])(*closed.in_avals)
  # Its constants are operands too (a learning rate traced in the step, say).
  jaxpr = closed.jaxpr.replace(constvars=[], invars=[*closed.jaxpr.constvars, *closed.jaxpr.invars])
  leaves = [*closed.consts, *jax.tree.leaves(args)]
  read = {v for e in jaxpr.eqns for v in e.invars if isinstance(v, jax.extend.core.Var)}
  keep = [v in read or v in jaxpr.outvars for v in jaxpr.invars]
  # Moved through a barrier: the TPU compiler (libtpu 0.0.50) otherwise hands the host the
  # device buffers themselves, in a linear layout: a relayout copy of each 2-D leaf on the
  # device (+12 B/param for params, buffer and gradients); this way they are copied into
  # host memory as they are laid out.
  moved = [x if jax.typeof(x).memory_space == host else jax.device_put(x, host)
           for x, k in zip(leaves, keep, strict=True) if k]
  moved = lax.optimization_barrier(moved) if copied else moved
  outs = compute_on.compute_on_p.bind(
      *moved,
      jaxpr=jax.extend.core.ClosedJaxpr(jaxpr.replace(invars=[
          v for v, k in zip(jaxpr.invars, keep, strict=True) if k]), []),
      compute_type="device_host", out_memory_spaces=tuple(spaces), compiler_options_json=None)
  return jax.tree.unflatten(jax.tree.structure(shape), [
      device_order_p.bind(o, inverse=True) if s == device else o
      for o, s in zip(outs, spaces, strict=True)])


def inlined(jaxpr: Any, consts: Any, args: Any) -> list:
  """``jaxpr``'s outputs, its calls (jit, checkpoint, custom rules) traced inline."""

  def bind(_: Any, eqn: Any, ins: list) -> list:
    out = eqn.primitive.bind(*ins, **eqn.params)  # (a call's functions: `call` inlines it)
    return out if eqn.primitive.multiple_results else [out]

  def call(_: Any, eqn: Any, ins: list) -> list:
    return inlined(_jaxpr.callee(eqn).jaxpr, _jaxpr.callee(eqn).consts, ins)

  return _jaxpr.interpret(_jaxpr.Rules({_jaxpr.CALL: call}, bind, lambda v: v.val), jaxpr,
                          consts, args)


def device_ordered(x: jax.Array, layout: Layout, *, inverse: bool = False) -> jax.Array:
  """``x``'s elements in the order ``layout`` stores them, read row-major (or back: ``inverse``).

  The dims in ``layout``'s major-to-minor order, each split by its tile (``T(8,128)`` of a
  TPU's float32 matrix), the tiles' dims before the tile's. An array stored by a host in
  that order is, to the device, already laid out: the inverse is a bitcast there. ``x`` as
  it is where ``layout`` nests tiles (16-bit types: ``T(8,128)(2,1)``) or a tile pads it.
  """
  tile, m2m = (layout.tiling or ((),))[0], layout.major_to_minor
  dims = [x.shape[i] for i in m2m]
  n = len(dims) - len(tile)
  if len(layout.tiling) > 1 or n < 0 or any(d % t for d, t in zip(dims[n:], tile, strict=True)):
    return x
  split = dims[:n] + [v for d, t in zip(dims[n:], tile, strict=True) for v in (d // t, t)]
  perm = [*range(n), *range(n, len(split), 2), *range(n + 1, len(split), 2)]
  if inverse:
    return x.reshape([split[p] for p in perm]).transpose(np.argsort(perm)).reshape(
        dims).transpose(np.argsort(m2m))
  return x.transpose(m2m).reshape(split).transpose(perm).reshape(x.shape)


def _device_order_lowering(ctx: Any, x: Any, *, inverse: bool) -> Any:
  """:func:`device_ordered` in the default layout of the device the program is compiled for
  (its backend's answer): on one device (a sharded leaf's reorder would cross devices)."""
  aval, backend = ctx.avals_in[0], ctx.module_context.backend
  if (backend is None or not aval.ndim or not jnp.issubdtype(aval.dtype, jnp.inexact)
      or getattr(ctx.module_context.axis_context, "num_devices", 0) != 1):
    return [x]
  layout = Layout.from_pjrt_layout(backend.get_default_layout(
      np.dtype(aval.dtype), aval.shape, backend.devices()[0]))
  return mlir.lower_fun(functools.partial(device_ordered, layout=layout, inverse=inverse),
                        multiple_results=False)(ctx, x)


# The identity on values; compiled, what the host returns to the device leaves it in the
# device's order (`device_ordered`), and the device reads it in place.
device_order_p = jax.extend.core.Primitive("optax_accum_device_order")
device_order_p.def_abstract_eval(lambda x, *, inverse: x)
device_order_p.def_impl(lambda x, *, inverse: jax.jit(
    functools.partial(device_order_p.bind, inverse=inverse))(x))
mlir.register_lowering(device_order_p, _device_order_lowering)
