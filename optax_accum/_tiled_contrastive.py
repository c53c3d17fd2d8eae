"""CLIP's and SigLIP's losses in tiles: memory linear in the batch, one ring across devices.

The B x B similarity matrix ``s = x @ y.T / temperature`` is never built. A
``jax.custom_vjp`` walks it in column tiles of ``[rows, block_size]``:

* forward: CLIP keeps an online log-sum-exp per row (``r``) and, for the
  columns of the tile, their log-sum-exp over the rows (``c``); SigLIP only
  sums its pairwise terms. The loss follows from ``r``, ``c`` and the
  diagonal.
* backward: each tile is recomputed and its gradient ``G`` (CLIP:
  ``(softmax_rows + softmax_cols) / 2B``, less the diagonal; SigLIP:
  ``sigmoid / B``) goes straight into ``dx += G @ y_tile`` and the tile's
  ``dy = G.T @ x``: nothing tile-sized outlives its tile.

On ``n`` devices (``axis_name``) each device holds its rows of ``x`` and
``y``; the blocks of ``y`` travel a ring (``lax.ppermute``, ``n - 1`` steps,
one block in flight), with their column statistics in the forward and their
partial gradient ``dy`` in the backward, which walks the ring the other way
so that each block's ``dy`` ends on the device that owns it. What each device
keeps: its rows, its rows' statistics, the block it ended the forward with,
one block in flight: ``O(B / n * D)``, whatever ``n``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from optax_accum import _arrays, _batch, _per_device

__all__ = ["clip_loss", "siglip_loss"]

# The widest tile by default: a [rows, 512] float32 tile is 32 MiB at 16,384 rows.
_BLOCK = 512


def clip_loss(x: jax.Array, y: jax.Array, temperature: Any, *, block_size: int | None = None,
              axis_name: Any = None) -> jax.Array:
  r"""CLIP's symmetric InfoNCE loss, in tiles: memory linear in the batch.

  With the logits ``s = x @ y.T / temperature`` (``[B, B]``, never built), the
  mean of the two cross-entropies (image to text, text to image) whose
  positive is the matching row:

  .. math::

     L = \frac{1}{2B} \sum_i \Big(\log \sum_j e^{s_{ij}} - s_{ii}\Big)
       + \frac{1}{2B} \sum_j \Big(\log \sum_i e^{s_{ij}} - s_{jj}\Big)

  ``temperature`` **divides** the logits. CLIP learns ``logit_scale``, which
  multiplies them: pass ``temperature=jnp.exp(-logit_scale)``. Normalising
  ``x`` and ``y`` is the caller's. The value, and the gradients with respect
  to ``x``, ``y`` and ``temperature``, are the dense formula's (a
  ``jax.custom_vjp``): the forward walks tiles of ``[rows, block_size]``
  columns with an online log-sum-exp per row and per column; the backward
  recomputes each tile. Temporaries: a few tiles and ``O(B * D)``, never
  ``B x B``. bfloat16 inputs are multiplied as they are and everything is
  summed in float32 (float64 inputs: float64); the loss is in that dtype,
  the gradients in the inputs'.

  Many devices: inside ``jax.shard_map`` over ``axis_name`` (with its default
  ``check_vma=True``: ``pmap`` and ``check_vma=False`` are refused),
  ``x`` and ``y`` are this device's rows of the global batch (device ``d``
  holds rows ``d * B/n`` onwards) and the loss is the global batch's, the
  same on every device. The blocks of ``y`` travel a ring of ``n - 1``
  ``lax.ppermute`` steps, one block in flight, and their gradients travel
  back the same way; nothing is all-gathered. Under plain ``jit`` with the
  rows sharded over Explicit mesh axes, the type says so and the same ring
  runs over them (Auto axes: name them in ``axis_name``). Gradients follow
  JAX's rules: a device's ``x`` and ``y`` get theirs; a ``temperature`` the
  same on every device gets the total.

  Args:
    x: ``[B, D]`` embeddings of one side (images), row ``i`` paired with row
      ``i`` of ``y``.
    y: ``[B, D]`` embeddings of the other side (texts).
    temperature: a positive scalar dividing the logits; differentiable.
    block_size: the columns of one tile (default 512, at most the rows on
      this device). One that does not divide the rows is fine: the last tile
      is padded, and its padded columns are masked out of every sum.
    axis_name: the ``shard_map`` axis (or axes) the rows are split over;
      None on one device, or under plain ``jit`` on a mesh whose
      Explicit axes the rows' type names.

  Returns:
    The loss, a scalar.

  Raises:
    TypeError: for a ``block_size`` that is not an int (a float, a bool).
    ValueError: for ``x`` and ``y`` that are not ``[B, D]`` floating arrays
      of one shape, a ``temperature`` that is not a real scalar, a
      ``block_size`` below 1, an ``axis_name`` that no ``shard_map`` binds
      and no mesh holds, one bound by ``pmap`` or ``shard_map(...,
      check_vma=False)`` (whose types cannot carry the gradients' sum over
      the devices), or rows of ``x`` and ``y`` sharded differently.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax_accum.contrastive import clip_loss
    >>> kx, ky = jax.random.split(jax.random.key(0))
    >>> x = jax.random.normal(kx, (256, 32))
    >>> y = x + jax.random.normal(ky, (256, 32))
    >>> x, y = (v / jnp.linalg.norm(v, axis=1, keepdims=True) for v in (x, y))
    >>> loss, grads = jax.value_and_grad(clip_loss, argnums=(0, 1, 2))(x, y, 0.1, block_size=64)
    >>> def dense(x, y, t):
    ...   s = x @ y.T / t
    ...   return -(jnp.trace(jax.nn.log_softmax(s, axis=1))
    ...            + jnp.trace(jax.nn.log_softmax(s, axis=0))) / (2 * len(s))
    >>> ref, ref_grads = jax.value_and_grad(dense, argnums=(0, 1, 2))(x, y, 0.1)
    >>> bool(jnp.allclose(loss, ref)), all(bool(jnp.allclose(g, r, atol=1e-6))
    ...                                    for g, r in zip(grads, ref_grads))
    (True, True)

    On 8 devices, each with 32 rows, the same loss:

    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    >>> ring = jax.shard_map(lambda x, y: clip_loss(x, y, 0.1, axis_name="data"), mesh=mesh,
    ...                      in_specs=P("data"), out_specs=P())
    >>> bool(jnp.allclose(jax.jit(ring)(x, y), ref))
    True
  """
  return _run(_clip, x, y, {"temperature": temperature}, block_size, axis_name)


def siglip_loss(x: jax.Array, y: jax.Array, temperature: Any, bias: Any, *,
                block_size: int | None = None, axis_name: Any = None) -> jax.Array:
  r"""SigLIP's pairwise sigmoid loss, in tiles: memory linear in the batch.

  With the logits ``s = x @ y.T / temperature + bias`` (``[B, B]``, never
  built) and ``z`` 1 on the matching pairs, -1 elsewhere, the loss of the
  SigLIP paper (Zhai et al. 2023), normalised by the batch:

  .. math::

     L = -\frac{1}{B} \sum_{i, j} \log \sigma(z_{ij} s_{ij})

  ``temperature`` **divides** the logits: the paper's ``t = exp(t')``
  multiplies them, so pass ``temperature=jnp.exp(-t_prime)``. ``temperature``
  and ``bias`` are learnable: the gradient flows to both. Tiles, precision,
  devices and errors are :func:`clip_loss`'s; each term is computed as
  ``softplus(-z s)``, exact for large logits.

  Args:
    x: ``[B, D]`` embeddings of one side, row ``i`` paired with row ``i`` of
      ``y``.
    y: ``[B, D]`` embeddings of the other side.
    temperature: a positive scalar dividing the logits; differentiable.
    bias: a scalar added to the logits; differentiable.
    block_size: the columns of one tile, as in :func:`clip_loss`.
    axis_name: the ``shard_map`` axis the rows are split over, as in
      :func:`clip_loss`.

  Returns:
    The loss, a scalar.

  Raises:
    TypeError: as :func:`clip_loss`.
    ValueError: as :func:`clip_loss`, and for a ``bias`` that is not a real
      scalar.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax_accum.contrastive import siglip_loss
    >>> kx, ky = jax.random.split(jax.random.key(0))
    >>> x = jax.random.normal(kx, (100, 16))
    >>> y = x + jax.random.normal(ky, (100, 16))
    >>> x, y = (v / jnp.linalg.norm(v, axis=1, keepdims=True) for v in (x, y))
    >>> loss, grads = jax.value_and_grad(siglip_loss, argnums=(2, 3))(x, y, 0.1, -10.0,
    ...                                                               block_size=32)
    >>> def dense(t, b):
    ...   z = 2 * jnp.eye(len(x)) - 1
    ...   return -jnp.sum(jax.nn.log_sigmoid(z * (x @ y.T / t + b))) / len(x)
    >>> ref, ref_grads = jax.value_and_grad(dense, argnums=(0, 1))(0.1, -10.0)
    >>> bool(jnp.allclose(loss, ref)), bool(jnp.allclose(jnp.stack(grads), jnp.stack(ref_grads)))
    (True, True)
  """
  return _run(_siglip, x, y, {"temperature": temperature, "bias": bias}, block_size, axis_name)


class _Ring(NamedTuple):
  """Where the rows live and how the tiles are cut: static, one per call."""

  axes: tuple[Any, ...] | None  # the manual axes the rows are split over; None: one device
  devices: int  # along ``axes``
  rows: int  # on this device: the rows of x, and the columns of each block of y
  block: int  # the columns of one tile

  @property
  def tiles(self) -> int:
    return -(-self.rows // self.block)

  def index(self) -> Any:
    """This device's place on the ring (its block of rows)."""
    return 0 if self.axes is None else lax.axis_index(self.axes)

  def total(self, x: jax.Array) -> jax.Array:
    return x if self.axes is None else lax.psum(x, self.axes)


