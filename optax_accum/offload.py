"""The inner optimizer's state in host memory between optimizer steps.

An accumulation reads the inner optimizer's state once per window. Between
optimizer steps Adam's ``mu`` and ``nu`` (8 bytes per float32 parameter) sit
idle on the device; :func:`host_state` keeps them (every leaf of the state) in
host memory (``pinned_host``) and brings them to the device only for the
update: inside the emitting branch of the window's ``lax.cond``, so mid-steps
pass it through.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any, NamedTuple

import jax
import optax
from jax import lax

__all__ = ["HostState", "host_state"]

HOST = "pinned_host"


class HostState(NamedTuple):
  """State of :func:`host_state`.

  Attributes:
    inner_state: the inner optimizer's state, every array leaf in host memory
      (``pinned_host``) between updates.
  """

  inner_state: optax.OptState


def host_state(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """``inner`` with its state kept in host memory between updates.

  ``init`` places ``inner``'s state in host memory (``pinned_host``, sharded
  like the params); ``update`` moves it to the device, runs ``inner``'s
  update and moves the new state back. Inside
  :func:`~optax_accum.accumulate` the moves run only in the window's emitting
  branch, once per optimizer step; in a chain or a step of its own, once per
  call. The updates, and the state's values, are bit for bit ``inner``'s.

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
    _check_host_memory()
    return HostState(jax.device_put(inner.init(params), jax.memory.Space.Host))

  def update_fn(updates: optax.Updates, state: HostState, params: optax.Params | None = None,
                **extra_args: Any) -> tuple[optax.Updates, HostState]:
    # Not before the updates exist: XLA would otherwise move the state in early (during
    # `microbatched`'s loop, say), where it sits beside the activations.
    updates, inner_state = lax.optimization_barrier((updates, state.inner_state))
    on_device = jax.device_put(inner_state, jax.memory.Space.Device)
    updates, new = inner.update(updates, on_device, params, **extra_args)
    return updates, HostState(jax.device_put(new, jax.memory.Space.Host))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_host_memory() -> None:
  """Raises unless every local device has host memory to hold a state (``pinned_host``)."""
  for device in jax.local_devices():
    kinds = sorted(m.kind for m in device.addressable_memories())
    if HOST not in kinds:
      raise ValueError(
          f"`host_state` keeps the optimizer state in host memory ({HOST!r}), which"
          f" {device.platform} ({device.device_kind}) does not offer with jax"
          f" {jax.__version__} and jaxlib {importlib.metadata.version('jaxlib')}: its"
          f" memory kinds are {kinds}. Use the optimizer without `host_state` there (its"
          " state then stays on the device).")
