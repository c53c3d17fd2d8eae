"""The float64 shadow (``optax_accum._float64``) against numpy's float64, op by op.

Each program computes in a narrow dtype on purpose (bfloat16 sums, a bfloat16
scatter-add, float16 loops, an fp8 round trip); its float64 evaluation must
equal the same arithmetic done by numpy in float64 on the same inputs, which
the narrow program itself misses by its rounding. Random bits stay the
program's own, and what cannot be widened is refused with its line.
"""

from __future__ import annotations

import jax
import jax.experimental
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from optax_accum import _float64

_rng = np.random.default_rng(0)
X = jnp.asarray(_rng.normal(size=(64, 8)), jnp.float32)
W = jnp.asarray(_rng.normal(size=(8, 4)), jnp.float32)
BF16 = jnp.bfloat16


def in_float64(fn, *args):
  outs = _float64.evaluate(jax.make_jaxpr(fn)(*args))(*args)
  assert all(o.dtype in (np.float64, np.complex128) or not jnp.issubdtype(o.dtype, jnp.inexact)
             for o in outs)
  return [np.asarray(o) for o in outs]


def f64(x):
  return np.asarray(x, np.float64)


def test_narrow_sums_dots_and_casts_are_float64():
  def fn(x, w):
    h = jnp.dot(x.astype(BF16), w.astype(BF16), preferred_element_type=BF16)
    s = jnp.sum(jnp.tanh(h), dtype=BF16)
    r = jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)  # bfloat16: widened
    return s, jnp.sum(r), jnp.arange(4, dtype=jnp.float16) / 3
  s, r, a = in_float64(fn, X, W)
  np.testing.assert_allclose(s, np.tanh(f64(X) @ f64(W)).sum(), rtol=1e-13)
  np.testing.assert_allclose(r, f64(X).sum(), rtol=1e-13)
  np.testing.assert_allclose(a, np.arange(4) / 3, rtol=1e-15)
  assert abs(float(fn(X, W)[0]) - s) > 1e-3 * abs(s)  # what bfloat16 itself gives


def test_an_fp8_cast_is_a_quantisation_and_the_rest_float64():
  """``x / s`` rounded to float8_e4m3fn (numpy's ml_dtypes rounds the reference), then
  multiplied back and summed in float64; a float16 round trip is widened away."""
  s = jnp.max(jnp.abs(X)) / 448

  def fn(x):
    q = (x / s).astype(jnp.float8_e4m3fn).astype(BF16) * s
    return jnp.sum(q), jnp.sum(x.astype(jnp.float16).astype(jnp.float32))

  q, h = in_float64(fn, X)
  grid = (np.asarray(X) / np.float32(s)).astype(jnp.float8_e4m3fn).astype(np.float64)
  np.testing.assert_allclose(q, (grid * f64(s)).sum(), rtol=1e-13)
  assert abs(q - f64(X).sum()) > 1e-3 * np.abs(f64(X)).sum()  # fp8's grid, not widened away
  np.testing.assert_allclose(h, f64(X).sum(), rtol=1e-13)


def test_a_reduce_precision_to_fp8_rounds_and_a_wider_one_is_widened():
  """e4m3 (8 bits) rounds as float8_e4m3fn does on these values (ml_dtypes rounds the
  reference); e5m10 (float16's 16 bits) is widened away."""
  s = jnp.max(jnp.abs(X)) / 240

  def fn(x):
    q = jax.lax.reduce_precision(x / s, exponent_bits=4, mantissa_bits=3) * s
    return q, jax.lax.reduce_precision(x, exponent_bits=5, mantissa_bits=10)

  q, h = in_float64(fn, X)
  grid = (np.asarray(X) / np.float32(s)).astype(jnp.float8_e4m3fn).astype(np.float64)
  np.testing.assert_allclose(q, grid * f64(s), rtol=1e-13)
  assert np.max(np.abs(q - f64(X))) > 1e-2 * np.max(np.abs(f64(X)))  # fp8's grid
  np.testing.assert_allclose(h, f64(X), rtol=1e-15)