def _walk(ring: _Ring, tile: Any, carry: Any, block: tuple[Any, Any, Any], direction: int
          ) -> tuple[Any, Any]:
  """``tile(owner, carry, (y_tile, stats, out, i))`` on every tile of the blocks this device meets.

  A block is ``(y_tiles, stats, out)``, each ``[tiles, ...]`` (``stats`` and ``out``
  may be None); ``tile`` returns the carry and its tile of the new ``out``. Between
  blocks every block moves one device along ``direction`` (``devices - 1`` steps,
  one block in flight, ``lax.ppermute``: ``d -> d + direction``). Forward
  (``direction=1``) each device starts with its own block and ends with its next
  neighbour's; backward (-1) it starts with that one and ends with its own.
  Returns the carry and the block held last.
  """
  def visit(carry: Any, block: tuple[Any, Any, Any], owner: Any) -> tuple[Any, Any]:
    y_tiles, stats, out = block
    carry, out = lax.scan(functools.partial(tile, owner), carry,
                          (y_tiles, stats, out, jnp.arange(ring.tiles)))
    return carry, (y_tiles, stats, out)

  owner = ring.index() if direction == 1 else (ring.index() + 1) % ring.devices
  if ring.devices > 1:
    perm = [(d, (d + direction) % ring.devices) for d in range(ring.devices)]

    def step(state: Any, _: Any) -> tuple[Any, None]:
      carry, block, owner = state
      carry, block = visit(carry, block, owner)
      block = lax.ppermute(block, ring.axes, perm)
      return (carry, block, (owner - direction) % ring.devices), None
    (carry, block, owner), _ = lax.scan(step, (carry, block, owner), length=ring.devices - 1)
  return visit(carry, block, owner)


