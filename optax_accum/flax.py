"""Flax train states that apply accumulated updates on the fast path.

:class:`TrainState` (Linen) and :class:`Optimizer` (NNX) are drop-in
subclasses of ``flax.training.train_state.TrainState`` and ``flax.nnx.Optimizer``
whose update calls :func:`optax_accum.update_and_apply` instead of
``tx.update`` followed by ``optax.apply_updates``. With an accumulating ``tx``
(``accumulate``, ``MultiSteps``, a chain ending in ``accumulate``,
``per_device_state``) a mid-step then leaves the params untouched instead of
rewriting them (``params + 0``, 3 parameter-sized passes); with any other
``tx`` the result is the base class's. Both forward ``weight=`` and ``emit_now=`` to the transform.

Needs Flax: ``pip install 'optax_accum[flax]'``. ``import optax_accum`` alone
never imports Flax, and ``TrainState`` never imports ``flax.nnx``: NNX is
imported on the first use of ``Optimizer``, so a Linen user keeps
``TrainState`` on a Flax/JAX pairing whose NNX does not import (Flax older
than 0.12.10 with JAX 0.11.1 or newer).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

try:
  from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
  from flax.training import train_state
except ImportError as e:
  raise ImportError(
      f"optax_accum.flax needs Flax ({e}). Install it with"
      " `pip install 'optax_accum[flax]'`."
  ) from e

from optax_accum import update_and_apply

if TYPE_CHECKING:
  from optax_accum._flax_nnx import Optimizer

__all__ = ["Optimizer", "TrainState"]


class TrainState(train_state.TrainState):
  """A Linen ``TrainState`` whose ``apply_gradients`` takes the fast path.

  Create it as the base class (``TrainState.create(apply_fn=..., params=...,
  tx=...)``) and call ``apply_gradients`` once per micro-batch. The result
  equals the base class's for every ``tx``; with an accumulating ``tx`` a
  mid-step costs only the buffer update, because the params pass through the
  window's ``lax.cond`` untouched (jit the step with the state donated:
  ``jax.jit(train_step, donate_argnums=0)``).

  ``step`` counts ``apply_gradients`` calls, i.e. micro-batches, as in the
  base class. The optimizer steps are ``opt_state.gradient_step`` (for
  ``accumulate`` and ``MultiSteps``); ``optax_accum.has_updated(state.opt_state)``
  says whether the last call closed a window.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_accum as oa
    >>> import flax.linen as nn
    >>> from optax_accum.flax import TrainState
    >>> model = nn.Dense(1)
    >>> params = model.init(jax.random.key(0), jnp.ones((1, 2)))["params"]
    >>> state = TrainState.create(apply_fn=model.apply, params=params,
    ...                           tx=oa.accumulate(2, optax.sgd(0.1)))
    >>> def loss_fn(params, x):
    ...   return jnp.mean(model.apply({"params": params}, x) ** 2)
    >>> @jax.jit
    ... def train_step(state, x):
    ...   return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, x))
    >>> new = train_step(state, jnp.ones((4, 2)))   # mid-window: params unchanged
    >>> bool(jnp.all(new.params["kernel"] == state.params["kernel"]))
    True
    >>> new = train_step(new, jnp.ones((4, 2)))     # window closed: one SGD step
    >>> int(new.step), int(new.opt_state.gradient_step), bool(oa.has_updated(new.opt_state))
    (2, 1, True)
  """

  def apply_gradients(
      self, *, grads: Any, weight: Any = None, emit_now: Any = False, **kwargs: Any
  ) -> TrainState:
    """Updates ``step``, ``params``, ``opt_state`` and ``**kwargs``, like the base class.

    Args:
      grads: gradients with the structure of ``params`` (a tree holding Flax's
        ``_overwrite_with_gradient`` collection is handled as in the base
        class: those entries are copied from ``grads``, the rest is optimised).
      weight: this micro-batch's weight, for ``accumulate(...,
        reduction="weighted")`` (e.g. its count of real tokens). Only passed
        on when given.
      emit_now: close the window after this micro-batch (a Python or traced
        bool), e.g. on the last batch of an epoch. Only passed on when not
        ``False``.
      **kwargs: other dataclass attributes to ``.replace()``, as in the base
        class (so a subclass cannot use ``weight`` or ``emit_now`` as field
        names here).

    Returns:
      A new state with ``step`` incremented by one (every call counts, mid-steps
      included), ``params`` and ``opt_state`` updated, and ``kwargs`` replaced.
    """
    # Only the keywords given: a transform without ``weight`` never sees one.
    tx_kwargs = {} if weight is None else {"weight": weight}
    if emit_now is not False:
      tx_kwargs["emit_now"] = emit_now
    owg = OVERWRITE_WITH_GRADIENT in grads
    new_params, new_opt_state = update_and_apply(
        self.tx, grads["params"] if owg else grads, self.opt_state,
        self.params["params"] if owg else self.params, **tx_kwargs)
    if owg:
      new_params = {"params": new_params, OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]}
    return self.replace(
        step=self.step + 1,
        params=new_params,
        opt_state=new_opt_state,
        **kwargs,
    )


def __getattr__(name: str) -> Any:
  # ``Optimizer`` subclasses ``flax.nnx.Optimizer``: defined on first use, so that
  # importing this module (for ``TrainState``) does not import ``flax.nnx``.
  if name == "Optimizer":
    return importlib.import_module("optax_accum._flax_nnx").Optimizer
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
