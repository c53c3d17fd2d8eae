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

The shadow is a table of rules over ``_jaxpr.interpret`` (``_WIDE``): a
call's jaxpr is evaluated in its place, a ``shard_map``'s again per device,
and any other equation is bound again with the jaxprs in its params (a
``cond``'s branches, a loop's body, a reduction's computation) traced again
in float64.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jax_core
from jax.extend import source_info_util

from optax_accum import _jaxpr

_OPAQUE = ("pure_callback", "io_callback", "ffi_call", "pallas_call", "triton_kernel_call",
           "custom_call")


def wide(dtype: Any) -> Any:
  """float64 for a floating dtype, complex128 for a complex one, ``dtype`` otherwise."""
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return np.dtype(np.complex128)
  return np.dtype(np.float64) if jnp.issubdtype(dtype, jnp.floating) else dtype


def quantiser(eqn: Any) -> str | None:
  """The float format of 8 bits or fewer (fp8, fp4) that ``eqn`` rounds to (a cast, a
  ``reduce_precision``), else None: what the shadow keeps a rounding and the check names."""
  p, name = eqn.params, eqn.primitive.name
  if name == "convert_element_type" and jnp.issubdtype(p["new_dtype"], jnp.floating) and (
      np.dtype(p["new_dtype"]).itemsize == 1):
    return str(np.dtype(p["new_dtype"]))
  if name == "reduce_precision" and p["exponent_bits"] + p["mantissa_bits"] + 1 <= 8:
    return f"e{p['exponent_bits']}m{p['mantissa_bits']} (fp8)"
  return None


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
  run = jax.jit(functools.partial(_eval, closed.jaxpr))  # (consts, *args) -> outputs

  def call(*args: Any) -> list[jax.Array]:
    values = [*closed.consts, *args]
    mesh = meshed or any(isinstance(v, jax.Array) and len(v.devices()) > 1 for v in values)
    host = None if mesh else jax.devices("cpu")[0]  # a mesh stays as it is
    # Leaf by leaf; int64 as traced: int32. On a mesh only what is not an array yet is put
    # (`jax.device_put(keys, None)` drops a typed key array's sharding: jax 0.10.2 to 0.12.1).
    values = [v if host is None and isinstance(v, jax.Array) else jax.device_put(v, host)
              for v in values]
    with jax.enable_x64(True):
      return run(values[:len(closed.consts)], *values[len(closed.consts):])

  return call


def _meshed(jaxpr: jax_core.Jaxpr) -> bool:
  """Whether ``jaxpr`` holds a ``shard_map`` over more than one device, at any depth."""
  found: list[Any] = []
  _meshes(found, jaxpr, [None] * len(jaxpr.invars))
  return bool(found)


def _meshes(found: list[Any], jaxpr: jax_core.Jaxpr, ins: list[Any]) -> list[Any]:
  """A walk of ``jaxpr`` (every value None) that adds each ``shard_map`` over several devices
  to ``found``."""
  return _jaxpr.interpret(_MESHES, jaxpr, [None] * len(jaxpr.constvars), ins, found)


def _mesh(found: list[Any], eqn: Any, ins: list[Any]) -> list[Any]:
  if _jaxpr.kind(eqn) == "shard_map" and eqn.params["mesh"].size > 1:
    found.append(eqn)
  return _jaxpr.descend(eqn, ins, functools.partial(_meshes, found), lambda _: None)


_MESHES = _jaxpr.Rules({}, _mesh, lambda _: None)


def _eval(jaxpr: jax_core.Jaxpr, consts: Sequence[Any], *args: Any) -> list[Any]:
  return _jaxpr.interpret(_WIDE, jaxpr, map(_up, consts), map(_up, args))


def _run(j: Any) -> Callable[..., list[Any]]:
  closed = _jaxpr.closed(j)
  return functools.partial(_eval, closed.jaxpr, closed.consts)


def _bound(_: Any, eqn: Any, ins: list[Any]) -> list[Any]:
  """``eqn`` bound again on float64 operands: its dtypes widened, its jaxprs traced again in
  float64 (a ``cond``'s branches, a loop's body, a reduction's scalar computation)."""
  p = _jaxpr.map_jaxprs(eqn.params, lambda j: _traced(j, eqn))
  out = eqn.primitive.bind(*ins, **{k: _param(k, v) for k, v in p.items()})
  outs = list(out) if eqn.primitive.multiple_results else [out]
  if any(wide(o.dtype) != o.dtype for o in outs):
    raise _cannot(eqn)
  return outs


def _traced(j: Any, eqn: Any) -> Any:
  """The jaxpr ``j`` of ``eqn``'s params evaluated in float64, traced on its inputs widened."""
  closed = _jaxpr.closed(j)
  new = jax.make_jaxpr(_run(closed))(*(
      v.aval.update(dtype=wide(v.aval.dtype)) for v in closed.jaxpr.invars))
  if new.consts and isinstance(j, jax_core.Jaxpr):
    raise _cannot(eqn)
  return new if isinstance(j, jax_core.ClosedJaxpr) else new.jaxpr


def _param(key: str, value: Any) -> Any:
  """A parameter for float64 operands: a dtype widened."""
  if key == "precision":
    return None  # a dot algorithm names its operands' types; float64 has one algorithm
  if isinstance(value, type) and issubclass(value, np.generic):
    value = np.dtype(value)
  return wide(value) if isinstance(value, np.dtype) else value


def _reduce_precision(_: Any, eqn: Any, ins: list[Any]) -> list[Any]:
  """To 8 bits or fewer (fp8): a quantiser, as a cast is; wider: not in the shadow."""
  return _bound(_, eqn, ins) if quantiser(eqn) else ins


def _convert(_: Any, eqn: Any, ins: list[Any]) -> list[Any]:
  """A cast; to an 8-bit float (fp8, fp4): a quantiser, rounded, then widened."""
  if quantiser(eqn):
    return [_up(lax.convert_element_type(ins[0], eqn.params["new_dtype"]))]
  return _bound(_, eqn, ins)


def _bitcast(_: Any, eqn: Any, ins: list[Any]) -> list[Any]:
  """The bits of the value in its own dtype."""
  x = ins[0].astype(eqn.invars[0].aval.dtype)
  return [_up(lax.bitcast_convert_type(x, eqn.params["new_dtype"]))]


def _shard_map(_: Any, eqn: Any, ins: list[Any]) -> list[Any]:
  p, body = eqn.params, _run(_jaxpr.callee(eqn))
  return list(jax.shard_map(lambda *a: tuple(body(*a)), mesh=p["mesh"],
                            in_specs=tuple(p["in_specs"]), out_specs=tuple(p["out_specs"]),
                            axis_names=p["newly_manual_axes"], check_vma=p["check_vma"])(*ins))


def _opaque(_: Any, eqn: Any, ins: list[Any]) -> list[Any]:
  raise _cannot(eqn)


_WIDE = _jaxpr.Rules({
    "debug_callback": lambda *_: [], "debug_print": lambda *_: [],  # prints: once is enough
    "reduce_precision": _reduce_precision, "convert_element_type": _convert,
    "bitcast_convert_type": _bitcast, "shard_map": _shard_map, **dict.fromkeys(_OPAQUE, _opaque),
    _jaxpr.CALL: lambda _, eqn, ins: _run(_jaxpr.callee(eqn))(*ins),  # a custom rule's function
}, _bound, lambda v: _up(np.asarray(v.val, v.aval.dtype)))


def _cannot(eqn: Any) -> ValueError:
  where = source_info_util.summarize(eqn.source_info)
  return ValueError(
      f"`{eqn.primitive.name}` (at {where}) cannot be evaluated in float64 (a callback, a"
      " foreign function or a kernel computes in its own types): check the loss with its"
      " reference implementation (jax.nn.dot_product_attention(..., implementation='xla'), a"
      " Pallas kernel's pure-JAX version) in its place.")