def _tiled(ring: _Ring, v: jax.Array) -> jax.Array:
  """A block's rows (or entries) as ``[tiles, block, ...]``, padded with zeros."""
  v = jnp.pad(v, [(0, ring.tiles * ring.block - ring.rows)] + [(0, 0)] * (v.ndim - 1))
  return v.reshape(ring.tiles, ring.block, *v.shape[1:])


def _untiled(ring: _Ring, v: jax.Array) -> jax.Array:
  return v.reshape(ring.tiles * ring.block, *v.shape[2:])[:ring.rows]


def _masked(ring: _Ring, t: jax.Array, v: jax.Array, fill: Any = 0) -> jax.Array:
  """``v``, a ``[rows, block]`` array of tile ``t``, with ``fill`` in its padded columns."""
  if ring.tiles * ring.block == ring.rows:
    return v
  valid = (t * ring.block + lax.broadcasted_iota(jnp.int32, (1, ring.block), 1)) < ring.rows
  return jnp.where(valid, v, fill)


def _diagonal(ring: _Ring, shape: tuple[int, int], owner: Any, i: jax.Array) -> jax.Array:
  """The positive pairs in tile ``i`` of ``owner``'s block: the diagonal of the own block."""
  rows = lax.broadcasted_iota(jnp.int32, shape, 0)
  cols = i * ring.block + lax.broadcasted_iota(jnp.int32, shape, 1)
  return (rows == cols) & (owner == ring.index())