def test_a_bfloat16_embedding_gradient_is_a_float64_scatter_add():
  tokens = jnp.asarray(_rng.integers(0, 6, size=(64, 5)), jnp.int32)
  emb = jnp.asarray(_rng.normal(size=(6, 3)) + 1.0, jnp.float32)

  def loss(e):
    return jnp.sum(e.astype(BF16)[tokens] * jnp.asarray(X[:, :3, None].transpose(0, 2, 1),
                                                          BF16)).astype(jnp.float32)

  (grad,) = in_float64(jax.grad(loss), emb)
  expected = np.zeros((6, 3))
  np.add.at(expected, np.asarray(tokens).ravel(), np.repeat(f64(X[:, :3]), 5, axis=0))
  np.testing.assert_allclose(grad, expected, rtol=1e-13)


def test_control_flow_calls_and_custom_rules():
  x = X[:, 0]

  @jax.custom_vjp
  def twice(v):
    return (v * 2).astype(jnp.float16)

  # A backward rule that is not the derivative (3, not 2): the program's own rule is kept.
  twice.defvjp(lambda v: (twice(v), None), lambda _, ct: (ct.astype(jnp.float32) * 3,))

  def fn(x):
    narrow = x.astype(BF16)
    c, ys = jax.lax.scan(lambda c, r: (c + r.astype(BF16), c), jnp.asarray(0, BF16), x)
    _, back = jax.lax.scan(lambda c, r: (c + r, c), jnp.asarray(0, BF16), narrow, reverse=True)
    limit, factor = jnp.where(x[2] > 0, 5, 5), x[3].astype(jnp.float16)  # traced: consts
    _, p = jax.lax.while_loop(lambda s: s[0] < limit, lambda s: (s[0] + 1, s[1] * factor),
                              (0, x[0].astype(jnp.float16)))
    branch = jnp.stack([jax.lax.cond(x[i] > 0, lambda: jnp.sum(narrow), lambda: -jnp.sum(narrow))
                        for i in (0, 1)])  # one true, one false
    remat = jax.checkpoint(lambda v: jnp.sum(jnp.sin(v.astype(jnp.float16))))(x)
    called = jax.jit(lambda v: jnp.mean(v.astype(BF16)))(x)
    grad = jax.grad(lambda v: jnp.sum(twice(v)).astype(jnp.float32))(x)
    return c, ys, back, p, branch, remat, called, grad

  c, ys, back, p, branch, remat, called, grad = in_float64(fn, x)
  np.testing.assert_allclose(c, f64(x).sum(), rtol=1e-13)
  np.testing.assert_allclose(ys, np.concatenate([[0.0], np.cumsum(f64(x))[:-1]]), atol=1e-12)
  np.testing.assert_allclose(back, np.concatenate([np.cumsum(f64(x)[::-1])[:-1][::-1], [0.0]]),
                             atol=1e-12)
  np.testing.assert_allclose(p, f64(x[0]) * f64(x[3]) ** 5, rtol=1e-13)
  assert (x[0] > 0) != (x[1] > 0)
  np.testing.assert_allclose(branch, np.sign(f64(x[:2])) * f64(x).sum(), rtol=1e-13)
  np.testing.assert_allclose([remat, called], [np.sin(f64(x)).sum(), f64(x).mean()], rtol=1e-13)
  np.testing.assert_array_equal(grad, np.full(64, 3.0))


def test_linear_solves_are_their_solve():
  """``jnp.linalg.solve`` is a ``custom_linear_solve``; its gradient solves the transpose."""
  a = X[:8] + 4 * jnp.eye(8)
  value, grad = in_float64(jax.value_and_grad(
      lambda a: jnp.sum(jnp.linalg.solve(a.astype(BF16).astype(jnp.float32), X[0]))), a)
  inv = np.linalg.inv(f64(a))
  np.testing.assert_allclose(value, (inv @ f64(X[0])).sum(), rtol=1e-12)
  np.testing.assert_allclose(grad, -np.outer(inv.T @ np.ones(8), inv @ f64(X[0])), rtol=1e-11)


def test_bitcasts_read_the_bits_of_the_value_in_its_own_dtype():
  """A hash of float values (bits of float32, of bfloat16) gives the program's integers."""
  def fn(x):
    return (jax.lax.bitcast_convert_type(x * 3, jnp.uint32),
            jax.lax.bitcast_convert_type(x.astype(BF16), jnp.uint16))

  for shadow, native in zip(in_float64(fn, X), fn(X), strict=True):
    np.testing.assert_array_equal(shadow, native)


