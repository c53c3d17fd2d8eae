"""The inner optimizer's state in host memory, and its update run there.

An accumulation reads the inner optimizer's state once per window. Between
optimizer steps Adam's ``mu`` and ``nu`` (8 bytes per float32 parameter) sit
idle on the device; :func:`host_state` keeps them (every leaf of the state) in
host memory (``pinned_host``) and runs the update on the host: the state never
enters the device; the gradients go to the host, the updates come back. Two
ways to compile a train step with such a state:

* **one program** (``jax.jit`` as usual): the update runs inside the emitting
  branch of the window's ``lax.cond``; mid-steps pass the state through.
* **two programs** (:func:`jit`): the window's mid-steps compiled without the
  conditional and its closing step compiled apart; the package picks one per
  call from the window's count.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax
from jax._src import compute_on  # private: see `on_host`

from optax_accum import _arrays, _window

__all__ = ["HostState", "host_state", "jit"]

HOST = "pinned_host"


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
      memory (it names the platform and the JAX version).

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
    updates, new = on_host(run, (jax.memory.Space.Device, jax.memory.Space.Host), updates,
                           state.inner_state, params, extra_args)
    return updates, HostState(new)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def in_host_memory(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
  """``sharding`` in ``pinned_host``; a single device's as a ``NamedSharding``.

  JAX (0.10.2 to 0.12) types a value in host memory from a ``NamedSharding`` alone: a
  ``ShapeDtypeStruct`` or an array orbax restores with a ``SingleDeviceSharding`` in
  ``pinned_host`` is typed on the device, and a step returns it there.
  """
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(list(sharding.device_set), (
        "host_state",)), jax.sharding.PartitionSpec())
  return sharding.with_memory_kind(HOST)


def on_host(fn: Callable[..., Any], out_spaces: Any, *args: Any) -> Any:
  """``fn(*args)`` computed on the host, its outputs in ``out_spaces`` (a prefix tree).

  Only the arguments ``fn`` reads go to host memory. ``jax.experimental.compute_on`` would
  type ``fn``'s values like its arguments (host) and the arrays ``fn`` creates on the
  device, which JAX refuses to mix (``zeros_like``, ``where``: clipping, Adafactor, Lamb,
  Adagrad fail on JAX 0.10.2 to 0.12). So ``fn`` is traced on device types and bound to
  the host values with ``compute_on``'s primitive: the same arguments from JAX 0.10.2
  (where ``compute_on`` is a context manager) to 0.12 (where it takes ``out_memory_spaces``).
  """
  host = jax.memory.Space.Host
  typed = jax.tree.map(lambda x: jax.typeof(x).update(memory_space=jax.memory.Space.Device), args)
  closed, shape = jax.make_jaxpr(fn, return_shape=True)(*typed)
  # Its constants are operands too (a learning rate traced in the step, say).
  jaxpr = closed.jaxpr.replace(constvars=[], invars=[*closed.jaxpr.constvars, *closed.jaxpr.invars])
  leaves = [*closed.consts, *jax.tree.leaves(args)]
  read = {v for e in jaxpr.eqns for v in e.invars if isinstance(v, jax.extend.core.Var)}
  keep = [v in read or v in jaxpr.outvars for v in jaxpr.invars]
  spaces = jax.tree.map(lambda space, out: jax.tree.map(lambda _: space, out), out_spaces, shape,
                        is_leaf=lambda x: isinstance(x, jax.memory.Space))
  outs = compute_on.compute_on_p.bind(
      *[x if jax.typeof(x).memory_space == host else jax.device_put(x, host)
        for x, k in zip(leaves, keep, strict=True) if k],
      jaxpr=jax.extend.core.ClosedJaxpr(jaxpr.replace(invars=[
          v for v, k in zip(jaxpr.invars, keep, strict=True) if k]), []),
      compute_type="device_host", out_memory_spaces=tuple(jax.tree.leaves(spaces)),
      compiler_options_json=None)
  return jax.tree.unflatten(jax.tree.structure(shape), outs)


class _Phase:
  """What :func:`jit` traces: a window's mid-step (``emits`` False) or its closing step.

  ``cond`` is what the window's conditional becomes in that program: one branch, picked
  statically; it records the window's ``k`` (the count :func:`jit` dispatches on).
  ``trace`` checks that the step reaches exactly one conditional.
  """

  def __init__(self, emits: bool):
    self.emits, self.k, self.seen = emits, None, False

  def trace(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    self.seen = False
    with _window.PHASE(self):
      out = step(*args, **kwargs)
    if not self.seen and self.k is None:  # (a nested jax.jit traced in this phase before: seen)
      raise ValueError(
          f"`offload.jit`: the {'closing' if self.emits else 'mid'}-step program reached no window"
          " conditional: the step runs no `accumulate`. Compile it with `jax.jit`.")
    return out

  def cond(self, config: _window.Config, accept: Any, emit_now: Any) -> Callable[..., Any]:
    if self.seen or not (isinstance(config.k, int) and accept is True and emit_now is False
                         and config.reduction != "weighted" and self.k in (None, config.k)):
      raise ValueError(
          "`offload.jit` compiles a window's mid-steps and its closing step apart, which needs"
          " one window that closes after exactly `k` micro-batches, `k` an int: not with"
          " `skip_nonfinite`, `should_skip_update_fn`, `reduction='weighted'`, `emit_now`, `flush`,"
          " a schedule of `k` or two accumulations in one step. Compile the step with `jax.jit`.")
    self.k, self.seen = config.k, True
    return lambda pred, emitting, waiting, *ops: (emitting if self.emits else waiting)(*ops)


def _window_of(tree: Any) -> Any:
  return _arrays.first_node(tree, lambda n: hasattr(n, "mini_step") and hasattr(
      n, "gradient_step"))


def jit(step: Callable[..., Any], **jit_kwargs: Any) -> Callable[..., Any]:
  """``jax.jit(step)`` as two programs: the window's mid-steps, and its closing step.

  ``step`` is a train step holding one :func:`~optax_accum.accumulate` (or
  :class:`~optax_accum.MultiSteps`) whose state it takes and returns. The
  mid-step program is compiled without the window's conditional: it adds the
  micro-batch to the buffer and passes the inner optimizer's state through,
  never reading it (with :func:`host_state`, it stays on the host untouched).
  The closing step's program runs the inner optimizer. Each call runs the one
  its window's count asks for, read from the state the first time and
  counted on the host after (read again when a state comes in that the last
  call did not return). The results are ``jax.jit(step)``'s: bit for bit with
  :func:`~optax_accum.update_and_apply`; through ``update`` and
  ``optax.apply_updates`` XLA fuses the closing step apart and may round the
  update differently (AdamW: one element in 64 off by 1 ulp).

  The window must close after exactly ``k`` micro-batches (an int): not with
  ``skip_nonfinite``, ``should_skip_update_fn``, ``reduction="weighted"``,
  ``emit_now``, a schedule of ``k`` or a second accumulation in the step (a
  ``ValueError`` when traced); use ``jax.jit`` there. The phase each program is
  traced in is a JAX context (``jax.make_user_context``): a ``jax.jit`` nested
  in the step is traced once per program.

  Args:
    step: the train step; its arguments and results are pytrees holding the
      accumulation's state.
    **jit_kwargs: passed to ``jax.jit`` for both programs (``donate_argnums``,
      shardings).

  Returns:
    A function called like ``step``; its ``mid_step`` and ``closing_step``
    are the two ``jax.jit`` programs (to ``.lower(...)`` each, for its memory).

  Example:
    >>> import jax.numpy as jnp, optax, optax_accum as oa
    >>> tx = oa.accumulate(2, oa.host_state(optax.adam(1e-2)))
    >>> step = oa.offload.jit(lambda p, s, g: oa.update_and_apply(tx, g, s, p))
    >>> params = {"w": jnp.ones(3)}
    >>> state = tx.init(params)
    >>> for _ in range(2):
    ...   params, state = step(params, state, {"w": jnp.ones(3)})
    >>> int(state.gradient_step), [round(w, 4) for w in params["w"].tolist()]
    (1, [0.99, 0.99, 0.99])
  """
  phases = {emits: _Phase(emits) for emits in (False, True)}
  programs = {e: jax.jit(functools.partial(p.trace, step), **jit_kwargs)
              for e, p in phases.items()}
  last: dict[str, Any] = {"mini_step": None, "count": 0}

  def run(*args: Any, **kwargs: Any) -> Any:
    window = _window_of((args, kwargs))
    if window is None:
      raise TypeError("`offload.jit`: the step takes no state of `accumulate` or `MultiSteps`"
                      " (the window's count picks the program).")
    if phases[False].k is None:  # the window's k, and each program checked: from a trace
      for program in programs.values():
        program.trace(*args, **kwargs)
    count = last["count"] if window.mini_step is last["mini_step"] else int(window.mini_step)
    emits = count + 1 >= phases[False].k
    out = programs[emits](*args, **kwargs)
    last.update(mini_step=getattr(_window_of(out), "mini_step", None),
                count=0 if emits else count + 1)
    return out

  run.mid_step, run.closing_step = programs[False], programs[True]
  return run