def _logits(x: jax.Array, y_tile: jax.Array, inv_t: jax.Array) -> jax.Array:
  """``x @ y_tile.T / temperature``, accumulated in ``inv_t``'s dtype."""
  return jnp.matmul(x, y_tile.T, preferred_element_type=inv_t.dtype) * inv_t


def _product(a: jax.Array, b: jax.Array) -> jax.Array:
  """``a @ b`` accumulated in ``a``'s (float32 or wider) dtype."""
  return jnp.matmul(a, b.astype(a.dtype), preferred_element_type=a.dtype)


def _vary(ring: _Ring, *trees: Any) -> tuple[Any, ...]:
  """The trees' arrays typed varying over every axis any of them varies over (and the ring's)."""
  axes = set().union(*(_arrays.array_type(x).varying for x in jax.tree.leaves(trees)))
  if ring.axes is not None and axes:  # (types are checked: shard_map with check_vma)
    axes |= set(ring.axes)
  names = sorted(axes, key=str)
  return tuple(jax.tree.map(lambda x: _arrays.pcast_varying(x, names), t) for t in trees)


def _like(ct: jax.Array, primal: jax.Array) -> jax.Array:
  """A cotangent typed as its primal: summed over the devices the primal is the same on."""
  extra = _arrays.array_type(ct).varying - _arrays.array_type(primal).varying
  ct = lax.psum(ct, tuple(sorted(extra, key=str))) if extra else ct
  return _arrays.match_varying(ct, primal).astype(primal.dtype)


# ---------------------------------------------------------------------------- CLIP
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _clip(ring: _Ring, x: jax.Array, y: jax.Array, t: jax.Array) -> jax.Array:
  return _clip_fwd(ring, x, y, t)[0]


