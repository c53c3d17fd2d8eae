"""The gradient producers of plain ``jax.jit`` on a mesh: one gradient per device, unreduced.

:func:`local_value_and_grad` runs an unmodified model per device (through
``_per_device.run``) and returns each device's share of the gradient, stacked;
:func:`defer_reduction` types params so that ``jax.grad`` returns per-device
partial sums, and :func:`broadcast_like` is the bias add such a model needs.
:func:`~optax_accum.accumulate` with the same ``axis_name`` reduces them once
per window. Public through :mod:`optax_accum.sharding`, beside the functions
that lay out the state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from optax_accum import _arrays, _batch, _per_device, _validation


def local_value_and_grad(
    fn: Callable[..., Any],
    axis_name: Any,
    *,
    batch_argnums: int | Sequence[int] = 1,
    has_aux: bool = False,
    combine: str = "mean",
    allow_int: bool = False,
) -> Callable[..., Any]:
  """Like ``jax.value_and_grad(fn)``, with one gradient per device, unreduced.

  For data parallelism under plain ``jax.jit`` on a mesh whose ``axis_name``
  axes are Explicit (``jax.make_mesh``'s default), with the batch sharded
  over them, with or without ``jax.set_mesh``. Each device runs ``fn``, an
  unmodified model's loss, on its own rows of the batch (a ``shard_map``
  over ``axis_name``) and keeps its share of the global mean gradient: each
  gradient leaf comes back with a leading axis of one copy per device,
  sharded over ``axis_name`` (``float32[8@data, ...]`` on 8 devices; their
  sum is the global gradient), nothing is communicated, and
  :func:`~optax_accum.accumulate` with the same ``axis_name`` reduces the
  window once, when it closes (an all-reduce, or a reduce-scatter onto
  FSDP-sharded params). Params sharded over ``axis_name`` are all-gathered
  for the forward pass, as FSDP does. One device (a ``(1,)`` mesh) runs the
  same code.

  Args:
    fn: ``fn(params, *args) -> loss`` (``(loss, aux)`` with ``has_aux``), the
      mean loss over the rows it is given. The gradient is taken with respect
      to ``params``, the first argument.
    axis_name: the data axis (or tuple of axes) the batch is sharded over.
    batch_argnums: the positions of the batch arguments (an int or a tuple),
      split over ``axis_name`` along their leading axis; the other arguments
      are given whole to every device.
    has_aux: ``fn`` returns ``(loss, aux)``; the aux comes back as the mean of
      the devices' values.
    combine: how the devices' losses make the global one. ``"mean"``
      (default): ``fn`` returns the mean over its rows, and the global loss is
      the mean over the devices (the mean over all rows, as every device holds
      as many). ``"sum"``: ``fn`` returns its share and the shares add up,
      e.g. a token-weighted loss, the sum of its token losses over the
      *global* token count passed in as an argument (then
      ``accumulate(..., reduction="weighted")`` takes that count as ``weight``).
    allow_int: as for ``jax.grad``: integer params get a ``float0`` gradient
      (``accumulate`` counts it as zero) instead of an error.

  Returns:
    ``f(params, *args) -> (loss, grads)`` (``((loss, aux), grads)`` with
    ``has_aux``): the global loss, and each device's share of its gradient,
    stacked (``grads["w"].sum(0)`` is the gradient of the global loss).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, optax_accum as oa
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from optax_accum.sharding import local_value_and_grad
    >>> mesh = jax.make_mesh((8,), ("data",))  # Explicit axes; no jax.set_mesh
    >>> params = jax.device_put({"w": jnp.ones((3, 2)), "b": jnp.zeros(2)},
    ...                         NamedSharding(mesh, P()))
    >>> def loss(p, x):  # an unmodified model: a bias add needs no rewrite
    ...   return jnp.mean((x @ p["w"] + p["b"]) ** 2)
    >>> grad_fn = local_value_and_grad(loss, "data")
    >>> tx = oa.accumulate(2, optax.sgd(0.1), axis_name="data")
    >>> state = tx.init(params)
    >>> @jax.jit
    ... def step(params, state, x):
    ...   value, grads = grad_fn(params, x)
    ...   return (*oa.update_and_apply(tx, grads, state, params), value)
    >>> x = jax.device_put(np.ones((16, 3), np.float32), NamedSharding(mesh, P("data")))
    >>> print(jax.typeof(grad_fn(params, x)[1]["w"]))
    float32[8@data,3,2]
    >>> for _ in range(2):
    ...   params, state, value = step(params, state, x)
    >>> float(value), params["b"].tolist()  # one SGD step on the mean gradient (3, 3)
    (9.0, [-0.30000001192092896, -0.30000001192092896])
  """
  if not callable(fn):
    raise TypeError(f"`fn` must be callable (the loss of the model); got {fn!r}.")
  b_nums = _validation.check_argnums(batch_argnums, "batch_argnums")
  has_aux = _validation.check_flag(has_aux, "has_aux")
  allow_int = _validation.check_flag(allow_int, "allow_int")
  _validation.check_choice(combine, "combine", ("mean", "sum"), "Use 'mean' (fn returns the mean"
                           " over its rows) or 'sum' (fn returns its share of the global loss).")

  def value_and_grad(params: Any, *args: Any) -> Any:
    with _arrays.mesh_context((params, args)):
      axes = _explicit_axes(axis_name, "local_value_and_grad")
      batch = _batch.of((params, *args), b_nums, axis_name=axis_name)
      nums = batch.positions
      _check_data_axes_only(axes, nums, (params, *args))
      share = 1 / batch.devices if combine == "mean" else 1

      def per_device(params: Any, *args: Any) -> Any:
        def scaled(p: Any) -> tuple[jax.Array, Any]:
          out = fn(p, *args)
          loss, aux = out if has_aux else (out, None)
          return loss * share, aux  # this device's share of the global loss

        (loss, aux), grads = jax.value_and_grad(scaled, has_aux=True, allow_int=allow_int)(
            params)
        aux = jax.tree.map(lambda a: jax.lax.pmean(a, axes), aux)
        return (jax.lax.psum(loss, axes), aux), jax.tree.map(lambda g: g[None], grads)

      # Manual over every mesh axis: the model runs on whole params, as written.
      out_specs = ((PartitionSpec(), PartitionSpec()), PartitionSpec(_arrays.spec_entry(axes)))
      (loss, aux), grads = _per_device.run(per_device, (params, *args), nums, axes, out_specs,
                                           manual=jax.sharding.get_abstract_mesh().axis_names)
      return ((loss, aux), grads) if has_aux else (loss, grads)

  return value_and_grad


def _explicit_axes(axis_name: Any, who: str) -> tuple[Any, ...]:
  """``axis_name``'s axes, if they are Explicit axes of the current mesh, else raises."""
  mesh = jax.sharding.get_abstract_mesh()
  if _arrays.axis_kind(axis_name, check=False) != "Explicit":
    raise ValueError(
        f"`{who}` needs `axis_name={axis_name!r}` to name Explicit axes of the mesh the"
        " params and batch are placed on (jax.make_mesh gives Explicit axes by default; or"
        f" enter one with jax.set_mesh); the mesh here has axes {mesh.axis_names or '()'} of"
        f" kinds {[str(t).rsplit('.', 1)[-1] for t in mesh.axis_types]}. Inside shard_map or"
        " pmap use jax.value_and_grad on `jax.lax.pcast(params, axis_name, to='varying')`.")
  return _arrays.axis_names(axis_name)


