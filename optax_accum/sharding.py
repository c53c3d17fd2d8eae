"""Sharding helpers: one gradient reduction per window, on any kind of mesh.

Three ways to run :func:`~optax_accum.accumulate` data-parallel:

* **plain jit, explicit sharding** (the batch sharded over ``AxisType.Explicit``
  mesh axes, ``jax.make_mesh``'s default; ``jax.set_mesh`` optional): take the
  gradients with :func:`local_value_and_grad` ``(loss, "data")``: the model
  runs unmodified on each device's rows and the gradients come back as one
  copy per device (each device's share, stacked along a leading axis sharded
  over ``"data"``); ``accumulate(k, opt, axis_name="data")`` keeps its buffer
  the same way, mid-steps move no gradient bytes between devices, and the
  emitting step reduces once (an all-reduce, or a reduce-scatter for
  FSDP-sharded params). The state is ordinary arrays: the host reads, saves
  and restores it; :func:`reshard_state` moves it to another device count.
  A model written for explicit sharding over more axes (tensor parallel)
  differentiates :func:`defer_reduction` ``(params, "data")`` instead.
* **shard_map with** ``axis_name``: each device keeps its own buffer.
  :func:`per_device_state` wraps the transform so those per-device leaves
  carry a leading device axis, and :func:`shard_map_specs` gives the matching
  ``in_specs``/``out_specs``. Under ``pmap`` no wrapper is needed.
* **jit with shardings** and no ``axis_name`` (auto-sharded, FSDP on a mesh):
  correct, but XLA reduces the gradients on every micro-step.

In every case :func:`state_shardings` lays the optimizer state out like the
params, for ``jax.jit(tx.init, out_shardings=...)``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from optax_accum import _arrays, _state, offload
from optax_accum._gradients import broadcast_like, defer_reduction, local_value_and_grad
from optax_accum.accumulation import AccumulateState

__all__ = [
    "broadcast_like",
    "defer_reduction",
    "local_value_and_grad",
    "per_device_state",
    "reshard_state",
    "shard_map_specs",
    "state_shardings",
]


def _is_masked(node: Any) -> bool:
  return isinstance(node, optax.MaskedNode)


def _leaf_layout(value: Any, target: Any, param: Any, other: Any) -> Any:
  """The layout of one state leaf found at ``param``'s place in the state.

  ``target`` (a sharding or spec) if the leaf has the param's shape; the same
  after unsharded leading axes if it stacks copies of it (L-BFGS's memory, the
  buffer of :func:`per_device_state`); else ``other``. A MaskedNode stays as it is.
  """
  if _is_masked(value):
    return value
  shape, lead = tuple(jnp.shape(value)), len(jnp.shape(value)) - len(param.shape)
  if lead < 0 or shape[lead:] != tuple(param.shape):
    return other
  if lead == 0 or _arrays.on_one_device(target):
    return target
  named = isinstance(target, NamedSharding)
  if not (named or isinstance(target, PartitionSpec)):
    return other
  spec = PartitionSpec(*(None,) * lead, *(target.spec if named else target))
  return NamedSharding(target.mesh, spec, memory_kind=target.memory_kind) if named else spec


def _lay_out_like_params(
    tx: optax.GradientTransformation, params: optax.Params, per_param: Any, other: Any,
) -> tuple[Any, Any]:
  """``(abstract_state, layout)``: a layout entry for each leaf of ``tx.init(params)``.

  Each subtree of the state with the params' tree structure (``optax.MaskedNode``
  where ``optax.masked`` and ``optax.multi_transform`` leave a param out) and an
  array at each param's place is laid out by :func:`_leaf_layout` from the
  params' entries of ``per_param``. Every other leaf gets ``other``;
  ``optax.MaskedNode`` placeholders stay as they are. ``per_param`` has the
  params' tree structure (:func:`_check_like_params`).
  """
  abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p)),
                          params)
  state = jax.eval_shape(tx.init, abstract)
  params_def = jax.tree.structure(abstract)

  def is_params_like(node: Any) -> bool:  # (params one array: every array leaf is)
    try:
      leaves = params_def.flatten_up_to(node)
    except (ValueError, TypeError):
      return False
    return all(_is_masked(v) or hasattr(v, "shape") for v in leaves)

  def lay_out(node: Any) -> Any:
    if not is_params_like(node):
      return other
    return jax.tree.map(lambda v, t, p: _leaf_layout(v, t, p, other), node, per_param, abstract,
                        is_leaf=_is_masked)

  return state, jax.tree.map(lay_out, state, is_leaf=is_params_like)


def _check_like_params(per_param: Any, params: Any, name: str) -> None:
  if jax.tree.structure(per_param) != jax.tree.structure(params):
    raise ValueError(
        f"`{name}` must have the structure of `params` (one entry per param); got"
        f" {jax.tree.structure(per_param)} for params {jax.tree.structure(params)}.")


def _replicated_like(sharding: Sharding) -> Sharding:
  if isinstance(sharding, NamedSharding):
    return NamedSharding(sharding.mesh, PartitionSpec())
  if _arrays.on_one_device(sharding):
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

  Every params-shaped leaf of the state (the accumulation buffer, Adam's
  ``mu``/``nu``, momentum traces, ...) gets its own param's sharding, whatever
  its dtype and however the optimizer nests or masks its state
  (``optax.chain``, ``inject_hyperparams``, ``optax.masked``,
  ``optax.multi_transform``, :func:`~optax_accum.accumulate` around any of
  them). Every other leaf (counters, scalars, hyperparameters) is replicated
  on the params' mesh; ``optax.MaskedNode`` placeholders hold no array and
  stay in the tree as they are. The state of :func:`~optax_accum.host_state`
  gets the same layouts in host memory (``memory_kind="pinned_host"``).

  A leaf is params-shaped when it sits in a subtree of the state with the
  params' tree structure (``optax.MaskedNode`` where a param is masked out)
  and has its param's shape. A leaf there that stacks copies of its param
  along leading axes (L-BFGS's memory) gets the param's sharding after
  unsharded leading axes; one of another shape (adafactor's factored rows
  and columns) is replicated.

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
    >>> params["b"] = jax.device_put(jnp.zeros(4), NamedSharding(mesh, P("model")))
    >>> adam_on_w = optax.masked(optax.adam(1e-3), {"w": True, "b": False})
    >>> mu = state_shardings(oa.accumulate(4, adam_on_w), params).inner_opt_state.inner_state[0].mu
    >>> mu["w"].spec, mu["b"]
    (P('data', 'model'), MaskedNode())
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
  sharding_leaves = jax.tree.leaves(shardings)
  if not sharding_leaves:
    raise ValueError("`params` has no leaves; there is nothing to lay out.")
  _check_like_params(shardings, params, "shardings")
  mesh = getattr(sharding_leaves[0], "mesh", None)
  if isinstance(mesh, jax.sharding.Mesh) and _arrays.has_explicit_axes(mesh):
    # Explicit axes put the layout in the types: what `init` builds on the mesh.
    abstract = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p),
                                                              sharding=s), params, shardings)
    with jax.set_mesh(mesh):
      state = jax.eval_shape(tx.init, abstract)
    layout = jax.tree.map(lambda v: v if _is_masked(v) else NamedSharding(
        mesh, _arrays.array_type(v).spec), state, is_leaf=_is_masked)
  else:
    layout = _lay_out_like_params(tx, params, shardings, _replicated_like(sharding_leaves[0]))[1]
  # The state of `host_state` in host memory (its memory kind: `eval_shape` drops it).
  return jax.tree.map(lambda n: jax.tree.map(offload.in_host_memory, n) if isinstance(
      n, offload.HostState) else n, layout, is_leaf=lambda n: isinstance(n, offload.HostState))


def _map_per_device(fn: Any, state: Any, **kw: Any) -> Any:
  """Applies ``fn`` to the per-device leaves of each accumulation state in ``state``.

  Those ``_state.map_state`` maps: the buffer and the open window's totals
  (a noise-scale state's window sums are per device; its averages are not).
  """
  return jax.tree.map(lambda n: _state.map_state(fn, n, **kw) if isinstance(
      n, AccumulateState) else n, state, is_leaf=lambda n: isinstance(n, AccumulateState))


def reshard_state(restored: Any, like: Any) -> Any:
  """A restored state laid out like ``like``: resume on another number of devices.

  ``like`` is the state ``tx.init(params)`` builds where the job resumes (the
  new mesh, or one device); ``restored`` is a state of the same transform
  saved anywhere else, as host arrays (or ``jax.Array`` s this process can
  read), in any pytree form a checkpoint returns: the state itself, or the
  nested dicts and lists of ``orbax`` or ``flax.serialization.msgpack_restore``
  (leaves are matched by their names and positions; one of size 0, which
  orbax does not save, may be missing).

  Each per-device partial sum (the buffer of ``accumulate(...,
  axis_name=...)`` under plain jit, ``shard_map`` or ``pmap``, and the open
  window's weight and noise sums) is summed over the devices it was saved
  from and put on the first device of the new layout, the others at zero:
  the window's total, what its emitting step reduces, is kept (to float
  rounding). A buffer saved on one device without ``axis_name`` counts as
  one device's. Every other leaf is taken as it is (under ``pmap``, the copy
  on device 0). Each leaf is placed with ``like``'s sharding, memory kind
  included (a :func:`~optax_accum.host_state` state lands in host memory). A
  state laid out as ``like`` already comes back unchanged, bit for bit.

  Under plain jit (``local_value_and_grad``, ``defer_reduction``), and with
  ``reduction="weighted"`` anywhere, the partial sums are shares of the
  window's gradient, so the resumed window is exact. Under ``shard_map`` and
  ``pmap`` with ``"mean"`` or ``"sum"`` they sum each device's own mean:
  change the device count there between windows (``mini_step == 0``).

  Args:
    restored: the saved state (or the subtree of a checkpoint holding it).
    like: the state for the new layout, e.g. ``tx.init(params)``.

  Returns:
    A state with ``like``'s structure, shapes, dtypes and shardings.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, optax_accum as oa
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from optax_accum.sharding import reshard_state
    >>> tx = oa.accumulate(4, optax.sgd(0.1), axis_name="data")
    >>> def init_on(n):  # the state on a mesh of n devices
    ...   mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    ...   return tx.init(jax.device_put({"w": jnp.zeros(3)}, NamedSharding(mesh, P())))
    >>> saved = jax.device_get(init_on(8))   # on the host, as a checkpoint holds it
    >>> saved = saved._replace(mini_step=np.int32(2),   # mid-window: 8 partial sums of ones
    ...                        acc_grads={"w": np.ones((8, 3), np.float32)})
    >>> state = reshard_state(saved, init_on(2))
    >>> state.acc_grads["w"].shape, state.acc_grads["w"].tolist(), int(state.mini_step)
    ((2, 3), [[8.0, 8.0, 8.0], [0.0, 0.0, 0.0]], 2)
  """
  saved = {_names(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]}
  per_device = {_names(path) for path, _ in _state.leaves(like, walk=_map_per_device)}

  def fit(path: tuple[Any, ...], target: Any) -> jax.Array:
    key = _names(path)
    if key not in saved and jnp.size(target):  # (orbax saves no size-0 array)
      raise ValueError(
          f"`restored` has no leaf at {jax.tree_util.keystr(path)}, which `like` holds. Pass"
          " the state saved from the same transform (`like` is its `tx.init(params)` on the"
          " new mesh).")
    leaf = saved[key] if key in saved else np.zeros(jnp.shape(target), target.dtype)
    new = _fit_leaf(np.asarray(leaf), target, key in per_device, jax.tree_util.keystr(path))
    return jax.device_put(new, getattr(target, "sharding", None))

  return jax.tree_util.tree_map_with_path(fit, like)


def _names(path: tuple[Any, ...]) -> tuple[Any, ...]:
  """A key path by names and positions alone: a NamedTuple's field and a dict's key alike."""
  return tuple(next(getattr(k, a) for a in ("name", "key", "idx") if hasattr(k, a))
               for k in path)


def _fit_leaf(saved: np.ndarray, target: Any, per_device: bool, where: str) -> np.ndarray:
  """One saved leaf in ``target``'s shape: partial sums combined, pmap copies dropped."""
  shape, dtype = tuple(jnp.shape(target)), jnp.dtype(target.dtype)
  if saved.shape == shape:
    return saved.astype(dtype)
  wide = np.result_type(saved.dtype, np.float64 if jnp.issubdtype(dtype, jnp.inexact) else np.int64)
  if per_device:  # their total; a buffer saved without `axis_name` is one copy
    copies = saved[None] if saved.ndim + 1 == len(shape) else saved
    if copies.shape[1:] == shape:
      return copies.sum(0, dtype=wide).astype(dtype)  # onto one buffer without `axis_name`
    if copies.ndim == len(shape) and copies.shape[1:] == shape[1:]:  # on the first device
      new = np.zeros(shape, dtype)
      new[0] = copies.sum(0, dtype=wide)
      return new
  if not per_device and saved.ndim == len(shape) and saved.shape[1:] == shape[1:]:
    return np.broadcast_to(saved[0], shape).astype(dtype)  # pmap: a copy per device
  raise ValueError(
      f"The restored leaf at {where} has shape {saved.shape}, which cannot be laid out as"
      f" {shape} ({'a per-device partial sum' if per_device else 'a copy of the same value'})."
      " Pass the state saved from the same transform and params (`like` is its"
      " `tx.init(params)` on the new mesh).")


