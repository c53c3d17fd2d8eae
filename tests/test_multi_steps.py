"""oa.MultiSteps is a drop-in for optax.MultiSteps.

The strongest check of "existing code runs unchanged" is optax's own test
suite: its MultiSteps tests are loaded from the installed optax and run with
``_accumulation.MultiSteps`` pointing at ours.
"""

from __future__ import annotations

import functools
import types
import unittest

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import optax_accum as oa
from tests._reference import (
    assert_trees_close,
    grad_fn,
    init_params,
    large_batch_run,
    make_batches,
)


def test_optax_own_multisteps_tests_pass_against_ours():
  upstream = pytest.importorskip("optax.transforms._accumulation_test")
  original = upstream._accumulation
  shim = types.SimpleNamespace(
      MultiSteps=oa.MultiSteps,
      skip_not_finite=optax.skip_not_finite,
      skip_large_updates=optax.skip_large_updates,
  )
  loader = unittest.TestLoader()
  names = [n for n in loader.getTestCaseNames(upstream.AccumulationTest) if "multi_steps" in n]
  assert len(names) >= 7, names
  suite = unittest.TestSuite(upstream.AccumulationTest(n) for n in names)
  upstream._accumulation = shim
  try:
    result = unittest.TextTestRunner(verbosity=0).run(suite)
  finally:
    upstream._accumulation = original
  assert result.testsRun == len(names)
  problems = result.failures + result.errors
  assert not problems, "\n".join(f"{t}: {tb}" for t, tb in problems)


def test_state_fields_and_methods_match_optax():
  ms = oa.MultiSteps(optax.adam(1e-3), 2)
  assert type(ms.init({"w": jnp.zeros(2)})) is optax.MultiStepsState
  for name in ("init", "update", "has_updated", "gradient_transformation", "inner_opt"):
    assert hasattr(ms, name)
  init, update = ms.gradient_transformation()
  assert callable(init) and callable(update)


@pytest.mark.parametrize("use_grad_mean", [True, False])
def test_equals_large_batch_and_optax(use_grad_mean):
  params = init_params(jax.random.key(0))
  batches = make_batches(jax.random.key(1), 8)
  ours, theirs = (cls(optax.adam(1e-2), 4, use_grad_mean=use_grad_mean)
                  for cls in (oa.MultiSteps, optax.MultiSteps))
  s_ours, s_theirs = ours.init(params), theirs.init(params)
  update_ours, update_theirs = jax.jit(ours.update), jax.jit(theirs.update)  # traced once each
  p_ours = p_theirs = params
  for b in batches:
    u, s_ours = update_ours(grad_fn(p_ours, b), s_ours, p_ours)
    p_ours = optax.apply_updates(p_ours, u)
    u, s_theirs = update_theirs(grad_fn(p_theirs, b), s_theirs, p_theirs)
    p_theirs = optax.apply_updates(p_theirs, u)
  assert_trees_close(p_ours, p_theirs)
  assert int(s_ours.gradient_step) == 2


def test_inner_optimizer_skipped_on_mid_steps():
  ms = oa.MultiSteps(optax.adam(1e-2), 4)
  params = {"w": jnp.ones(3)}
  state = ms.init(params)
  for _ in range(3):
    _, state = ms.update({"w": jnp.ones(3)}, state, params)
  chex.assert_trees_all_equal(state.inner_opt_state, ms.init(params).inner_opt_state)


def test_flush_closes_a_partial_window_and_has_updated_reads_the_state():
  """``oa.flush`` on a MultiSteps: the 3 micro-batches of a window of 5 take the large
  batch's step on those 3 (SGD: a wrong divisor shows). ``oa.has_updated`` reads a
  MultiStepsState as ``MultiSteps.has_updated`` does, optax's own included."""
  params = init_params(jax.random.key(21))
  batches = make_batches(jax.random.key(22), 3)
  ms = oa.MultiSteps(optax.sgd(0.5), 5)
  state = ms.init(params)
  theirs = optax.MultiSteps(optax.sgd(0.5), 5).init(params)
  assert not bool(oa.has_updated(state)) and not bool(oa.has_updated(theirs))
  for b in batches:
    _, state = jax.jit(ms.update)(grad_fn(params, b), state, params)
    assert not bool(oa.has_updated(state)) and not bool(ms.has_updated(state))
  updates, state = jax.jit(functools.partial(oa.flush, ms))(state, params)
  assert bool(oa.has_updated(state)) and bool(ms.has_updated(state))
  assert (int(state.mini_step), int(state.gradient_step)) == (0, 1)
  ref = large_batch_run(optax.sgd(0.5), params, [batches])[0]
  assert_trees_close(optax.apply_updates(params, updates), ref)


@pytest.mark.parametrize("skip", [jnp.float32(1.0), jnp.array([True, False])])
def test_a_skip_function_returning_no_boolean_scalar_is_an_error(skip):
  ms = oa.MultiSteps(optax.sgd(1.0), 2, should_skip_update_fn=lambda u, step, p: (skip, {}))
  params = {"w": jnp.zeros(2)}
  with pytest.raises(ValueError, match="`should_skip_update_fn` must return a boolean scalar"):
    ms.update({"w": jnp.ones(2)}, ms.init(params), params)

def test_skip_large_updates_and_nan_safety():
  skip = functools.partial(optax.skip_large_updates, max_squared_norm=50.0)
  ms = oa.MultiSteps(optax.sgd(1.0), 2, should_skip_update_fn=skip)
  params = {"w": jnp.zeros(2)}
  state = ms.init(params)
  _, state = ms.update({"w": jnp.full(2, 100.0)}, state, params)  # rejected
  assert int(state.mini_step) == 0 and bool(state.skip_state["should_skip"])
  _, state = ms.update({"w": jnp.ones(2)}, state, params)
  u, state = ms.update({"w": jnp.full(2, 3.0)}, state, params)
  chex.assert_trees_all_close(u, {"w": jnp.full(2, -2.0)})
  # Without a skip function, a NaN window does not poison the next one.
  ms = oa.MultiSteps(optax.sgd(1.0), 1)
  state = ms.init(params)
  u, state = ms.update({"w": jnp.array([jnp.nan, 1.0])}, state, params)
  u, state = ms.update({"w": jnp.ones(2)}, state, params)
  chex.assert_trees_all_close(u, {"w": -jnp.ones(2)})


def test_bad_every_k_schedule():
  with pytest.raises(ValueError, match="every_k_schedule"):
    oa.MultiSteps(optax.sgd(0.1), 0)
  with pytest.raises(TypeError, match="every_k_schedule"):
    oa.MultiSteps(optax.sgd(0.1), 2.5)
  # optax.MultiSteps accepts an integral float; so does the drop-in.
  assert int(oa.MultiSteps(optax.sgd(0.1), 2.0).init({"a": jnp.zeros(1)}).mini_step) == 0
