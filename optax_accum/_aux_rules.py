"""How ``microbatched`` reduces each aux output over the micro-batches: the aux rules.

A rule is a small program over the micro-batches, ``c = init(shape); for i: c =
update(c, aux_i, i); return finalize(c)`` (:class:`AuxRule`). The built-in
rules (:data:`AUX_RULES`) are such programs too (:func:`resolve` writes them).
``aux_rules`` is one rule for the whole aux, or a pytree of rules that is a
prefix of its structure: :func:`resolve` matches it against the aux of one
micro-batch, once per call, into one program for the whole aux that the loop runs. Across devices
``mean``/``sum``/``max``/``min`` are reduced (:data:`CROSS_DEVICE`); under plain
jit on a mesh the others come back split like the batch (:func:`out_specs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from optax_accum import _arrays, _batch

AUX_RULES = ("mean", "sum", "max", "min", "last", "concat", "stack")
CROSS_DEVICE = {"mean": lax.pmean, "sum": lax.psum, "max": lax.pmax, "min": lax.pmin}


@dataclasses.dataclass(frozen=True)
class AuxRule:
  """A custom rule that reduces one aux output over the micro-batches.

  It runs the program ``c = init(shape); for i: c = update(c, aux_i, i);
  return finalize(c)``, where ``shape`` is the ``jax.ShapeDtypeStruct`` tree of
  one micro-batch's aux (the subtree at the rule's position in ``aux_rules``)
  and ``aux_i`` that subtree for micro-batch ``i``. The carry must be a pytree
  of arrays of fixed shapes. With ``axis_name``, a custom rule is not reduced
  across devices: do it in ``finalize`` if you need it.

  Attributes:
    init: ``shape_tree -> carry``.
    update: ``(carry, aux_i, i) -> carry``.
    finalize: ``carry -> output``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax_accum.microbatching import AuxRule, microbatched
    >>> first = AuxRule(
    ...     init=lambda s: jnp.zeros(s.shape, s.dtype),
    ...     update=lambda c, v, i: jnp.where(i == 0, v, c),
    ...     finalize=lambda c: c)
    >>> def loss(w, x):
    ...   return jnp.mean(w * x), jnp.max(x)
    >>> fn = jax.value_and_grad(loss, has_aux=True)
    >>> (l, aux), g = microbatched(fn, 2, has_aux=True, aux_rules=first)(
    ...     1.0, jnp.arange(4.0))
    >>> float(aux)  # the max of the first micro-batch, rows 0 and 2
    2.0
  """

  init: Callable[[Any], Any]
  update: Callable[[Any, Any, jax.Array], Any]
  finalize: Callable[[Any], Any]


def is_rule(x: Any) -> bool:
  return isinstance(x, (str, AuxRule))


def check(aux_rules: Any) -> Any:
  """``aux_rules`` if every rule in it is a built-in name or an :class:`AuxRule`, else raises."""
  for r in jax.tree.leaves(aux_rules, is_leaf=is_rule):
    if not is_rule(r) or (isinstance(r, str) and r not in AUX_RULES):
      raise ValueError(
          f"`aux_rules` holds {r!r}; each rule must be one of {AUX_RULES} or an"
          " `AuxRule(init, update, finalize)`. Pass one rule for the whole aux"
          " or a pytree of rules that is a prefix of the aux structure."
      )
  return aux_rules


def resolve(aux_rules: Any, aux_shapes: Any, loop: Any) -> AuxRule:
  """The program that reduces the whole aux: each rule's (a built-in one's own), side by side.

  ``aux_rules`` (None: no aux) is matched against ``aux_shapes``, one micro-batch's aux;
  ``loop`` is the loop's ``microbatching._Config``: a built-in rule reads its ``k``, ``split``,
  ``acc_dtype`` (the requested accumulator dtype, or None) and ``axis_name`` (the manual axes
  to reduce over, or None).
  """
  rules, shapes, where, treedef = _match(aux_rules, aux_shapes)
  programs = [_program(loop, *rule) for rule in zip(rules, shapes, where, strict=True)]
  return AuxRule(
      lambda _: [p.init(s) for p, s in zip(programs, shapes, strict=True)],
      lambda c, aux, i: [p.update(*pair, i) for p, *pair in zip(
          programs, c, treedef.flatten_up_to(aux), strict=True)],
      lambda c: treedef.unflatten([p.finalize(x) for p, x in zip(programs, c, strict=True)]))


def summed_rows(aux_rules: Any, aux_shapes: Any, rows: int) -> list[tuple[str, str]]:
  """Where ``"mean"`` or ``"sum"`` would add up an aux leaf whose leading axis has ``rows``
  entries (the micro-batch's examples, perhaps), and that rule."""
  rules, subtrees, where, _ = _match(aux_rules, aux_shapes)
  return [(w + jax.tree_util.keystr(p), r) for r, sub, w in zip(rules, subtrees, where, strict=True)
          if r in ("mean", "sum") for p, s in jax.tree_util.tree_flatten_with_path(sub)[0]
          if s.shape[:1] == (rows,)]


def _match(aux_rules: Any, aux_shapes: Any) -> tuple[list[Any], list[Any], list[str], Any]:
  """Each rule of the ``aux_rules`` prefix tree, the aux subtree under it, where it is (for
  messages); and the rules' structure."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(aux_rules, is_leaf=is_rule)
  try:
    subtrees = treedef.flatten_up_to(aux_shapes)
  except (ValueError, TypeError) as e:
    raise ValueError(
        "`aux_rules` must be one rule or a pytree of rules that is a prefix of"
        f" the aux returned by `fn`; rules have structure {treedef} but the aux"
        f" is {jax.tree.structure(aux_shapes)}. ({e})"
    ) from e
  where = ["aux" + jax.tree_util.keystr(p) for p, _ in leaves]
  return [r for _, r in leaves], subtrees, where, treedef


def _program(loop: Any, rule: str | AuxRule, shapes: Any, where: str) -> AuxRule:
  """What ``rule`` runs over the micro-batches: a built-in rule as an :class:`AuxRule`.

  Raises for ``"concat"`` of an aux leaf with no leading (per-example) dim.
  """
  if isinstance(rule, AuxRule):
    return rule
  scalars = [p for p, s in jax.tree_util.tree_flatten_with_path(shapes)[0] if not s.shape]
  if rule == "concat" and scalars:
    raise ValueError(
        "aux_rules='concat' needs per-example outputs with a leading batch dimension, but"
        f" the aux leaf at {where}{jax.tree_util.keystr(scalars[0])} has shape (). Use"
        " 'stack' to collect one value per micro-batch.")

  def update(c: jax.Array, v: Any, idx: jax.Array) -> jax.Array:  # one leaf
    v = jnp.asarray(v)  # a Python number too (a count the loss returns as an int)
    if rule in ("stack", "concat"):  # micro-batch idx's values, into a [k, ...] buffer
      return lax.dynamic_update_index_in_dim(c, v, idx, 0)
    if rule in ("max", "min"):
      return jnp.maximum(c, v) if rule == "max" else jnp.minimum(c, v)
    return v if rule == "last" else c + v.astype(c.dtype)

  def finalize(c: jax.Array, s: jax.ShapeDtypeStruct) -> Any:  # one leaf, reduced across devices
    if rule in ("stack", "concat"):  # concat: [k, m, ...] back to [k * m, ...] in batch order
      return c if rule == "stack" else _batch.unsplit(c, loop.split)
    if rule == "mean":
      c = c / loop.k
    if rule in CROSS_DEVICE and loop.axis_name is not None:
      c = CROSS_DEVICE[rule](c, loop.axis_name)
    return c if rule == "mean" and not jnp.issubdtype(s.dtype, jnp.inexact) else c.astype(s.dtype)

  return AuxRule(lambda shapes: jax.tree.map(lambda s: _leaf_init(loop, rule, s), shapes),
                 lambda carry, aux, idx: jax.tree.map(lambda c, v: update(c, v, idx), carry, aux),
                 lambda carry: jax.tree.map(finalize, carry, shapes))


def _leaf_init(loop: Any, rule: str, s: jax.ShapeDtypeStruct) -> jax.Array:
  """A built-in rule's state for one aux leaf before the first micro-batch."""
  if rule in ("stack", "concat"):
    spec = _arrays.array_type(s).explicit_spec
    return jnp.zeros((loop.k, *s.shape), s.dtype,
                     out_sharding=None if spec is None else P(None, *spec))
  if rule in ("mean", "sum"):
    return _arrays.filled(s, _arrays.sum_dtype(s.dtype, loop.acc_dtype, mean=rule == "mean"))
  if rule == "last":
    return _arrays.filled(s, s.dtype)
  # max, min: the reduction's identity (its value over no elements: -inf, the least int, False)
  reduce = lax.reduce_max if rule == "max" else lax.reduce_min
  return _arrays.filled(s, s.dtype, reduce(jnp.zeros((0,), s.dtype), (0,)))


def out_specs(aux_rules: Any, aux_shapes: Any, axes: tuple[Any, ...], rows: int) -> Any:
  """``shard_map`` out_specs of the aux: per rule, reduced (replicated) or split like the batch.

  ``rows``: the rows each device holds per micro-batch. Raises for a rule that
  keeps one value per device (a custom rule, or a built-in one of values that
  are not per example).
  """
  rules, subtrees, wheres, treedef = _match(aux_rules, aux_shapes)
  parts = []
  for rule, shapes, where in zip(rules, subtrees, wheres, strict=True):
    if isinstance(rule, str) and rule in CROSS_DEVICE:
      parts.append(P())
      continue
    bad = [where + jax.tree_util.keystr(p) for p, s in jax.tree_util.tree_flatten_with_path(
        shapes)[0] if rule != "concat" and (
            isinstance(rule, AuxRule) or not s.shape or s.shape[0] != rows)]
    if bad:
      raise ValueError(
          f"aux_rules={rule!r} at {bad[0]} keeps one value per device, and under plain"
          f" jit with the batch split over {axes} microbatched can only join per-example"
          f" values (a leading dim of the {rows} rows each device holds per"
          " micro-batch). Use 'mean', 'sum', 'max' or 'min' there, or call"
          " microbatched(..., axis_name=...) inside your own shard_map and choose"
          " its out_specs.")
    parts.append(P(*(None,) * (rule == "stack"), _arrays.spec_entry(axes)))
  return treedef.unflatten(parts)