def _clip_fwd(ring: _Ring, x: jax.Array, y: jax.Array, t: jax.Array) -> tuple[jax.Array, Any]:
  primals = (x, y, t)
  x, y, t = _vary(ring, x, y, t)
  inv_t = 1 / t

  def tile(owner: Any, rows: Any, xs: tuple[Any, ...]) -> tuple[Any, Any]:
    y_tile, _, cols, i = xs
    s = _logits(x, y_tile, inv_t)
    return _online(rows, _masked(ring, i, s, -jnp.inf), 1), _online(cols, s, 0)

  def empty(*shape: int) -> tuple[jax.Array, jax.Array]:  # no term yet: max -inf, sum 0
    return tuple(_arrays.match_varying(jnp.full(shape, v, t.dtype), x) for v in (-jnp.inf, 0))

  rows, (y_held, _, cols) = _walk(ring, tile, empty(ring.rows),
                                  (_tiled(ring, y), None, empty(ring.tiles, ring.block)), 1)
  # Each row's and each held column's log-sum-exp.
  r, c = (m + jnp.log(total) for m, total in (rows, cols))
  diag = jnp.sum(x.astype(t.dtype) * y.astype(t.dtype)) * inv_t
  loss = ring.total(jnp.sum(r) + jnp.sum(_untiled(ring, c)) - 2 * diag)
  return loss / (2 * ring.rows * ring.devices), (primals, r, y_held, c)


def _online(stats: tuple[jax.Array, jax.Array], s: jax.Array, axis: int
            ) -> tuple[jax.Array, jax.Array]:
  """A log-sum-exp along ``axis`` as ``(max, sum of exp(s - max))``, with ``s``'s terms added.

  The sum's error stays relative to the sum, whatever the size of the max.
  """
  m, total = stats
  new = jnp.maximum(m, jnp.max(s, axis=axis))
  return new, total * jnp.exp(m - new) + jnp.sum(jnp.exp(s - jnp.expand_dims(new, axis)), axis)


def _clip_bwd(ring: _Ring, res: Any, g: jax.Array) -> tuple[jax.Array, ...]:
  primals, r, y_held, c_held = res
  x, y, t, r, y_held, c_held, g = _vary(ring, *primals, r, y_held, c_held, g)
  inv_t, scale = 1 / t, g / (2 * ring.rows * ring.devices)

  def tile_grad(s: jax.Array, c_tile: jax.Array, owner: Any, i: jax.Array) -> jax.Array:
    grad = jnp.exp(s - r[:, None]) + jnp.exp(s - c_tile) - 2 * _diagonal(ring, s.shape, owner, i)
    return _masked(ring, i, scale * grad)

  # ds: each row's sum of grad * s, for the temperature's gradient.
  dx, (ds,), dy = _pull_back(ring, x, y, inv_t, (y_held, c_held), tile_grad,
                             lambda grad, s: (grad * s,), 1)
  dt = -jnp.sum(ds) * inv_t  # sum_ij G_ij s_ij, with ds/dt = -s/t
  return tuple(_like(ct, p) for ct, p in zip((dx, dy, dt), primals, strict=True))


def _pull_back(ring: _Ring, x: jax.Array, y: jax.Array, inv_t: jax.Array, held: tuple[Any, Any],
               tile_grad: Any, row_terms: Any, n_terms: int
               ) -> tuple[jax.Array, tuple[jax.Array, ...], jax.Array]:
  """The backward walk both losses share: ``(dx, row sums, dy)``, ``dx`` and ``dy`` over ``t``.

  ``held``: the block of ``y``'s tiles the forward ended with, and its statistics per
  tile (or None). ``tile_grad(s, stats, owner, i)`` is tile ``i``'s gradient ``G`` with
  respect to its logits ``s``; each row sums the ``n_terms`` arrays ``row_terms(G, s)``
  over its tiles.
  """
  def zeros(*shape: int) -> jax.Array:
    return _arrays.match_varying(jnp.zeros(shape, inv_t.dtype), x)

  def tile(owner: Any, carry: tuple[jax.Array, Any], xs: tuple[Any, ...]) -> Any:
    (dx, sums), (y_tile, stats, dy_tile, i) = carry, xs
    s = _logits(x, y_tile, inv_t)
    grad = tile_grad(s, stats, owner, i)
    dx = dx + _product(grad, y_tile)
    sums = tuple(a + jnp.sum(v, 1) for a, v in zip(sums, row_terms(grad, s), strict=True))
    return (dx, sums), dy_tile + _product(grad.T, x)

  start = (zeros(*x.shape), (zeros(ring.rows),) * n_terms)
  (dx, sums), (_, _, dy) = _walk(ring, tile, start,
                                 (*held, zeros(ring.tiles, ring.block, y.shape[1])), -1)
  return dx * inv_t, sums, _untiled(ring, dy) * inv_t


