"""The NNX half of :mod:`optax_accum.flax`: :class:`Optimizer`.

Its own module because ``flax.nnx`` does not import on every Flax/JAX pairing
pip allows (Flax 0.12.9 and older with JAX 0.11.1 and newer), while the Linen
``TrainState`` works on all of them; :mod:`optax_accum.flax` imports this
module the first time ``Optimizer`` is used.
"""

from __future__ import annotations

from typing import Any

try:
  from flax import nnx
except Exception as e:  # an AttributeError from inside flax.nnx on a mismatched JAX
  import flax
  import jax

  raise ImportError(
      f"optax_accum.flax.Optimizer needs flax.nnx, which does not import with Flax"
      f" {flax.__version__} and JAX {jax.__version__} ({type(e).__name__}: {e}). With JAX"
      " 0.11.1 or newer install Flax 0.12.10 or newer: `pip install -U 'flax>=0.12.10'`."
  ) from e

from optax_accum import update_and_apply

__all__ = ["Optimizer"]


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
