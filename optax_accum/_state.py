"""The per-device fields of an accumulation state: the one list, and the walks over it.

Each device accumulates its own partial sums of the open window (under
``shard_map``, ``pmap``, and plain jit with ``axis_name``): :data:`STATE` names
the fields that hold them, and everything that lays a state out per device
(``init``, ``per_device_state``, ``shard_map_specs``, ``reshard_state``, the
checks) reads it through :func:`map_state` and :func:`leaves`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

STATE = ("acc_grads", "acc_weight", "noise_stats.window_sq_norms", "noise_stats.window_count",
         "global_stats.running")


def map_state(fn: Callable[[Any], Any], state: Any, *, skip: tuple[str, ...] = ()) -> Any:
  """``state`` with ``fn`` applied to every leaf of its per-device fields (:data:`STATE`).

  ``state`` is a NamedTuple with such fields (``_window.Window``,
  ``AccumulateState``, ``optax.MultiStepsState``); those it lacks, or holds as
  ``()`` (no noise estimate), and those in ``skip`` are passed over.
  """
  for name in STATE:
    head, _, field = name.partition(".")
    node = getattr(state, head, None)
    if name in skip or node is None or (field and not hasattr(node, field)):
      continue
    new = jax.tree.map(fn, getattr(node, field) if field else node)
    state = state._replace(**{head: node._replace(**{field: new}) if field else new})
  return state


class _Marked:
  """A marker leaf: a per-device leaf of a state, found with its key path."""

  def __init__(self, leaf: Any):
    self.leaf = leaf


def leaves(state: Any, *, skip: tuple[str, ...] = (),
           walk: Callable[..., Any] = map_state) -> list[tuple[Any, Any]]:
  """``[(key path, leaf)]`` of the per-device leaves of ``state``.

  Those :func:`map_state` maps, or ``walk(fn, state, skip=skip)`` (a walk
  over a tree that holds states, ``sharding``'s).
  """
  marked = jax.tree_util.tree_flatten_with_path(walk(_Marked, state, skip=skip))[0]
  return [(path, x.leaf) for path, x in marked if isinstance(x, _Marked)]