def test_a_vmapped_loop_runs_each_example_its_own_trip_count():
  """``vmap`` of a ``while_loop`` to a tolerance: its predicate is one per example."""
  def newton(a):  # the square root, from a bfloat16 guess
    return jax.lax.while_loop(lambda s: jnp.abs(s[0] ** 2 - a) > 1e-3 * a,
                              lambda s: (0.5 * (s[0] + a / s[0]), s[1] + 1),
                              (a.astype(BF16).astype(jnp.float32) / 2, 0))

  a = jnp.linspace(1.0, 100.0, 16)
  roots, trips = in_float64(jax.vmap(newton), a)
  for ai, root, n in zip(f64(a), roots, trips, strict=True):
    guess = ai / 2  # the bfloat16 cast is not in the float64 program
    for _ in range(n):
      guess = 0.5 * (guess + ai / guess)
    assert abs(guess**2 - ai) <= 1e-3 * ai and root == guess
  assert len(set(trips.tolist())) > 1


def test_random_bits_are_the_programs_own():
  def fn(x):
    return jax.random.uniform(jax.random.key(3), x.shape, BF16) * x, jax.random.randint(
        jax.random.key(4), (5,), 0, 100)

  draws, ints = in_float64(fn, X)
  uniform = jax.random.uniform(jax.random.key(3), X.shape, BF16)  # bfloat16 draws, exact
  np.testing.assert_array_equal(draws, f64(uniform) * f64(X))
  np.testing.assert_array_equal(ints, fn(X)[1])


def test_complex_values_widen_to_complex128():
  z = (X[:, 0] + 1j * X[:, 1]).astype(jnp.complex64)
  (out,) = in_float64(lambda z: jnp.sum(z * z), z)
  assert out.dtype == np.complex128
  np.testing.assert_allclose(out, np.sum(np.asarray(z, np.complex128) ** 2), rtol=1e-13)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (tests/conftest.py)")
def test_shard_map_and_shardings_stay_as_they_are():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))

  def fn(x):
    local = jax.shard_map(lambda b: jax.lax.psum(jnp.sum(b.astype(BF16)), "data"),
                          mesh=mesh, in_specs=P("data"), out_specs=P())
    return local(x), x.astype(jnp.float16) * 2

  with jax.set_mesh(mesh):
    x = jax.device_put(X, P("data"))
    closed = jax.make_jaxpr(fn)(x)
    total, doubled = _float64.evaluate(closed)(x)
  np.testing.assert_allclose(float(total), f64(X).sum(), rtol=1e-13)
  assert doubled.dtype == np.float64 and doubled.sharding.is_equivalent_to(x.sharding, 2)
  np.testing.assert_array_equal(np.asarray(doubled), 2 * f64(X))


def test_a_dot_algorithm_for_narrow_operands_is_float64_s():
  """``precision=`` may name an algorithm of bfloat16 operands: float64 has its own."""
  algorithm = jax.lax.DotAlgorithmPreset.BF16_BF16_F32
  (out,) = in_float64(lambda x, w: jnp.dot(x, w, precision=algorithm), X, W)
  np.testing.assert_allclose(out, f64(X) @ f64(W), rtol=1e-13)


def test_an_unknown_primitive_with_narrow_results_is_refused():
  """A kernel's primitive computes in its own types whatever its operands: named, refused."""
  kernel = jax.extend.core.Primitive("narrow_kernel")
  kernel.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, jnp.float32))
  with pytest.raises(ValueError, match=r"`narrow_kernel` \(at .*test_float64\.py:\d+"):
    in_float64(lambda x: kernel.bind(x), X)


@pytest.mark.parametrize("kind", ["pure_callback", "io_callback"])
def test_callbacks_are_refused_with_their_line(kind):
  def fn(x):
    if kind == "pure_callback":
      return jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    jax.experimental.io_callback(lambda v: None, None, x)
    return x

  with pytest.raises(ValueError, match=rf"`{kind}` \(at .*test_float64\.py:\d+"):
    in_float64(fn, X)


def test_64_bit_types_are_enabled_for_the_evaluation_alone():
  in_float64(lambda x: jnp.sum(x), X)
  assert not jax.config.jax_enable_x64 and jnp.ones(()).dtype == jnp.float32
