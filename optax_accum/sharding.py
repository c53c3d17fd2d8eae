"""Sharding helpers: lay the accumulation state out like the params.

Two ways to run :func:`~optax_accum.accumulate` on many devices:

* **jit with shardings** (auto-sharded, FSDP/ZeRO on a mesh): the buffer and
  every params-shaped leaf of the inner optimizer's state take the params'
  sharding. :func:`state_shardings` gives that tree, for
  ``jax.jit(tx.init, out_shardings=...)`` and for the train step's
  ``in_shardings``/``out_shardings``.
* **shard_map with** ``axis_name`` (explicit data parallelism, one gradient
  all-reduce per window): each device keeps its own buffer.
  :func:`per_device_state` wraps the transform so those per-device leaves carry
  a leading device axis, and :func:`shard_map_specs` gives the matching
  ``in_specs``/``out_specs``. Under ``pmap`` no wrapper is needed: pmap already
  stacks every leaf along the device axis.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from optax_accum import debug
from optax_accum.accumulation import AccumulateState

__all__ = [
    "per_device_state",
    "shard_map_specs",
    "state_shardings",
]


def _is_params_like(node: Any, params_def: Any, shapes: list[tuple[int, ...]]) -> bool:
  """Whether ``node`` is a copy of the params tree (same structure and shapes)."""
  if jax.tree.structure(node) != params_def:
    return False
  leaves = jax.tree.leaves(node)
  return all(tuple(jnp.shape(x)) == s for x, s in zip(leaves, shapes, strict=True))


def _replicated_like(sharding: Sharding) -> Sharding:
  if isinstance(sharding, NamedSharding):
    return NamedSharding(sharding.mesh, PartitionSpec())
  if isinstance(sharding, SingleDeviceSharding):
    return sharding
  raise TypeError(
      "`state_shardings` needs NamedSharding (or single-device) param shardings"
      f" to build the replicated sharding of scalar state leaves; got"
      f" {type(sharding).__name__}. Place the params with"
      " `jax.device_put(params, NamedSharding(mesh, spec))`."
  )


def state_shardings(
    tx: optax.GradientTransformation,
    params: optax.Params,
    shardings: Any = None,
) -> Any:
  """The shardings of ``tx.init(params)``'s state, laid out like the params.

  Every subtree of the state that is a copy of the params tree (same tree
  structure and leaf shapes: the accumulation buffer, Adam's ``mu``/``nu``,
  momentum traces, ...) gets the params' shardings leaf by leaf, whatever its
  dtype and however deeply it is nested (``optax.chain``, ``inject_hyperparams``,
  :func:`~optax_accum.accumulate` around any optimizer). Every other leaf
  (counters, scalars) is replicated on the params' mesh.

  Args:
    tx: the transformation whose state is wanted, e.g. ``accumulate(k, adam)``.
    params: the params, as arrays or ``jax.ShapeDtypeStruct`` (only shapes,
      dtypes and, when ``shardings`` is None, ``.sharding`` are read; nothing
      is computed).
    shardings: optional tree of ``jax.sharding.Sharding`` like ``params``; by
      default each param's own ``.sharding``.

  Returns:
    A tree of shardings with the structure of ``tx.init(params)``, for
    ``jax.jit(tx.init, out_shardings=...)`` and for the train step's
    ``in_shardings``/``out_shardings``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, optax_accum as oa
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> from optax_accum.sharding import state_shardings
    >>> mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    >>> params = {"w": jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data", "model")))}
    >>> tx = oa.accumulate(4, optax.adam(1e-3))
    >>> shardings = state_shardings(tx, params)
    >>> state = jax.jit(tx.init, out_shardings=shardings)(params)
    >>> state.acc_grads["w"].sharding.spec, state.inner_opt_state[0].mu["w"].sharding.spec
    (P('data', 'model'), P('data', 'model'))
    >>> state.mini_step.sharding.spec
    P()
  """
  if shardings is None:
    try:
      shardings = jax.tree.map(lambda p: p.sharding, params)
    except AttributeError as e:
      raise TypeError(
          "`state_shardings` reads each param's `.sharding`; got a leaf without"
          " one. Pass placed arrays, `jax.ShapeDtypeStruct(shape, dtype,"
          " sharding=...)`, or the `shardings` tree explicitly."
      ) from e
  params_def = jax.tree.structure(params)
  if jax.tree.structure(shardings) != params_def:
    raise ValueError(
        "`shardings` must have the structure of `params`; got"
        f" {jax.tree.structure(shardings)} for params {params_def}."
    )
  sharding_leaves = jax.tree.leaves(shardings)
  if not sharding_leaves:
    raise ValueError("`params` has no leaves; there is nothing to lay out.")
  replicated = _replicated_like(sharding_leaves[0])
  shapes = [tuple(jnp.shape(p)) for p in jax.tree.leaves(params)]
  abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), p.dtype), params)
  abstract_state = jax.eval_shape(tx.init, abstract)

  def is_params_like(node: Any) -> bool:
    return _is_params_like(node, params_def, shapes)

  def assign(node: Any) -> Any:
    if is_params_like(node):
      return shardings
    return replicated

  return jax.tree.map(assign, abstract_state, is_leaf=is_params_like)


def _map_per_device(state: Any, fn: Any) -> Any:
  """Applies ``fn`` to the per-device leaves: the buffer and the weight total."""

  def visit(node: Any) -> Any:
    if isinstance(node, AccumulateState):
      return node._replace(
          acc_grads=jax.tree.map(fn, node.acc_grads), acc_weight=fn(node.acc_weight))
    return node

  return jax.tree.map(visit, state, is_leaf=lambda n: isinstance(n, AccumulateState))


def _check_has_accumulate_state(state: Any, where: str) -> None:
  found = []
  _map_per_device(state, lambda x: found.append(x) or x)
  if not found:
    raise TypeError(
        f"`{where}` needs a transform built by `accumulate(k, ...,"
        " axis_name=...)` (or a chain holding one); its state has no"
        " AccumulateState."
    )


def per_device_state(
    tx: optax.GradientTransformation, axis_name: Any
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``accumulate(..., axis_name=...)`` for ``shard_map``.

  Under ``shard_map`` each device accumulates its own local gradients, so the
  buffer (and, for ``reduction="weighted"``, the weight total) differs from
  device to device and cannot be returned with a replicated ``P()`` out-spec.
  The wrapped transform gives those leaves a leading axis of length 1 inside
  ``shard_map``: with the :func:`shard_map_specs` they are stacked along
  ``axis_name`` outside (global shape ``(num_devices, *param_shape)``), like
  pmap's layout. Every other leaf (counters, the inner optimizer's state) is
  the same on every device and stays replicated.

  ``init`` must run inside ``shard_map`` (see the example). The wrapped
  ``accumulate`` checks that the incoming gradients are device-local
  (``check_grads_are_local``): gradients taken with respect
  to replicated params inside ``shard_map`` are already summed over the
  devices (JAX inserts that all-reduce on every micro-step), which would both
  spend the communication this transform saves and scale the result by the
  number of devices. Differentiate with respect to
  ``jax.lax.pcast(params, axis_name, to="varying")`` instead.

  Args:
    tx: a transform built by ``accumulate(k, optimizer, axis_name=axis_name)``
      (or a chain holding one).
    axis_name: the same axis name (or tuple of names).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with the same ``update``
    keywords (``weight=``, ``emit_now=``, extra args).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, optax_accum as oa
    >>> from functools import partial
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> from optax_accum.sharding import per_device_state, shard_map_specs
    >>> mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    >>> tx = per_device_state(oa.accumulate(2, optax.sgd(0.1), axis_name="data"), "data")
    >>> params = {"w": jnp.zeros(3)}
    >>> specs = shard_map_specs(tx, params, "data")
    >>> state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    >>> state.acc_grads["w"].shape  # one buffer per device
    (8, 3)
    >>> @jax.jit
    ... @partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")),
    ...          out_specs=(P(), specs))
    ... def step(params, state, x):
    ...   local = jax.lax.pcast(params, "data", to="varying")
    ...   grads = jax.grad(lambda p: jnp.mean(x @ p["w"]))(local)
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> x = jnp.ones((16, 3))
    >>> for _ in range(2):
    ...   params, state = step(params, state, x)
    >>> params["w"]  # one SGD step on the mean gradient (1, 1, 1)
    Array([-0.1, -0.1, -0.1], dtype=float32)
  """
  inner = optax.with_extra_args_support(tx)

  def init_fn(params: optax.Params) -> Any:
    state = inner.init(params)
    _check_has_accumulate_state(state, "per_device_state")
    return _map_per_device(state, lambda x: x[None])

  def update_fn(
      updates: optax.Updates, state: Any, params: optax.Params | None = None, **kwargs: Any
  ) -> tuple[optax.Updates, Any]:
    local = _map_per_device(state, lambda x: jnp.squeeze(x, 0))
    # accumulate(..., axis_name=...) itself rejects already-reduced gradients.
    new_updates, new_state = inner.update(updates, local, params, **kwargs)
    return new_updates, _map_per_device(new_state, lambda x: x[None])

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def shard_map_specs(
    tx: optax.GradientTransformation,
    params: optax.Params,
    axis_name: Any,
    param_specs: Any = None,
) -> Any:
  """``shard_map`` specs for the state of a :func:`per_device_state` transform.

  The per-device leaves (the buffer, the weight total) get ``axis_name`` on
  their leading axis; every other leaf is replicated, except params-shaped
  leaves of the inner optimizer's state, which take ``param_specs`` when
  given (params sharded over another mesh axis).

  Args:
    tx: the :func:`per_device_state`-wrapped transform.
    params: the params (arrays or ``jax.ShapeDtypeStruct``; only shapes are read).
    axis_name: the data-parallel axis name (or tuple of names).
    param_specs: optional tree of ``PartitionSpec`` like ``params``; default
      all replicated ``P()``.

  Returns:
    A tree of ``PartitionSpec`` with the structure of the state, for
    ``in_specs``/``out_specs``.
  """
  if param_specs is None:
    param_specs = jax.tree.map(lambda _: PartitionSpec(), params)
  params_def = jax.tree.structure(params)
  shapes = [tuple(jnp.shape(p)) for p in jax.tree.leaves(params)]
  abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), p.dtype), params)
  abstract_state = jax.eval_shape(tx.init, abstract)
  _check_has_accumulate_state(abstract_state, "shard_map_specs")
  axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  replicated = PartitionSpec()

  def is_node(node: Any) -> bool:
    return isinstance(node, AccumulateState) or _is_params_like(node, params_def, shapes)

  def per_device(spec: PartitionSpec) -> PartitionSpec:
    return PartitionSpec(axes if len(axes) > 1 else axes[0], *spec)

  def assign(node: Any) -> Any:
    if isinstance(node, AccumulateState):
      inner = jax.tree.map(assign, node.inner_opt_state, is_leaf=is_node)
      scalars = jax.tree.map(lambda _: replicated, node)
      return scalars._replace(
          acc_grads=jax.tree.map(
              per_device, param_specs, is_leaf=lambda s: isinstance(s, PartitionSpec)),
          acc_weight=per_device(replicated),
          inner_opt_state=inner,
      )
    if _is_params_like(node, params_def, shapes):
      return param_specs
    return replicated

  return jax.tree.map(assign, abstract_state, is_leaf=is_node)


def __getattr__(name: str) -> Any:
  # Deprecated aliases, kept for one release: HLO inspection moved to optax_accum.debug.
  if name in ("Collective", "hlo_collectives"):
    warnings.warn(
        f"`optax_accum.sharding.{name}` moved to `optax_accum.debug.{name}`; the alias"
        " will be removed in the next release. Import it from `optax_accum.debug`.",
        DeprecationWarning, stacklevel=2)
    return getattr(debug, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
