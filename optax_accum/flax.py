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
never imports Flax.
"""

from __future__ import annotations

from typing import Any

try:
  from flax import nnx
  from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
  from flax.training import train_state
except ImportError as e:
  raise ImportError(
      f"optax_accum.flax needs Flax ({e}). Install it with"
      " `pip install 'optax_accum[flax]'`."
  ) from e

from optax_accum import update_and_apply

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


class Optimizer(nnx.Optimizer):
  """An NNX ``Optimizer`` whose ``update`` takes the fast path.

  Construct it as the base class (``Optimizer(model, tx, wrt=nnx.Param)``)
  and call ``update(model, grads)`` once per micro-batch. The model and
  ``opt_state`` end up as with the base class for every ``tx``; with an
  accumulating ``tx`` a mid-step leaves the parameters untouched instead of
  rewriting them (``params + 0``).

  ``step`` counts ``update`` calls, i.e. micro-batches, as in the base class.
  The optimizer steps are ``opt_state.gradient_step`` (for ``accumulate`` and
  ``MultiSteps``); ``optax_accum.has_updated(nnx.as_pure(optimizer.opt_state))``
  says whether the last call closed a window.

  Unlike the base class, ``update`` returns ``None``: the updates tree is
  never built (that is the saving). Use ``flax.nnx.Optimizer`` if you need it.

  Example:
    >>> import jax.numpy as jnp, optax, optax_accum as oa
    >>> from flax import nnx
    >>> from optax_accum.flax import Optimizer
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> optimizer = Optimizer(model, oa.accumulate(2, optax.sgd(0.1)), wrt=nnx.Param)
    >>> loss_fn = lambda model, x: jnp.mean(model(x) ** 2)
    >>> @nnx.jit
    ... def train_step(model, optimizer, x):
    ...   optimizer.update(model, nnx.grad(loss_fn)(model, x))
    >>> before = model.kernel[...]
    >>> train_step(model, optimizer, jnp.ones((4, 2)))   # mid-window: unchanged
    >>> bool(jnp.all(model.kernel[...] == before))
    True
    >>> train_step(model, optimizer, jnp.ones((4, 2)))   # window closed
    >>> int(optimizer.step[...]), int(optimizer.opt_state.gradient_step[...])
    (2, 1)
  """

  def update(self, model: Any, grads: Any, /, **kwargs: Any) -> None:  # type: ignore[override]
    """Updates the model's ``wrt`` variables, ``opt_state`` and ``step`` from ``grads``.

    Args:
      model: the NNX module the optimizer was built for.
      grads: the gradients from ``nnx.grad`` (filtered by ``wrt``).
      **kwargs: passed to ``tx`` through ``update_and_apply``: ``weight=``
        (with ``accumulate(..., reduction="weighted")``), ``emit_now=`` and
        extra args for the inner optimizer.
    """
    param_arrays = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
    grad_arrays = nnx.as_pure(nnx.state(grads, self.wrt, graph=self.graph))
    opt_state_arrays = nnx.as_pure(self.opt_state)
    kwargs_arrays = nnx.as_pure(kwargs)

    new_params, new_opt_state = update_and_apply(
        self.tx, grad_arrays, opt_state_arrays, param_arrays, **kwargs_arrays)

    nnx.update(model, new_params)
    nnx.update(self.opt_state, nnx.state(new_opt_state, graph=self.graph))
    self.step[...] += 1