def _check_data_axes_only(axes: tuple[Any, ...], b_nums: tuple[int, ...],
                          args: tuple[Any, ...]) -> None:
  """Raises unless ``fn``'s arguments are sharded over no mesh axis but the data ``axes``."""
  inputs = _arrays.ArrayLeaves.of(args)
  for path, x in zip(inputs.paths, inputs.arrays, strict=True):
    batch = path[0].idx in b_nums  # path[0]: fn's argnum
    other = {a for e in _arrays.array_type(x).spec[1 if batch else 0:] if e is not None
             for a in _arrays.axis_names(e)} - set(axes)
    if other:
      raise ValueError(
          f"`local_value_and_grad`: argument {path[0].idx}{jax.tree_util.keystr(path[1:])} of"
          " `fn` is sharded over"
          f" the mesh axes {sorted(other)}, which are not"
          f" `axis_name={_arrays.spec_entry(axes)!r}`."
          " It runs `fn` on whole params per device (a shard_map manual over every"
          " mesh axis), so it cannot keep a tensor-parallel layout. For such a model"
          " written for explicit sharding use `defer_reduction`; or shard only over the"
          " data axes (FSDP over them is fine).")


def defer_reduction(params: optax.Params, axis_name: Any) -> optax.Params:
  """``params`` typed so that their gradients come back unreduced over ``axis_name``.

  Under ``jax.jit`` in explicit-sharding mode, replicating a value over a mesh
  axis makes its gradient a cross-device sum, and XLA inserts that all-reduce
  into every call. Resharding the params to ``P(..., reduced={axis})`` first
  makes ``jax.grad`` return per-device partial sums instead
  (``float32[...]{U:data}``), and :func:`~optax_accum.accumulate` with
  ``axis_name`` keeps each device's as its copy in the buffer (no data moves)
  and reduces them once, when the window closes. (``microbatched`` needs none of
  this: under plain jit it reads the data axes from the batch's type.)
  Params sharded over ``axis_name`` (FSDP) are all-gathered over it here.

  Prefer :func:`local_value_and_grad`: it runs the model unmodified (here
  every bias add needs :func:`broadcast_like`) and needs no ``jax.set_mesh``.
  This is the way for a model written for explicit sharding over more mesh
  axes than the data ones (tensor parallelism), which ``local_value_and_grad``
  (a ``shard_map`` manual over every axis) cannot run.

  Args:
    params: the params, placed on an explicit mesh (``jax.set_mesh``).
    axis_name: the data axis (or tuple of axes) the batch is sharded over.

  Returns:
    The params, resharded; use them only as the argument of ``jax.grad``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_accum as oa
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> from optax_accum.sharding import defer_reduction
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    >>> with jax.set_mesh(mesh):
    ...   params = jax.device_put({"w": jnp.ones(3)}, P())
    ...   x = jax.device_put(jnp.ones((16, 3)), P("data"))
    ...   tx = oa.accumulate(2, optax.sgd(0.1), axis_name="data")
    ...   state = tx.init(params)
    ...   @jax.jit
    ...   def step(params, state, x):
    ...     grads = jax.grad(lambda p: jnp.mean(x @ p["w"]))(defer_reduction(params, "data"))
    ...     return oa.update_and_apply(tx, grads, state, params)
    ...   print(jax.typeof(state.acc_grads["w"]))  # one partial sum per device
    ...   for _ in range(2):
    ...     params, state = step(params, state, x)
    float32[8@data,3]
    >>> params["w"]  # one SGD step on the mean gradient (1, 1, 1)
    Array([0.9, 0.9, 0.9], dtype=float32)
  """
  axes = _explicit_axes(axis_name, "defer_reduction")

  def one(p: jax.Array) -> jax.Array:
    spec = jax.typeof(p).sharding.spec
    return jax.reshard(p, PartitionSpec(*_arrays.strip_axes(spec.partitions, axes),
                                        reduced=set(axes)))

  return jax.tree.map(one, params)


