"""The gradients of the check, read on the host a leaf at a time (``debug.check_large_batch``).

A gradient stays where ``fn`` left it; the host reads one leaf at a time, as a flat
float64 vector. Of the micro-batches' gradients the check keeps their float64
combination and a CountSketch of each (a linear map to 1024 entries whatever the model's
size), on which the weights that would combine them into the whole batch's are fitted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Grads(NamedTuple):
  """One call's gradient: its differentiable leaves where ``fn`` left them, and their paths.

  The host sees one leaf at a time (:meth:`host`), as a flat float64 vector: the check
  keeps no gradient on the host but the float64 combination of the micro-batches'.
  """

  leaves: list[Any]
  paths: list[tuple[str, tuple[int, ...]]]  # (path in the gradient tree, shape)
  den: float  # "weighted"'s denominator (the gradient is over it); 1 otherwise
  what: str

  @classmethod
  def of(cls, tree: Any, what: str, den: Any = None) -> Grads:
    found = [(path, g) for path, g in jax.tree_util.tree_flatten_with_path(tree)[0]
             if jnp.issubdtype(jnp.result_type(g), jnp.inexact)]  # float0: no gradient
    return cls([g for _, g in found],
               [(jax.tree_util.keystr(p), tuple(np.shape(g))) for p, g in found],
               1.0 if den is None else float(den), what)

  def host(self, n: int) -> np.ndarray:
    """Leaf ``n`` on the host (a complex one as its real and imaginary parts)."""
    x = numpy_copy(self.leaves[n])
    x = (np.array(x, np.complex128).reshape(-1).view(np.float64)  # a copy, written to below
         if np.iscomplexobj(x) else np.array(x, np.float64).reshape(-1))
    if not np.isfinite(x).all():
      raise ValueError(
          f"The gradient of {self.what} holds NaN or Inf at {self.paths[n][0]}: no comparison"
          " can mean anything. Check the loss on these arguments first (jax.debug_nans).")
    if self.den != 1.0:
      x *= 1.0 / self.den if self.den else 0.0
    return x

  def distance(self, other: Grads) -> np.ndarray:
    """Each leaf's norm of ``self - other``."""
    out = []
    for n in range(len(self.leaves)):
      x = self.host(n)
      x -= other.host(n)
      out.append(np.linalg.norm(x))
    return np.array(out)


SKETCH_ROWS = 1024  # CountSketch rows: the weights' least squares, at any size
_CHUNK = 1 << 16  # entries at a time: the temporaries stay a few MB on any model


def numpy_copy(x: Any) -> np.ndarray:
  """``x`` in numpy, read from a fresh copy: ``np.asarray`` of an array it cannot read in
  place (an accelerator's, one laid out over devices) keeps its copy cached on the array for
  the array's life, and the check would hold whole gradients (on a TPU: +8 B/entry). The copy
  is a transfer, no program: ``jnp.copy`` compiled one per leaf shape (18 for the decoder of
  ``bench_large_batch.py --decoder``)."""
  if not isinstance(x, jax.Array) or not x.is_fully_addressable:
    return np.asarray(x)  # (another process's shards: numpy's own rules, and its errors)
  return np.asarray(jax.device_put(x, may_alias=False))


def sketch_leaf(n: int, x: np.ndarray, out: np.ndarray) -> None:
  """Adds leaf ``n``'s share of a gradient's CountSketch to ``out``: each entry, with a random
  sign, added to a random row.

  Linear, so an exact combination of the micro-batch gradients stays exact in it.
  """
  for start in range(0, x.size, _CHUNK):
    rng = np.random.default_rng((n, start))  # the same hash for every call
    part = x[start:start + _CHUNK]
    rows = rng.integers(0, SKETCH_ROWS, part.size, dtype=np.int32)
    signs = rng.integers(0, 2, part.size, dtype=np.int8) * 2 - 1
    out += np.bincount(rows, part * signs, minlength=SKETCH_ROWS)


class Stats(NamedTuple):
  """What the check keeps of the micro-batch gradients: their float64 combination, sketched.

  ``combined`` is ``C = sum c_i g_i`` leaf by leaf, ``weights`` the ``c_i``: how
  ``microbatched`` combines the micro-batch gradients (``1/k``, 1, or each micro-batch's
  share of the denominators); ``sizes`` the ``sum c_i |g_i|`` of each leaf, the size of
  the terms ``C`` sums (larger than ``C``'s where they cancel); one sketch per micro-batch.
  """

  combined: list[np.ndarray]
  weights: np.ndarray
  sizes: np.ndarray
  sketches: np.ndarray  # [k, SKETCH_ROWS]

  @classmethod
  def of(cls, whole: Grads, micro: Iterator[Grads], normalize: str, k: int) -> Stats:
    combined = [np.zeros(np.size(g) * (2 if jnp.iscomplexobj(g) else 1)) for g in whole.leaves]
    weights, sketches = np.zeros(k), np.zeros((k, SKETCH_ROWS))
    sizes = np.zeros(len(combined))
    for j, g in enumerate(micro):
      weights[j] = g.den if normalize == "weighted" else (1.0 / k if normalize == "mean" else 1.0)
      for n, total in enumerate(combined):
        x = g.host(n)
        sketch_leaf(n, x, sketches[j])
        x *= weights[j]
        total += x
        sizes[n] += np.linalg.norm(x)
    if normalize == "weighted":  # over the sum of the denominators
      norm = float(weights.sum()) or 1.0  # no weight at all: C is 0
      for total in combined:
        total /= norm
      weights /= norm
      sizes /= norm
    return cls(combined, weights, sizes, sketches)
