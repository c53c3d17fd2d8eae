"""Property tests: random pytrees, k, reductions, dtypes and optimizers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_accum as oa
from tests._reference import mean_tree

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
# Relative tolerance of the emitted update against the float64 reference: the
# reduced gradient is rounded once to the gradients' dtype.
RTOL = {"f32": 1e-5, "bf16": 2e-2, "f16": 4e-3}

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.5),
    "momentum": lambda: optax.sgd(0.5, momentum=0.9),
    "adam": lambda: optax.adam(0.1),
    "rmsprop": lambda: optax.rmsprop(0.1),
}


@st.composite
def pytrees(draw):
  """A random dict-of-lists pytree of small array shapes."""
  n_leaves = draw(st.integers(1, 4))
  shapes = [tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=3)))
            for _ in range(n_leaves)]
  nested = draw(st.booleans())
  if nested:
    return {"a": shapes[:1], "b": {f"x{i}": s for i, s in enumerate(shapes[1:])}}
  return {f"p{i}": s for i, s in enumerate(shapes)}


def _materialise(shape_tree, seed, dtype, scale=1.0):
  """Normal draws + 0.1 in ``dtype``, drawn and cast by numpy and placed by ``device_put``:
  ``jax.random``, ``astype`` and ``jnp.asarray`` each compile a program per shape and dtype
  (XLA:CPU's compiles are most of this file's time)."""
  leaves, treedef = jax.tree.flatten(shape_tree, is_leaf=lambda x: isinstance(x, tuple))
  rng = np.random.default_rng(seed)
  arrays = [jax.device_put((rng.normal(size=s) * scale + 0.1).astype(np.float32).astype(dtype))
            for s in leaves]
  return jax.tree.unflatten(treedef, arrays)


def _ref_update(opt_name, reduced64, params, grads_dtype_tree):
  """The inner optimizer on the float64 reduced gradient, rounded once to the
  wider of the gradient's and the param's dtype (the documented contract)."""
  reduced = jax.tree.map(lambda r, g, p: jax.device_put(np.asarray(r, np.float64).astype(
      jnp.promote_types(g.dtype, p.dtype))), reduced64, grads_dtype_tree, params)
  opt = OPTIMIZERS[opt_name]()
  # One program (as the accumulated update is), not an eager compile per op and shape.
  return jax.jit(lambda r, p: opt.update(r, opt.init(p), p)[0])(reduced, params)


# Every example compiles its own update (a new pytree, dtypes, optimizer): the examples
# are few, each draws every axis at once.
@settings(max_examples=12, deadline=None)
@given(
    shape_tree=pytrees(),
    k=st.integers(1, 4),
    reduction=st.sampled_from(["mean", "sum", "weighted"]),
    grad_dtype=st.sampled_from(sorted(DTYPES)),
    param_dtype=st.sampled_from(sorted(DTYPES)),
    opt_name=st.sampled_from(sorted(OPTIMIZERS)),
    seed=st.integers(0, 2**16),
)
def test_emitted_update_equals_reference(
    shape_tree, k, reduction, grad_dtype, param_dtype, opt_name, seed):
  params = _materialise(shape_tree, (seed, 0), DTYPES[param_dtype])
  grads = [_materialise(shape_tree, (seed, i + 1), DTYPES[grad_dtype]) for i in range(k)]
  weights = [float(w) for w in np.random.default_rng(seed).integers(1, 50, size=k)]
  tx = oa.accumulate(k, OPTIMIZERS[opt_name](), reduction=reduction)
  state = jax.jit(tx.init)(params)
  update = jax.jit(tx.update)
  for i, g in enumerate(grads):
    kwargs = {"weight": weights[i]} if reduction == "weighted" else {}
    updates, state = update(g, state, params, **kwargs)
  assert bool(oa.has_updated(state))

  if reduction == "mean":
    reduced64 = mean_tree(grads)
  elif reduction == "sum":
    reduced64 = jax.tree.map(lambda m: m * k, mean_tree(grads))
  else:
    reduced64 = mean_tree(grads, weights)
  expected = _ref_update(opt_name, reduced64, params, grads[0])
  rtol = max(RTOL[grad_dtype], RTOL[param_dtype])
  jax.tree.map(
      lambda u, e: np.testing.assert_allclose(
          np.asarray(u, np.float64), np.asarray(e, np.float64), rtol=rtol, atol=rtol),
      updates, expected)
  # Dtypes: the update is what the inner optimizer returns for that gradient.
  jax.tree.map(lambda u, e: np.testing.assert_equal(u.dtype, e.dtype), updates, expected)


@settings(max_examples=8, deadline=None)
@given(
    shape_tree=pytrees(),
    k=st.integers(1, 3),
    grad_dtype=st.sampled_from(sorted(DTYPES)),
    param_dtype=st.sampled_from(sorted(DTYPES)),
    acc_dtype=st.sampled_from(["f32", "bf16", None]),
    seed=st.integers(0, 2**16),
)
def test_dtypes_never_drift_inside_scan(shape_tree, k, grad_dtype, param_dtype, acc_dtype, seed):
  params = _materialise(shape_tree, seed, DTYPES[param_dtype])
  tx = oa.accumulate(k, optax.adam(1e-3),
                     accumulator_dtype=None if acc_dtype is None else DTYPES[acc_dtype])
  state0 = jax.jit(tx.init)(params)

  def body(carry, i):
    p, s = carry
    g = jax.tree.map(lambda x: (x * i).astype(DTYPES[grad_dtype]), p)
    u, s = tx.update(g, s, p)
    return (optax.apply_updates(p, u), s), None

  # lax.scan itself fails if any carried dtype changes; check them anyway.
  (p, state), _ = jax.lax.scan(body, (params, state0), jnp.arange(2 * k + 1, dtype=jnp.float32))
  jax.tree.map(lambda a, b: np.testing.assert_equal(a.dtype, b.dtype), state, state0)
  jax.tree.map(lambda a, b: np.testing.assert_equal(a.dtype, b.dtype), p, params)
  # None: never narrower than the params' dtype, and at least float32.
  expected_acc = (jnp.promote_types(DTYPES[param_dtype], jnp.float32) if acc_dtype is None
                  else DTYPES[acc_dtype])
  assert all(x.dtype == expected_acc for x in jax.tree.leaves(state.acc_grads))


def test_bf16_gradients_in_f32_buffer_stay_within_bf16_rounding():
  """64 bf16 micro-batches: the f32 buffer keeps the mean; a bf16 buffer
  (unbiased, tests/test_narrow_buffer.py) carries a rounding error per add."""
  n = 64
  key = jax.random.key(0)
  grads = [
      {"w": (jax.random.normal(jax.random.fold_in(key, i), (4096,)) + 3.0).astype(jnp.bfloat16)}
      for i in range(n)]
  wide = np.stack([np.asarray(g["w"], np.float64) for g in grads])
  exact = np.mean(wide, axis=0)
  exact_open = np.mean(wide[:-1], axis=0)  # the window before its last micro-batch

  def emitted(acc_dtype):
    tx = oa.accumulate(n, None, accumulator_dtype=acc_dtype)
    params = {"w": jnp.zeros(4096, jnp.bfloat16)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for g in grads[:-1]:
      u, state = update(g, state, params)
    # The buffer holds the sum of the open window (the closing micro-batch is
    # summed on the fly by the emitting step, never written).
    buffer_mean = np.asarray(state.acc_grads["w"], np.float64) / (n - 1)
    u, state = update(grads[-1], state, params)
    assert u["w"].dtype == jnp.bfloat16
    return np.asarray(u["w"], np.float64), buffer_mean

  out_f32, buf_f32 = emitted(jnp.float32)
  out_bf16, buf_bf16 = emitted(jnp.bfloat16)
  rel = lambda x, ref=exact: np.abs(x - ref) / np.abs(ref)
  bf16_half_ulp = 2.0 ** -8  # rounding the exact mean once to bf16
  # f32 buffer: the emitted bf16 mean is the exact mean rounded once.
  assert rel(out_f32).max() <= bf16_half_ulp
  assert rel(buf_f32, exact_open).max() <= 1e-6
  # bf16 buffer: the sum itself is off by orders of magnitude more.
  assert rel(buf_bf16, exact_open).max() > 1e-3 > 1e3 * rel(buf_f32, exact_open).max()
  assert rel(out_bf16).max() > bf16_half_ulp
  print(f"buffer max rel err: f32 {rel(buf_f32, exact_open).max():.1e},"
        f" bf16 {rel(buf_bf16, exact_open).max():.1e};"
        f" emitted: f32 {rel(out_f32).max():.1e}, bf16 {rel(out_bf16).max():.1e}")