def _check_has_accumulate_state(state: Any, where: str) -> None:
  if _arrays.first_node(state, lambda n: isinstance(n, AccumulateState)) is None:
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
  ``accumulate`` checks that the incoming gradients are device-local:
  gradients taken with respect
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
    return _map_per_device(lambda x: x[None], state)

  def update_fn(
      updates: optax.Updates, state: Any, params: optax.Params | None = None, **kwargs: Any
  ) -> tuple[optax.Updates, Any]:
    local = _map_per_device(lambda x: jnp.squeeze(x, 0), state)
    # accumulate(..., axis_name=...) itself rejects already-reduced gradients.
    new_updates, new_state = inner.update(updates, local, params, **kwargs)
    return new_updates, _map_per_device(lambda x: x[None], new_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def shard_map_specs(
    tx: optax.GradientTransformation,
    params: optax.Params,
    axis_name: Any,
    param_specs: Any = None,
) -> Any:
  """``shard_map`` specs for the state of a :func:`per_device_state` transform.

  The per-device leaves (the buffer, the weight total) get ``axis_name`` on
  their leading axis, followed by their param's spec. Every params-shaped
  leaf of the inner optimizer's state gets its own param's spec from
  ``param_specs`` (params sharded over another mesh axis), however the
  optimizer nests or masks its state, found as in :func:`state_shardings`.
  Every other leaf is replicated, ``P()``; ``optax.MaskedNode`` placeholders
  stay as they are.

  Args:
    tx: the :func:`per_device_state`-wrapped transform.
    params: the params (arrays or ``jax.ShapeDtypeStruct``; only shapes are read).
    axis_name: the data-parallel axis name (or tuple of names).
    param_specs: optional tree of ``PartitionSpec`` like ``params``; default
      all replicated ``P()``.

  Returns:
    A tree of ``PartitionSpec`` with the structure of the state, for
    ``in_specs``/``out_specs``.

  Example:
    >>> import jax.numpy as jnp, optax, optax_accum as oa
    >>> from jax.sharding import PartitionSpec as P
    >>> from optax_accum.sharding import per_device_state, shard_map_specs
    >>> params = {"w": jnp.zeros((4, 2)), "b": jnp.zeros(2)}
    >>> adam_on_w = optax.masked(optax.adam(1e-3), {"w": True, "b": False})
    >>> tx = per_device_state(oa.accumulate(2, adam_on_w, axis_name="data"), "data")
    >>> specs = shard_map_specs(tx, params, "data", {"w": P(None, "model"), "b": P("model")})
    >>> specs.acc_grads
    {'b': P('data', 'model'), 'w': P('data', None, 'model')}
    >>> specs.inner_opt_state.inner_state[0].mu
    {'b': MaskedNode(), 'w': P(None, 'model')}
    >>> specs.mini_step
    P()
  """
  if param_specs is None:
    param_specs = jax.tree.map(lambda _: PartitionSpec(), params)
  _check_like_params(param_specs, params, "param_specs")
  state, specs = _lay_out_like_params(tx, params, param_specs, PartitionSpec())
  _check_has_accumulate_state(state, "shard_map_specs")
  # The per-device leaves have a leading axis of length 1 (laid out ``None``): ``axis_name``.
  entry = _arrays.spec_entry(_arrays.axis_names(axis_name))
  return _map_per_device(lambda spec: PartitionSpec(entry, *spec[1:]), specs)