_clip.defvjp(_clip_fwd, _clip_bwd)


# -------------------------------------------------------------------------- SigLIP
def _signed(ring: _Ring, s: jax.Array, owner: Any, i: jax.Array) -> jax.Array:
  """``-s`` on the positive pairs, ``s`` elsewhere."""
  return jnp.where(_diagonal(ring, s.shape, owner, i), -s, s)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _siglip(ring: _Ring, x: jax.Array, y: jax.Array, t: jax.Array, b: jax.Array) -> jax.Array:
  return _siglip_fwd(ring, x, y, t, b)[0]


def _siglip_fwd(ring: _Ring, x: jax.Array, y: jax.Array, t: jax.Array, b: jax.Array
                ) -> tuple[jax.Array, Any]:
  primals = (x, y, t, b)
  x, y, t, b = _vary(ring, x, y, t, b)
  inv_t = 1 / t

  def tile(owner: Any, total: jax.Array, xs: tuple[Any, ...]) -> tuple[jax.Array, None]:
    y_tile, _, _, i = xs
    z = _signed(ring, _logits(x, y_tile, inv_t) + b, owner, i)
    return total + jnp.sum(_masked(ring, i, jax.nn.softplus(z))), None

  total0 = _arrays.match_varying(jnp.zeros((), t.dtype), x)
  total, (y_held, _, _) = _walk(ring, tile, total0, (_tiled(ring, y), None, None), 1)
  return ring.total(total) / (ring.rows * ring.devices), (primals, y_held)


def _siglip_bwd(ring: _Ring, res: Any, g: jax.Array) -> tuple[jax.Array, ...]:
  primals, y_held = res
  x, y, t, b, y_held, g = _vary(ring, *primals, y_held, g)
  inv_t, scale = 1 / t, g / (ring.rows * ring.devices)

  def tile_grad(u: jax.Array, _: None, owner: Any, i: jax.Array) -> jax.Array:
    z = _signed(ring, u + b, owner, i)
    return _masked(ring, i, scale * _signed(ring, jax.nn.sigmoid(z), owner, i))

  # Per row: the bias's gradient, and grad * u for the temperature's.
  dx, (db, ds), dy = _pull_back(ring, x, y, inv_t, (y_held, None), tile_grad,
                                lambda grad, u: (grad, grad * u), 2)
  cts = (dx, dy, -jnp.sum(ds) * inv_t, jnp.sum(db))
  return tuple(_like(ct, p) for ct, p in zip(cts, primals, strict=True))


_siglip.defvjp(_siglip_fwd, _siglip_bwd)


# ------------------------------------------------------------------------ the calls
def _run(loss: Any, x: Any, y: Any, scalars: dict[str, Any], block_size: Any,
         axis_name: Any) -> jax.Array:
  """``loss(ring, x, y, *scalars)`` on this device's rows, or on each device's (a mesh).

  The inputs are checked first: ``x`` and ``y`` get one dtype, the scalars (by name)
  its accumulator dtype.
  """
  x, y = _check_pair(x, y)
  dtype = _arrays.accumulator_dtype(x.dtype)
  scalars = [_check_scalar(v, name, dtype) for name, v in scalars.items()]
  block_size = _check_block_size(block_size)
  with _arrays.mesh_context((x, y)):
    manual, mesh = _devices(axis_name, x, y)

    def local(axes: tuple[Any, ...] | None, x: jax.Array, y: jax.Array, *scalars: jax.Array
              ) -> jax.Array:
      ring = _Ring(axes, 1 if axes is None else lax.axis_size(axes), x.shape[0],
                   min(block_size or _BLOCK, x.shape[0]))
      return loss(ring, x, y, *scalars)

    if mesh is None:
      return local(manual, x, y, *scalars)
    return _per_device.run(functools.partial(local, mesh), (x, y, *scalars), (0, 1), mesh, P())


