"""Gradient caching: the exact gradient of a loss that couples the examples of a batch.

A contrastive loss (CLIP's InfoNCE, SigLIP's sigmoid loss, in-batch negatives)
compares every example with every other one: split into micro-batches, each
one sees only its own negatives, and :func:`~optax_accum.microbatched` returns
another loss. :func:`cached_microbatched` (gradient caching, Gao et al. 2021)
splits the model where the examples meet: ``embed_fn`` maps each example to
its own outputs, ``loss_fn`` couples them. It runs three stages:

1. embed every micro-batch (a ``lax.scan`` of forward passes: nothing is
   differentiated, so no activation is kept);
2. on the whole batch's embeddings, the loss, its aux, and its gradient with
   respect to the embeddings and to the params (a learnable temperature);
3. embed each micro-batch again and pull its slice of the embeddings'
   gradient back through it (``jax.vjp``), summing the params' cotangents in
   float32 or wider (the rule of ``accumulate``'s buffer).

Activation memory peaks at one micro-batch's; the embeddings, their gradient
and what the loss builds from them (the B x B similarity matrix) stay
whole-batch. It costs one more forward pass.

``loss_fn`` is any function of the whole batch's embeddings: the dense
formula, or a loss of the user's own that walks the similarity matrix in
chunks when that matrix does not fit (the SigLIP paper's chunked sigmoid loss,
say).

Across devices each one embeds its own rows in both passes; the embeddings
(never activations) are all-gathered, every device computes the loss on the
global batch, and the gradients are all-reduced once, after the second pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from optax_accum import _arrays, _batch, _per_device, _validation

__all__ = ["cached_microbatched"]


def cached_microbatched(
    embed_fn: Callable[..., Any],
    loss_fn: Callable[..., Any],
    num_microbatches: int,
    *,
    batch_argnums: int | Sequence[int] = 1,
    rng_argnums: int | Sequence[int] = (),
    has_aux: bool = False,
    axis_name: Any = None,
) -> Callable[..., Any]:
  r"""The whole batch's value and gradient of a loss that couples the examples.

  ``grad_fn(params, *args)`` returns what
  ``jax.value_and_grad(lambda p, *a: loss_fn(p, embed_fn(p, *a), *a), has_aux=has_aux)``
  returns, with the activations of one micro-batch at a time:

  * ``embed_fn(params, *args)`` maps a (micro-)batch to per-example outputs:
    a pytree (several towers, several embeddings per example) whose leaves
    all have the batch's leading dimension. It is called on micro-batches
    only; put ``jax.checkpoint`` and mixed-precision casts inside it.
  * ``loss_fn(params, embeddings, *args)`` gets the whole batch's embeddings
    in the original row order, and the arguments unsplit (labels, masks,
    the key as given); it may read ``params`` (a learnable temperature).

  The batch rules are :func:`~optax_accum.microbatched`'s (argument positions,
  ``num_microbatches``, divisibility, the split, the keys: the same input
  gets the same answer or the same error): micro-batch ``i`` holds rows
  ``i, i + k, ...``. A key at
  ``rng_argnums`` is ``jax.random.fold_in(key, i)`` for micro-batch ``i`` in
  both passes (after folding in the device index, across devices), so a
  dropout mask is the same when the gradient is pulled back: the result is
  exact. Parameter gradients are summed in float32 (or wider) and cast back
  to the params' dtypes.

  Args:
    embed_fn: ``(params, *args) -> embeddings``, per example.
    loss_fn: ``(params, embeddings, *args) -> loss`` (``(loss, aux)`` with
      ``has_aux``), on the whole batch.
    num_microbatches: ``k``, a positive int dividing the batch size (on each
      device, across devices).
    batch_argnums: position(s) of the batch arguments in ``(params, *args)``
      (default 1), passed positionally; they must not include the params.
    rng_argnums: position(s) of PRNG key arguments (dropout keys).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    axis_name: inside ``shard_map``/``pmap``, the mesh axis (or axes) the
      batch is split over; under plain ``jit``, Auto axes the batch is split
      over (Explicit ones are read from the batch's type).

  Returns:
    ``grad_fn(params, *args) -> (loss, grads)`` (``((loss, aux), grads)``
    with ``has_aux``). Across devices the loss and aux are the global
    batch's, the same on every device, and the gradients are reduced.

  Data parallel: under plain ``jit`` with the batch sharded over Explicit
  mesh axes (or Auto ones named by ``axis_name``), and inside
  ``shard_map``/``pmap`` with ``axis_name``, each device embeds its own rows;
  ``loss_fn`` runs on every device, inside a ``shard_map``, on the
  all-gathered embeddings of the global batch (and the batch arguments it
  reads), local arrays on which ``a @ b.T`` is ordinary code. What crosses
  devices: the embeddings (an all-gather), the loss and aux (the same on
  every device: one ``pmax`` makes their type replicated), and the gradients
  (one all-reduce). Params sharded over the data axes (FSDP) are all-gathered
  once and get their gradients back in their sharding.

  Raises:
    TypeError: for a ``num_microbatches`` that is not a positive int (a float,
      a schedule).
    ValueError: when called with a batch that ``num_microbatches`` does not
      divide (per device, across devices), batch leaves of different sizes,
      argument positions that overlap or name the params, or an ``embed_fn``
      whose output leaves do not all have one row per example (a pooled
      statistic, whatever its width: the output's shape is also evaluated at
      twice the rows; or towers of different batch sizes).

  Example:
    A two-tower model and CLIP's loss, 8 examples in 4 micro-batches:

    >>> import jax, jax.numpy as jnp
    >>> from optax_accum.contrastive import cached_microbatched
    >>> def embed(p, batch):
    ...   return jnp.tanh(batch["x"] @ p["wx"]), jnp.tanh(batch["y"] @ p["wy"])
    >>> def clip_loss(p, emb, batch):
    ...   a, b = emb
    ...   logits = jnp.exp(p["t"]) * a @ b.T
    ...   labels = jnp.arange(a.shape[0])
    ...   xent = lambda z: -jnp.mean(jax.nn.log_softmax(z)[labels, labels])
    ...   return (xent(logits) + xent(logits.T)) / 2
    >>> ks = jax.random.split(jax.random.key(0), 4)
    >>> p = {"wx": jax.random.normal(ks[0], (3, 2)), "wy": jax.random.normal(ks[1], (5, 2)),
    ...      "t": jnp.zeros(())}
    >>> batch = {"x": jax.random.normal(ks[2], (8, 3)), "y": jax.random.normal(ks[3], (8, 5))}
    >>> loss, grads = jax.jit(cached_microbatched(embed, clip_loss, 4))(p, batch)
    >>> ref_loss, ref = jax.value_and_grad(lambda p, b: clip_loss(p, embed(p, b), b))(p, batch)
    >>> bool(jnp.allclose(loss, ref_loss)), bool(jnp.allclose(grads["wx"], ref["wx"], atol=1e-6))
    (True, True)
  """
  for name, f in (("embed_fn", embed_fn), ("loss_fn", loss_fn)):
    if not callable(f):
      raise TypeError(f"`{name}` must be callable; got {f!r}.")
  k = _batch.check_num_microbatches(num_microbatches)
  batch_argnums = _validation.check_argnums(batch_argnums, "batch_argnums")
  rng_argnums = _validation.check_argnums(rng_argnums, "rng_argnums", empty_ok=True)
  has_aux = _validation.check_flag(has_aux, "has_aux")
  cached = functools.partial(_cached, embed_fn, loss_fn, k, has_aux)

  def grad_fn(params: Any, *args: Any) -> Any:
    args = (params, *args)
    with _arrays.mesh_context(args):
      batch = _batch.of(args, batch_argnums, rng_argnums, axis_name=axis_name, in_step=True)
      batch.check_divides(k)
      if not batch.axes:  # one device, or inside shard_map/pmap
        bound = None if axis_name is None else _arrays.axis_names(axis_name)
        return cached(args, batch, bound)
      value, grads = _per_device.run(lambda *a: cached(a, batch, batch.axes), args,
                                     batch.positions, batch.axes, P())
      # Params sharded over the data axes (FSDP) get their gradients back in their sharding.
      return value, _batch.to_params(grads, params)

  return grad_fn


def _cached(embed_fn: Callable[..., Any], loss_fn: Callable[..., Any], k: int, has_aux: bool,
            args: tuple[Any, ...], batch: _batch.Batch, axes: tuple[Any, ...] | None) -> Any:
  """The three stages on this device's rows; ``axes``: the devices to gather and reduce over."""
  params = args[0] if axes is None else _per_device.make_varying(args[0], axes)
  keys = {i: _batch.device_key(args[i], axes) for i in batch.keys}
  steps = (jnp.arange(k), {i: _batch.split(args[i], k) for i in batch.positions})
  rows = batch.per_device_rows // k

  def embed(p: Any, i: Any, micro: dict[int, Any], rows: int) -> Any:
    """``embed_fn`` on micro-batch ``i`` (its ``rows`` rows ``micro``, its keys), checked."""
    micro_keys = {j: _batch.microbatch_key(key, i) for j, key in keys.items()}
    return _check_rows(embed_fn(*_batch.micro_args([p, *args[1:]], micro, micro_keys)), rows)

  _, stacked = lax.scan(lambda _, xs: (None, embed(params, *xs, rows)), None, steps)
  # Shapes only, at twice the rows: an output that merely happens to have `rows` rows (a
  # mean over the micro-batch of that width) does not follow them.
  doubled = {j: jax.tree.map(lambda x: jnp.concatenate([x[0], x[0]]), tree)
             for j, tree in steps[1].items()}
  jax.eval_shape(lambda: embed(params, 0, doubled, 2 * rows))
  emb, whole, devices = _batch.unsplit(stacked), list(args[1:]), 1
  if axes is not None:  # the global batch: every device's rows, in order
    gather = lambda tree: jax.tree.map(lambda x: lax.all_gather(x, axes, tiled=True), tree)
    emb, devices = gather(emb), lax.axis_size(axes)
    for i in batch.positions:  # XLA removes the gathers of those loss_fn does not read
      whole[i - 1] = gather(args[i])  # (`whole` holds args[1:])
  value, (g_params, g_emb) = jax.value_and_grad(
      lambda p, e: loss_fn(p, e, *whole), argnums=(0, 1), has_aux=has_aux,
  )(params, emb)
  if axes is not None:  # this device's rows of the embeddings' gradient
    start = lax.axis_index(axes) * rows * k
    g_emb = jax.tree.map(lambda g: lax.dynamic_slice_in_dim(g, start, rows * k), g_emb)

  def pull_back(acc: Any, xs: tuple[jax.Array, dict[int, Any], Any]) -> tuple[Any, None]:
    i, micro, g_micro = xs
    _, vjp = jax.vjp(lambda p: embed(p, i, micro, rows), params)
    return jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, vjp(g_micro)[0]), None

  # The loss's own gradient starts the sum; each device holds it whole, so 1/devices of it
  # joins the one all-reduce.
  init = jax.tree.map(lambda g: g.astype(_arrays.accumulator_dtype(g.dtype)) / devices, g_params)
  acc, _ = lax.scan(pull_back, init, (*steps, _batch.split(g_emb, k)))
  if axes is not None:
    acc = lax.psum(acc, axes)
    value = jax.tree.map(lambda v: lax.pmax(v, axes), value)  # equal everywhere; now typed so
  return value, jax.tree.map(lambda a, g: a.astype(g.dtype), acc, g_params)


def _check_rows(embeddings: Any, rows: int) -> Any:
  """``embeddings``, if every leaf has one row per example of the micro-batch, else raises."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(embeddings)[0]:
    shape = jnp.shape(leaf)
    if not shape or shape[0] != rows:
      raise ValueError(
          f"`embed_fn` returned shape {shape} at output{jax.tree_util.keystr(path)} for a"
          f" micro-batch of {rows} examples: every output leaf needs one row per example"
          f" (a leading dim of {rows}), since the whole batch's embeddings are joined"
          " along it. Compute pooled statistics in `loss_fn`, from the whole batch's"
          f" embeddings; keep several embeddings per example on a second axis ([{rows}, n,"
          " ...]), and give every tower the same examples.")
  return embeddings