def broadcast_like(x: jax.Array, like: jax.Array) -> jax.Array:
  """``x`` broadcast to ``like``'s shape and sharding, with no communication.

  Under :func:`defer_reduction` a param is typed *reduced* over the data axes,
  and JAX will not combine it elementwise with a batch-sharded activation
  (a bias add raises "Inputs cannot be sharded/varying on the same axes that
  another input is reduced on"). Broadcasting it to the activation's type
  first is free: each device already holds the whole param, and its gradient
  stays unreduced. A value that is not reduced is returned as it is (ordinary
  broadcasting applies), so a model can call this unconditionally.
  Only :func:`defer_reduction` needs it.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> from optax_accum.sharding import broadcast_like, defer_reduction
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    >>> with jax.set_mesh(mesh):
    ...   p = defer_reduction({"w": jax.device_put(jnp.ones((3, 2)), P()),
    ...                        "b": jax.device_put(jnp.ones(2), P())}, "data")
    ...   x = jax.device_put(jnp.ones((16, 3)), P("data"))
    ...   h = x @ p["w"]
    ...   print(jax.typeof(h + broadcast_like(p["b"], h)))
    float32[16@data,2]
  """
  if not _arrays.array_type(x).spec.reduced:
    return x
  return jax.reshard(jnp.broadcast_to(x, jnp.shape(like)), jax.typeof(like).sharding.spec)