def _devices(axis_name: Any, x: Any, y: Any) -> tuple[tuple[Any, ...] | None, Any]:
  """``(manual axes, None)`` inside shard_map, ``(None, data axes)`` for plain jit on a
  mesh, ``(None, None)`` on one device."""
  split = _batch.leading_rows({"`x`": x, "`y`": y})[1]  # (both split alike, else raises)
  if axis_name is None:
    return None, split or None
  axes = _arrays.axis_names(axis_name)
  if _arrays.axis_kind(axis_name, caller="the loss") is None:  # manual axes
    if not all(set(axes) <= _arrays.array_type(v).varying for v in (x, y)):
      raise ValueError(
          f"`axis_name={axis_name!r}` is bound, but `x` and `y` are not typed as varying over"
          " it (`shard_map(..., check_vma=False)`, `pmap`): their gradients would miss the sum"
          " over the devices (1/n of the truth). Use `jax.shard_map` with `check_vma=True`"
          f" (its default) and `in_specs=P({axis_name!r})` for the rows, or plain `jit`.")
    return axes, None
  return None, _batch.data_axes(axis_name, split, (x, y), (0, 1))


def _check_pair(x: Any, y: Any) -> tuple[jax.Array, jax.Array]:
  """``x`` and ``y`` as arrays of one floating dtype, if both are ``[B, D]`` alike."""
  for name, v in (("x", x), ("y", y)):
    if jnp.ndim(v) != 2 or not jnp.issubdtype(jnp.result_type(v), jnp.floating):
      raise ValueError(
          f"`{name}` must be a floating [batch, dim] array of embeddings (row i of `x` pairs"
          f" with row i of `y`); got {jnp.result_type(v)}{list(jnp.shape(v))}. Stack several"
          " embeddings per example into rows, or reshape to [batch, dim].")
  if jnp.shape(x) != jnp.shape(y) or jnp.shape(x)[0] == 0:
    raise ValueError(
        f"`x` and `y` must have one shape [batch, dim], batch > 0: row i of each is one pair;"
        f" got x {list(jnp.shape(x))} and y {list(jnp.shape(y))}. Embed both towers into the"
        " same dim, and pass the same examples to both.")
  dtype = jnp.result_type(x, y)
  return jnp.asarray(x, dtype), jnp.asarray(y, dtype)


_HINTS = {
    "temperature": "Pass e.g. `jnp.exp(-logit_scale)` for a learned scalar, or 0.07.",
    "bias": "Pass a learned scalar, e.g. `params['bias']` (SigLIP starts it at -10).",
}


def _check_scalar(value: Any, name: str, dtype: Any) -> jax.Array:
  """``value`` as a scalar of ``dtype``, if it is a real scalar, else raises."""
  if jnp.ndim(value) != 0 or not jnp.issubdtype(jnp.result_type(value), jnp.number) or \
      jnp.issubdtype(jnp.result_type(value), jnp.complexfloating):
    raise ValueError(
        f"`{name}` must be a real scalar (the same for every pair); got"
        f" {jnp.result_type(value)}{list(jnp.shape(value))}. {_HINTS[name]}")
  return jnp.asarray(value, dtype)


def _check_block_size(block_size: Any) -> int | None:
  if block_size is None:
    return None
  not_int = not isinstance(block_size, (int, np.integer)) or isinstance(block_size, bool)
  if not_int or block_size < 1:
    raise (TypeError if not_int else ValueError)(
        f"`block_size` must be a positive int (the columns of one tile) or None for the"
        f" default; got {block_size!r}. Pass e.g. `block_size=512`.")
  return int(block_size)
