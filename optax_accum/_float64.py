"""A function's jaxpr evaluated with every floating value in float64: the float64 shadow.

``check_large_batch`` compares micro-batches with the whole batch in float64,
whatever dtypes the user's code computes in: a bfloat16 policy, a bfloat16
embedding's scatter-add, ``preferred_element_type``. Each
equation of the jaxpr is bound again with its floating operands, results and
dtype parameters widened to float64 (complex to complex128), through calls,
custom rules, ``jax.checkpoint``, ``cond``, ``scan``, ``while`` and
``shard_map``. Integer values (and ``bitcast_convert_type``'s bits: random
numbers stay bit for bit the draws the user's code makes) keep their dtype, a
cast to an 8-bit float (fp8), or a ``reduce_precision`` to 8 bits or fewer, stays
a quantisation (rounded in its type, then widened, as ``jnp.round`` is: an fp8
scale taken from the batch must show; a wider ``reduce_precision`` is widened),
constants the values the program holds (a bfloat16 literal was rounded when
traced), and the program its structure: shardings, collectives, control flow.
What cannot be widened (callbacks, foreign calls, kernels) raises a
``ValueError`` that names the primitive and the line that made it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jax_core
from jax.extend import source_info_util

# Calls (jit, jax.checkpoint, custom_jvp/custom_vjp functions), and where their callee is.
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "remat": "jaxpr", "checkpoint": "jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr"}
_OPAQUE = ("pure_callback", "io_callback", "ffi_call", "pallas_call", "triton_kernel_call",
           "custom_call")
_DROPPED = ("debug_callback", "debug_print")  # prints the user's values: once is enough


def wide(dtype: Any) -> Any:
  """float64 for a floating dtype, complex128 for a complex one, ``dtype`` otherwise."""
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return np.dtype(np.complex128)
  return np.dtype(np.float64) if jnp.issubdtype(dtype, jnp.floating) else dtype


def narrow(p: Any) -> bool:
  """Whether ``reduce_precision``'s parameters ``p`` name a format of 8 bits or fewer."""
  return p["exponent_bits"] + p["mantissa_bits"] + 1 <= 8


def _up(x: Any) -> Any:
  x = jnp.asarray(x)
  return x if wide(x.dtype) == x.dtype else lax.convert_element_type(x, wide(x.dtype))


def evaluate(closed: jax_core.ClosedJaxpr) -> Callable[..., list[jax.Array]]:
  """``closed``'s outputs in float64, from its inputs in their own dtypes: one jitted program.

  The program is compiled once per ``closed`` and runs on the host CPU
  (``jax.devices("cpu")[0]``, on every JAX install: an accelerator may emulate
  float64 and take minutes to compile it): the inputs and ``closed``'s constants
  are moved there leaf by leaf. Inputs laid out over several devices (a mesh),
  or all of them where ``closed`` holds a ``shard_map`` over several, stay as
  they are. 64-bit types are enabled for the program alone (the user's
  setting, and ``closed``, which was traced under it, are left as they are).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> def mean(x):  # a bfloat16 sum: 256 rounds to 256 + 2 = 258
    ...   return jnp.sum(x.astype(jnp.bfloat16), dtype=jnp.bfloat16) / 1024
    >>> x = jnp.full(1024, 1.0 + 1 / 256, jnp.float32)
    >>> closed = jax.make_jaxpr(mean)(x)
    >>> float(mean(x)), float(evaluate(closed)(x)[0])
    (1.0, 1.00390625)
  """
  meshed = _meshed(closed.jaxpr)  # a shard_map over several devices: run on them

  @jax.jit
  def run(consts: Sequence[Any], *args: Any) -> list[jax.Array]:
    return _eval(closed.jaxpr, consts, args)

  def call(*args: Any) -> list[jax.Array]:
    values = [*closed.consts, *args]
    mesh = meshed or any(isinstance(v, jax.Array) and len(v.devices()) > 1 for v in values)
    host = None if mesh else jax.devices("cpu")[0]  # a mesh stays as it is
    values = [jax.device_put(v, host) for v in values]  # leaf by leaf; int64 as traced: int32
    with jax.enable_x64(True):
      return run(values[:len(closed.consts)], *values[len(closed.consts):])

  return call


def _meshed(jaxpr: jax_core.Jaxpr) -> bool:
  """Whether ``jaxpr`` holds a ``shard_map`` over more than one device, at any depth."""
  return any((e.primitive.name == "shard_map" and e.params["mesh"].size > 1)
             or any(map(_meshed, jax_core.jaxprs_in_params(e.params))) for e in jaxpr.eqns)


def _eval(jaxpr: jax_core.Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
  env: dict[Any, Any] = {}

  def read(v: Any) -> Any:
    if isinstance(v, jax_core.Literal):
      return _up(np.asarray(v.val, v.aval.dtype))
    return env[v]

  env.update(zip(jaxpr.constvars, map(_up, consts), strict=True))
  env.update(zip(jaxpr.invars, map(_up, args), strict=True))
  for eqn in jaxpr.eqns:
    env.update(zip(eqn.outvars, _apply(eqn, [read(v) for v in eqn.invars]), strict=True))
  return [read(v) for v in jaxpr.outvars]


def _closed(j: Any) -> jax_core.ClosedJaxpr:
  return j if isinstance(j, jax_core.ClosedJaxpr) else jax_core.ClosedJaxpr(j, ())


def _run(j: Any) -> Callable[..., list[Any]]:
  closed = _closed(j)
  return lambda *a: _eval(closed.jaxpr, closed.consts, a)


def _apply(eqn: Any, ins: list[Any]) -> list[Any]:
  """One equation, its floating values in float64."""
  name, p = eqn.primitive.name, eqn.params
  if name in _DROPPED:
    return []
  if name == "reduce_precision":  # to 8 bits or fewer (fp8): a quantiser, as a cast is
    return [eqn.primitive.bind(*ins, **p)] if narrow(p) else ins  # wider: not in the shadow
  if name == "convert_element_type" and jnp.issubdtype(p["new_dtype"], jnp.floating) and (
      np.dtype(p["new_dtype"]).itemsize == 1):  # fp8 (fp4): a quantiser, rounded, then widened
    return [_up(lax.convert_element_type(ins[0], p["new_dtype"]))]
  if name == "bitcast_convert_type":  # the bits of the value in its own dtype
    out = lax.bitcast_convert_type(ins[0].astype(eqn.invars[0].aval.dtype), p["new_dtype"])
    return [_up(out)]
  if name == "cond":
    return list(lax.switch(ins[0], [_run(b) for b in p["branches"]], *ins[1:]))
  if name == "while":  # bound as it is: a vmapped loop's predicate is one per example
    c, b = p["cond_nconsts"], p["body_nconsts"]
    return eqn.primitive.bind(*ins, **{
        **p, "cond_jaxpr": jax.make_jaxpr(_run(p["cond_jaxpr"]))(*ins[:c], *ins[c + b:]),
        "body_jaxpr": jax.make_jaxpr(_run(p["body_jaxpr"]))(*ins[c:c + b], *ins[c + b:])})
  if name == "scan":
    if "ft_in" in p:  # jax >= 0.11: the operands' groups as a flat tree
      consts, init, xs = map(list, p["ft_in"].update(ins).unpack())
    else:
      c, n = p["num_consts"], p["num_carry"]
      consts, init, xs = ins[:c], ins[c:c + n], ins[c + n:]
    body = _run(p["jaxpr"])

    def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
      out = body(*consts, *carry, *x)
      return out[:len(init)], out[len(init):]

    carry, ys = lax.scan(step, init, xs, length=p["length"], reverse=p["reverse"])
    return [*carry, *ys]
  if name == "shard_map":
    body = _run(p["jaxpr"])
    return list(jax.shard_map(lambda *a: tuple(body(*a)), mesh=p["mesh"],
                              in_specs=tuple(p["in_specs"]), out_specs=tuple(p["out_specs"]),
                              axis_names=p["newly_manual_axes"], check_vma=p["check_vma"])(*ins))
  if name == "custom_linear_solve":  # its value: the solve, on its consts and the right side
    n, start = p["const_lengths"], p["const_lengths"].matvec + p["const_lengths"].vecmat
    return _run(p["jaxprs"].solve)(*ins[start:start + n.solve], *ins[sum(n):])
  if name in _CALLS:
    return _run(p[_CALLS[name]])(*ins)  # a custom rule's function itself: no derivative taken
  if name in _OPAQUE:
    raise _cannot(eqn)
  out = eqn.primitive.bind(*ins, **{k: _param(k, v, eqn) for k, v in p.items()})
  outs = list(out) if eqn.primitive.multiple_results else [out]
  if any(wide(o.dtype) != o.dtype for o in outs):
    raise _cannot(eqn)
  return outs


def _param(key: str, value: Any, eqn: Any) -> Any:
  """A parameter of ``eqn`` for float64 operands: dtypes widened, scalar computations too."""
  if key == "precision":
    return None  # a dot algorithm names its operands' types; float64 has one algorithm
  if isinstance(value, (jax_core.Jaxpr, jax_core.ClosedJaxpr)):
    closed = _closed(value)  # a reduction's or scatter's scalar computation
    avals = [jax.ShapeDtypeStruct(v.aval.shape, wide(v.aval.dtype)) for v in closed.jaxpr.invars]
    new = jax.make_jaxpr(_run(closed))(*avals)
    if new.consts and isinstance(value, jax_core.Jaxpr):
      raise _cannot(eqn)
    return new if isinstance(value, jax_core.ClosedJaxpr) else new.jaxpr
  if isinstance(value, type) and issubclass(value, np.generic):
    value = np.dtype(value)
  return wide(value) if isinstance(value, np.dtype) else value


def _cannot(eqn: Any) -> ValueError:
  where = source_info_util.summarize(eqn.source_info)
  return ValueError(
      f"`{eqn.primitive.name}` (at {where}) cannot be evaluated in float64 (a callback, a"
      " foreign function or a kernel computes in its own types): check the loss with its"
      " reference implementation (jax.nn.dot_product_attention(..., implementation='xla'), a"
      " Pallas kernel's pure-JAX version) in its place.")
