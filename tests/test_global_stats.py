"""Global statistics: a loss that needs sums over the whole batch gets them, exactly.

The model is a small mixture-of-experts network (two top-2 routed expert
layers, each under ``jax.checkpoint``); its loss has three terms, each
normalised by its own global count: the token-weighted cross-entropy (by the
real tokens), the load-balancing loss ``N_E * sum_i f_i * P_i`` (``f_i`` from
the whole batch's expert counts) and the router z-loss (by the routed
tokens). Every term is a sum over the rows given the statistics, so
``microbatched(..., normalize="sum", global_stats=stats)`` must equal the whole
batch's ``value_and_grad`` with ``stats=stop_gradient(stats(params, batch))``:
the reference, computed here in float64 without the package.

Across steps, ``accumulate(k, opt, global_stats=like)`` carries the running
sum (the causal buffer) and the last window's total (lagged), checked with
integers, under ``shard_map`` on 8 devices, through orbax and
``reshard_state``.
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum as oa
from optax_accum.debug import hlo_collectives
from optax_accum.sharding import per_device_state, reshard_state, shard_map_specs
from tests._reference import on_cpu

E, TOPK, D, H, V, L = 4, 2, 6, 8, 5, 2  # experts, routed per token, widths, vocab, layers
B, T = 64, 3  # rows (sequences) and tokens per row
LOOP = ("while", "body")
needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")


def init_params(dtype: Any = jnp.float32) -> dict[str, Any]:
  ks = iter(jax.random.split(jax.random.key(0), 3 + 3 * L))
  normal = lambda shape, s: (jax.random.normal(next(ks), shape) * s).astype(dtype)
  return {"emb": normal((V, D), 1.0), "out": normal((D, V), 0.5),
          "layers": [{"router": normal((D, E), 1.0), "w1": normal((E, D, H), 0.4),
                      "w2": normal((E, H, D), 0.4)} for _ in range(L)]}


def make_batch(seed: int = 1, rows: int = B) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {"tokens": rng.integers(0, V, (rows, T)), "targets": rng.integers(0, V, (rows, T)),
          "mask": (rng.random((rows, T)) < 0.7).astype(np.int32)}  # 0: padding


@jax.checkpoint  # remat: the gradient pass recomputes the routing; the statistics stay put
def moe_layer(p: dict[str, Any], h: jax.Array) -> tuple[jax.Array, Any]:
  logits = h @ p["router"]
  probs = jax.nn.softmax(logits)
  top, chosen = lax.top_k(probs, TOPK)
  gates = jnp.einsum("nk,nke->ne", top / top.sum(-1, keepdims=True), jax.nn.one_hot(chosen, E))
  experts = jnp.einsum("neh,ehd->ned", jax.nn.gelu(jnp.einsum("nd,edh->neh", h, p["w1"])),
                       p["w2"])
  return h + jnp.einsum("ne,ned->nd", gates, experts), (jax.nn.one_hot(chosen, E).sum(1), probs,
                                                       logits)


def forward(params: dict[str, Any], batch: dict[str, Any]) -> tuple[jax.Array, list[Any]]:
  h = params["emb"][batch["tokens"].reshape(-1)]
  routed = []
  for p in params["layers"]:
    h, r = moe_layer(p, h)
    routed.append(r)
  return h @ params["out"], routed


def stats_fn(params: dict[str, Any], batch: dict[str, Any]) -> dict[str, jax.Array]:
  """This micro-batch's statistics: its real tokens and, per layer, each expert's count."""
  mask = batch["mask"].reshape(-1, 1)
  _, routed = forward(params, batch)
  counts = jnp.stack([(chosen * mask).sum(0) for chosen, _, _ in routed]).astype(jnp.int32)
  return {"tokens": mask.sum(dtype=jnp.int32), "counts": counts}


def terms(params: dict[str, Any], batch: dict[str, Any], *, stats: Any) -> dict[str, jax.Array]:
  """The three terms as sums over this micro-batch's tokens, each over its global count."""
  logits, routed = forward(params, batch)
  mask = batch["mask"].reshape(-1)
  tokens = stats["tokens"].astype(logits.dtype)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"].reshape(-1))
  f = stats["counts"].astype(logits.dtype) / (TOPK * tokens)  # [L, E], the whole batch's
  balance = sum(E * jnp.sum(f[i] * (probs * mask[:, None]).sum(0) / tokens)
                for i, (_, probs, _) in enumerate(routed))
  z = sum(jnp.sum(jax.nn.logsumexp(lg, -1) ** 2 * mask) for _, _, lg in routed) / (L * tokens)
  return {"main": jnp.sum(ce * mask) / tokens, "balance": 0.1 * balance, "z": 1e-2 * z}


def loss(params: dict[str, Any], batch: dict[str, Any], *, stats: Any,
         term: str | None = None) -> jax.Array:
  parts = terms(params, batch, stats=stats)
  return sum(parts.values()) if term is None else parts[term]


def whole_batch(params: Any, batch: Any, term: str | None = None) -> tuple[Any, Any]:
  """The reference: the whole batch, its statistics as constants (no package code)."""
  return jax.jit(jax.value_and_grad(lambda p, b: loss(
      p, b, stats=lax.stop_gradient(stats_fn(p, b)), term=term)))(params, batch)


def max_rel(a: Any, e: Any) -> float:
  a, e = (np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(t)])
          for t in (a, e))
  return float(np.max(np.abs(a - e)) / np.max(np.abs(e)))


def on_devices(n: int, tree: Any, mesh: Any) -> Any:
  """``tree`` with its rows split over the mesh (``n`` devices), or as it is for one."""
  return tree if n == 1 else jax.device_put(tree, NamedSharding(mesh, P("data")))


@functools.cache
def mesh8() -> Any:
  return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


# --------------------------------------------------------------------- in one step
@functools.cache
def float64_whole_batch() -> tuple[Any, Any, Any]:
  params, batch = init_params(jnp.float64), make_batch()
  return params, batch, whole_batch(params, batch)


@pytest.mark.parametrize(("k", "devices"), [
    (2, 1), pytest.param(4, 8, marks=needs_8),
    pytest.param(8, 1, marks=pytest.mark.catches("global_stats_per_microbatch")),
    pytest.param(8, 8, marks=[needs_8, pytest.mark.catches("global_stats_per_microbatch")])])
def test_the_exact_mode_is_the_whole_batch_in_float64(k: int, devices: int) -> None:
  with on_cpu():  # float64 on the host CPU on every backend (a TPU emulates it)
    params, batch, expected = float64_whole_batch()
    fn = oa.microbatched(jax.value_and_grad(loss), k, normalize="sum", global_stats=stats_fn)
    if devices == 1:  # no mesh: what a laptop runs (OPTAX_ACCUM_TEST_DEVICES=1)
      actual = jax.jit(fn)(params, batch)
    else:
      with jax.set_mesh(mesh8()):
        actual = jax.jit(fn)(params, on_devices(devices, batch, mesh8()))
    assert max_rel(actual, expected) < 1e-12


def each_term(params: Any, batch: Any, *, stats: Any) -> tuple[Any, Any]:
  """Every term's value and gradient, apart: ``({term: value}, {term: grads})``."""
  out = {t: jax.value_and_grad(functools.partial(loss, term=t))(params, batch, stats=stats)
         for t in ("main", "balance", "z")}
  return {t: v for t, (v, _) in out.items()}, {t: g for t, (_, g) in out.items()}


@functools.cache
def runs(microbatched: Any) -> dict[str, Any]:
  """Each term's value and gradient: k = 1, k = 8, 8 devices (k = 1 each), the reference.

  Keyed by ``microbatched``: a mutant of it computes its own runs.
  """
  params, batch = init_params(), make_batch()
  run = lambda k, b: jax.jit(microbatched(each_term, k, normalize="sum", global_stats=stats_fn))(
      params, b)
  out = {"k=1": run(1, batch), "k=8": run(8, batch),
         "whole": jax.jit(lambda p, b: each_term(p, b, stats=stats_fn(p, b)))(params, batch)}
  if jax.device_count() >= 8:
    with jax.set_mesh(mesh8()):
      out["8 devices"] = run(1, on_devices(8, batch, mesh8()))
  return {name: {t: (v[t], g[t]) for t in v} for name, (v, g) in out.items()}


@pytest.mark.parametrize("term", ["main", pytest.param("balance", marks=pytest.mark.catches(
    "global_stats_per_microbatch")), "z"])
def test_each_term_is_the_same_for_k_1_k_8_and_8_devices(term: str) -> None:
  found = {name: by_term[term] for name, by_term in runs(oa.microbatched).items()}
  assert max_rel(found["k=1"], found["whole"]) < 1e-6  # k = 1 is the whole batch
  assert max_rel(found["k=8"], found["k=1"]) < 1e-5
  if "8 devices" in found:
    assert max_rel(found["8 devices"], found["k=1"]) < 1e-5


def test_normalize_weighted_is_a_global_token_count() -> None:
  """``normalize="weighted"``'s denominator is the first global statistic: the same gradient."""
  params, batch = init_params(), make_batch()
  def token_sums(p: Any, b: Any) -> tuple[jax.Array, jax.Array]:
    logits, _ = forward(p, b)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"].reshape(-1))
    return jnp.sum(ce * b["mask"].reshape(-1)), jnp.sum(b["mask"])
  weighted = oa.microbatched(jax.value_and_grad(token_sums, has_aux=True), 4,
                             normalize="weighted")(params, batch)
  by_stats = oa.microbatched(jax.value_and_grad(
      lambda p, b, stats: token_sums(p, b)[0] / stats["tokens"]), 4, normalize="sum",
      global_stats=stats_fn)(params, batch)
  assert max_rel(by_stats, weighted) < 1e-6


@needs_8
@pytest.mark.parametrize("where", ["plain jit", "shard_map"])
def test_the_statistics_cross_devices_once_before_the_loop(where: str) -> None:
  """One all-reduce of the statistics, before the gradient loop; one of the gradients, after."""
  params, batch = init_params(), on_devices(8, make_batch(), mesh8())
  grad_fn = jax.value_and_grad(loss)
  if where == "plain jit":
    fn = oa.microbatched(grad_fn, 4, normalize="sum", global_stats=stats_fn)
  else:
    inner = oa.microbatched(grad_fn, 4, normalize="sum", global_stats=stats_fn, axis_name="data")
    fn = jax.shard_map(lambda p, b: inner(lax.pcast(p, "data", to="varying"), b), mesh=mesh8(),
                       in_specs=(P(), P("data")), out_specs=P())
  with jax.set_mesh(mesh8()):
    found = hlo_collectives(jax.jit(fn).lower(params, batch).compile())
  reductions = [c for c in found if c.op == "all-reduce"]
  assert not [c for c in reductions if LOOP in c.context]  # nothing per micro-batch
  stats_bytes = 4 * (1 + L * E)
  assert sorted(c.bytes for c in reductions)[0] == stats_bytes
  assert len([c for c in reductions if c.bytes == stats_bytes]) == 1


def test_a_statistic_kept_per_row_is_pooled_over_its_rows() -> None:
  """A leaf with an axis of the rows (here the second: ``[T, rows]``) is summed over it."""
  params, batch = init_params(), make_batch()
  per_row = lambda p, b: {"at": b["mask"].T, "counts": stats_fn(p, b)["counts"]}

  def fn(p: Any, b: Any, stats: Any) -> tuple[jax.Array, Any]:
    return loss(p, b, stats={**stats, "tokens": stats["at"].sum()}), stats["at"]
  (_, at), grads = oa.microbatched(jax.value_and_grad(fn, has_aux=True), 4, normalize="sum",
                                   has_aux=True, aux_rules="max", global_stats=per_row)(
                                       params, batch)
  assert at.tolist() == batch["mask"].sum(0).tolist()  # real tokens at each position
  assert max_rel(grads, whole_batch(params, batch)[1]) < 1e-5


@jax.custom_jvp
def _straight_through(v: jax.Array) -> jax.Array:
  return jnp.round(v)


_straight_through.defjvp(lambda primals, tangents: (jnp.round(primals[0]), tangents[0]))


@pytest.mark.parametrize(("bad", "error", "match"), [
    (lambda p, b: {"mask": b["mask"] > 0}, TypeError, r"\['mask'\] is an array of bool"),
    (lambda p, b: {"name": "experts"}, TypeError, r"\['name'\] is a str"),
    (lambda p, b: {"P": forward(p, b)[1][0][1].sum(0)}, ValueError,
     r"\['P'\] has a gradient.*stop_gradient"),
    (lambda p, b: {"R": _straight_through(forward(p, b)[1][0][1]).sum(0)}, ValueError,
     r"\['R'\] has a gradient.*stop_gradient"),  # (through its own rule: round has none)
    (lambda p, b: {"square": jnp.ones((b["mask"].shape[0],) * 2)}, ValueError,
     r"\['square'\] is rows paired, shifted or cut \(`broadcast_in_dim`: \(8, 8\) -> \(64, 64\)"),
    (lambda p, b: {f"n{len(b['mask'])}": b["mask"].sum()}, ValueError,
     r"returns PyTreeDef\(\{'n8': \*\}\) on a micro-batch but PyTreeDef\(\{'n64': \*\}\)"),
    (lambda p, b: {"r": b["mask"] if len(b["mask"]) > 8 else b["mask"][..., None]}, ValueError,
     r"\['r'\] is of a rank that changes with the rows' count"),
    (lambda p, b: {"pairs": b["mask"].reshape(-1, 2 * T)}, ValueError,
     r"\['pairs'\] is rows paired, shifted or cut"),  # (two rows to an entry of the first axis)
])
def test_bad_statistics_raise_naming_the_leaf_and_the_fix(bad: Any, error: type,
                                                          match: str) -> None:
  fn = oa.microbatched(jax.value_and_grad(loss), 8, normalize="sum", global_stats=bad)
  with pytest.raises(error, match=match):
    fn(init_params(), make_batch())


def test_a_constant_taken_on_purpose_and_a_function_checked() -> None:
  """A float statistic wrapped in ``stop_gradient`` is a constant on purpose: no error."""
  params, batch = init_params(), make_batch()
  sg = lambda p, b: lax.stop_gradient({"P": forward(p, b)[1][0][1].sum(0)})
  fn = oa.microbatched(jax.value_and_grad(lambda p, b, stats: jnp.sum(stats["P"]) * jnp.sum(
      p["out"])), 2, global_stats=sg)
  value, _ = fn(params, batch)
  assert np.isclose(value, B * T * jnp.sum(params["out"]), rtol=1e-5)  # probabilities sum to 1
  with pytest.raises(TypeError, match="`global_stats` must be None or a function"):
    oa.microbatched(fn, 2, global_stats={"tokens": 1})


# ------------------------------------------------------------------- across steps
def count_run(tx: Any, stats: list[Any], **update_kw: Any) -> list[Any]:
  """The global statistics after each ``update`` of a zero gradient with ``stats[i]``."""
  params = {"w": jnp.zeros(2)}
  state, seen = tx.init(params), []
  for s in stats:
    kw = {key: value(len(seen)) for key, value in update_kw.items()}
    if s is None:
      _, state = oa.flush(tx, state, params)
    else:
      grads = {"w": jnp.full(2, jnp.nan if kw.pop("nan", False) else 0.0)}
      _, state = tx.update(grads, state, params, stats=jnp.asarray(s), **kw)
    seen.append(jax.tree.map(np.asarray, state.global_stats))
  return seen


@pytest.mark.catches("causal_buffer_never_reset")
def test_the_running_sum_restarts_and_the_total_moves_to_last_when_a_window_closes() -> None:
  like = jax.ShapeDtypeStruct((2,), jnp.int32)
  tx = oa.accumulate(3, optax.sgd(0.1), global_stats=like)
  seen = count_run(tx, [[1, 0], [2, 1], [3, 1], [4, 0], [5, 2], None, [6, 6]])
  running = [s.running.tolist() for s in seen]
  last = [s.last.tolist() for s in seen]
  assert running == [[1, 0], [3, 1], [0, 0], [4, 0], [9, 2], [0, 0], [6, 6]]
  assert last == [[0, 0], [0, 0], [6, 2], [6, 2], [6, 2], [9, 2], [9, 2]]  # flush closes too
  # emit_now closes early; a micro-batch skipped as non-finite adds nothing.
  tx = oa.accumulate(3, optax.sgd(0.1), global_stats=like, skip_nonfinite=True)
  seen = count_run(tx, [[1, 1], [2, 2], [3, 3]], emit_now=lambda i: i == 0,
                   nan=lambda i: i == 1)
  assert [s.running.tolist() for s in seen] == [[0, 0], [0, 0], [3, 3]]
  assert [s.last.tolist() for s in seen] == [[1, 1], [1, 1], [1, 1]]


def test_stats_given_and_declared_must_agree() -> None:
  params = {"w": jnp.zeros(2)}
  grads = {"w": jnp.zeros(2)}
  declared = oa.accumulate(2, optax.sgd(0.1), global_stats={"n": jnp.zeros(3, jnp.int32)})
  with pytest.raises(ValueError, match=r"got shapes None, but .* declared \{'n': \(3,\)\}"):
    declared.update(grads, declared.init(params), params)
  with pytest.raises(ValueError, match=r"got shapes \{'n': \(4,\)\}"):
    declared.update(grads, declared.init(params), params, stats={"n": jnp.zeros(4)})
  plain = oa.accumulate(2, optax.sgd(0.1))
  with pytest.raises(ValueError, match="declared None"):
    plain.update(grads, plain.init(params), params, stats={"n": jnp.zeros(3)})
  with pytest.raises(TypeError, match="`global_stats` at \\['n'\\] is an array of bool"):
    oa.accumulate(2, optax.sgd(0.1), global_stats={"n": jnp.zeros(3, bool)})


def test_counts_from_a_rematerialised_forward_feed_the_causal_buffer() -> None:
  """The counts come out of the forward as aux: recomputing it (remat) changes nothing."""
  params, batch = init_params(), make_batch(rows=16)
  like = jax.eval_shape(stats_fn, params, batch)
  tx = oa.accumulate(2, optax.sgd(0.1), global_stats=like)

  def causal_loss(p: Any, b: Any, running: Any) -> tuple[jax.Array, Any]:
    own = lax.stop_gradient(stats_fn(p, b))  # this micro-batch's, from the same forward
    return loss(p, b, stats=jax.tree.map(jnp.add, running, own)), own

  @jax.jit
  def step(p: Any, state: Any, b: Any) -> tuple[Any, Any]:
    (_, own), grads = jax.value_and_grad(causal_loss, has_aux=True)(
        p, b, state.global_stats.running)
    return oa.update_and_apply(tx, grads, state, p, stats=own)

  state = tx.init(params)
  halves = [jax.tree.map(lambda x, i=i: x[i::2], batch) for i in range(2)]
  for half in halves:
    params, state = step(params, state, half)
  totals = jax.tree.map(lambda *s: sum(s), *[stats_fn(init_params(), h) for h in halves])
  assert all(jax.tree.leaves(jax.tree.map(np.array_equal, state.global_stats.last, totals)))


@needs_8
def test_across_devices_the_total_is_one_psum_per_window_and_reshards() -> None:
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
  like = jax.ShapeDtypeStruct((2,), jnp.int32)
  tx = per_device_state(oa.accumulate(2, optax.sgd(0.1), axis_name="data", global_stats=like),
                        "data")
  params = {"w": jnp.zeros(3)}
  specs = shard_map_specs(tx, params, "data")
  assert specs.global_stats.running == P("data") and specs.global_stats.last == P()

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")),
                     out_specs=(P(), specs))
  def step(params: Any, state: Any, x: jax.Array) -> tuple[Any, Any]:
    grads = jax.grad(lambda p: jnp.mean(x @ p["w"]))(lax.pcast(params, "data", to="varying"))
    counts = jnp.stack([jnp.sum(x > 0), jnp.sum(x <= 0)]).astype(jnp.int32)  # this device's
    return oa.update_and_apply(tx, grads, state, params, stats=counts)

  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 3)), jnp.float32)
  params1, state = step(params, state, x)
  assert state.global_stats.running.shape == (8, 2)
  assert state.global_stats.running.sum(0).tolist() == [int((x > 0).sum()), int((x <= 0).sum())]
  found = hlo_collectives(step.lower(params1, state, x).compile())
  assert [c.context for c in found if c.bytes == 8] == [(("conditional", 1),)]
  # A checkpoint mid-window, resumed on one device: the running sums add up onto it.
  one = oa.accumulate(2, optax.sgd(0.1), global_stats=like).init(params)
  resumed = reshard_state(jax.device_get(state), one)
  assert resumed.global_stats.running.tolist() == state.global_stats.running.sum(0).tolist()
  _, state = step(params1, state, -x)  # (x and -x: every entry of x counted once either way)
  assert state.global_stats.last.tolist() == [48, 48] and not state.global_stats.running.any()


def test_orbax_restores_the_statistics_mid_window(tmp_path: Any) -> None:
  ocp = pytest.importorskip("orbax.checkpoint")
  tx = oa.accumulate(3, optax.sgd(0.1), global_stats={"n": jnp.zeros(2, jnp.int32)})
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  for s in ([1, 2], [3, 4], [5, 6], [7, 8]):
    _, state = tx.update({"w": jnp.ones(2)}, state, params, stats={"n": jnp.asarray(s)})
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", state)
  checkpointer.wait_until_finished()
  restored = checkpointer.restore(tmp_path / "ckpt", jax.tree.map(
      ocp.utils.to_shape_dtype_struct, tx.init(params)))
  assert restored.global_stats.running["n"].tolist() == [7, 8]
  assert restored.global_stats.last["n"].tolist() == [9, 12]


# ------------------------------------------------------ statistics that are not sums
def router_probs(p: Any, b: Any) -> jax.Array:
  """The first layer's router probabilities, ``[rows * T, E]``."""
  return forward(p, b)[1][0][1]


@pytest.mark.parametrize("not_a_sum", [
    pytest.param(lambda p, b: {"P": lax.stop_gradient(router_probs(p, b).mean(0))},
                 marks=pytest.mark.catches("non_additive_statistic_unseen"), id="mean"),
    pytest.param(lambda p, b: {"most": jnp.max(b["mask"].sum(1))}, id="max"),
    pytest.param(lambda p, b: {"least": jnp.min(b["tokens"], axis=0)}, id="min"),
    pytest.param(lambda p, b: {"busiest": jnp.argmax(b["mask"].sum(1))}, id="argmax"),
    pytest.param(lambda p, b: {"share": b["mask"].sum() / b["mask"].size}, id="sum / rows"),
    pytest.param(lambda p, b: {"lse": lax.stop_gradient(jax.nn.logsumexp(router_probs(p, b), 0))},
                 id="logsumexp"),
])
def test_a_max_or_a_mean_over_the_rows_raises_naming_the_fix(not_a_sum: Any) -> None:
  """Summed over micro-batches, a max or a mean of each is not the whole batch's."""
  fn = oa.microbatched(jax.value_and_grad(lambda p, b, stats: loss(
      p, b, stats=stats_fn(p, b))), 4, normalize="sum", global_stats=not_a_sum)
  try:  # (not pytest.raises: under the mutant, an assertion must fail)
    fn(init_params(), make_batch())
    message = "no error"
  except ValueError as e:
    message = str(e)
  assert re.search(r"`global_stats` is not a sum over rows: its statistic at \['\w+'\] is an?"
                   r" (max|min|argmax|argmin|mean) over the rows\. Return sums and counts, divide"
                   " in the loss", message), message


def test_reductions_over_other_axes_or_unread_are_sums() -> None:
  """A max over the experts (per token), summed over the rows, is a sum; so is a statistic
  next to a max over the rows that it does not read."""
  params, batch = init_params(), make_batch()

  def peaks(p: Any, b: Any) -> Any:
    probs = router_probs(p, b)
    unread = jnp.max(probs, 0)  # over the rows, but no statistic reads it
    return {"peak": lax.stop_gradient(jnp.max(probs, -1).sum()), "n": unread.shape[0]
            * stats_fn(p, b)["tokens"]}

  def fn(p: Any, b: Any, stats: Any) -> tuple[jax.Array, Any]:
    return loss(p, b, stats=stats_fn(p, b)), stats
  (_, found), _ = oa.microbatched(jax.value_and_grad(fn, has_aux=True), 4, normalize="sum",
                                  has_aux=True, aux_rules="mean", global_stats=peaks)(
                                      params, batch)
  whole = peaks(params, batch)
  assert np.isclose(found["peak"], whole["peak"], rtol=1e-5)
  assert int(found["n"]) == int(whole["n"])


@pytest.mark.catches("narrow_statistic_summed_in_its_type")
def test_narrow_integer_statistics_are_summed_in_int32() -> None:
  """512 rows of int8 counts: 64 per micro-batch, 512 in all, which int8 would wrap to 0."""
  batch = {"x": jnp.ones((512, 2)), "real": jnp.ones(512, jnp.int8)}
  counts = lambda w, b: {"n": jnp.sum(b["real"], dtype=jnp.int8), "pos": b["real"]}

  def fn(w: Any, b: Any, stats: Any) -> tuple[jax.Array, Any]:
    return jnp.mean(b["x"] @ w), stats
  (_, seen), _ = oa.microbatched(jax.value_and_grad(fn, has_aux=True), 8, has_aux=True,
                                 aux_rules="last", global_stats=counts)(jnp.ones(2), batch)
  assert seen["n"].dtype == jnp.int32 and int(seen["n"]) == 512
  assert seen["pos"].dtype == jnp.int32 and int(seen["pos"]) == 512
  # Across steps too: `accumulate`'s running sum of int8 statistics is an int32.
  tx = oa.accumulate(8, optax.sgd(0.1), global_stats=jnp.zeros((), jnp.int8))
  state, params = tx.init({"w": jnp.zeros(2)}), {"w": jnp.zeros(2)}
  for _ in range(4):
    _, state = tx.update({"w": jnp.zeros(2)}, state, params, stats=jnp.int8(64))
  assert state.global_stats.running.dtype == jnp.int32 and int(state.global_stats.running) == 256


def test_the_statistics_are_traced_four_times_a_call() -> None:
  """Two jaxprs, on a micro-batch and on twice its rows (the shapes, the pooling and every
  check), then the pass (its shapes and its loop body): 5 before the check of additivity."""
  traced = []

  def counted(p: Any, b: Any) -> Any:
    traced.append(1)
    return stats_fn(p, b)
  jax.jit(oa.microbatched(jax.value_and_grad(loss), 4, normalize="sum", global_stats=counted))(
      init_params(), make_batch())
  assert len(traced) <= 4


@pytest.mark.parametrize("where", ["one device", pytest.param("plain jit", marks=needs_8),
                                   pytest.param("shard_map", marks=needs_8)])
def test_stats_fn_is_traced_twice_and_fn_once_per_trace_of_the_step(where: str) -> None:
  """``stats_fn``: once per row count its check compares (a micro-batch, twice its rows), the
  pass evaluating the first trace; ``fn``: once, the loop evaluating that trace (once more on a
  mesh under plain jit, for the shard_map's out_specs). None on a call that reuses the trace.
  Before: ``stats_fn`` 4 times (6 on a mesh), ``fn`` twice (4 on a mesh)."""
  traced = {"stats_fn": 0, "fn": 0}

  def counted_stats(p: Any, b: Any) -> Any:
    traced["stats_fn"] += 1
    return stats_fn(p, b)

  def counted_loss(p: Any, b: Any, stats: Any) -> jax.Array:
    traced["fn"] += 1
    return loss(p, b, stats=stats)

  params, batch = init_params(), make_batch()
  options = dict(normalize="sum", global_stats=counted_stats)
  fn = oa.microbatched(jax.value_and_grad(counted_loss), 4, **options)
  if where == "shard_map":
    inner = oa.microbatched(jax.value_and_grad(counted_loss), 4, axis_name="data", **options)
    fn = jax.shard_map(lambda p, b: inner(lax.pcast(p, "data", to="varying"), b), mesh=mesh8(),
                       in_specs=(P(), P("data")), out_specs=P())
  if where != "one device":
    batch = on_devices(8, batch, mesh8())
  with jax.set_mesh(mesh8()) if where != "one device" else contextlib.nullcontext():
    step = jax.jit(fn)
    step(params, batch)
    assert traced == {"stats_fn": 2, "fn": 2 if where == "plain jit" else 1}
    step(params, batch)  # the step's trace is cached: nothing is traced again
  assert traced == {"stats_fn": 2, "fn": 2 if where == "plain jit" else 1}


_X = jnp.asarray(np.random.default_rng(5).normal(size=(16, 6)), jnp.float32)
_M = jnp.asarray(np.random.default_rng(6).random(16) < 0.6, jnp.float32)
# (statistic of (x, m), linear in the rows?) The review's (issue 74) and others of their kinds.
_STATISTICS = {
    "masked mean": (lambda x, m: jnp.sum(x[:, 0] * m) / jnp.sum(m), False),
    "mean where": (lambda x, m: jnp.mean(x[:, 0], where=m > 0), False),
    "sum times 1/n": (lambda x, m: jnp.sum(x[:, 0]) * (1 / x.shape[0]), False),
    "reciprocal": (lambda x, m: 1 / jnp.sum(m), False),
    "norm": (lambda x, m: jnp.linalg.norm(x[:, 0]), False),
    "std": (lambda x, m: jnp.std(x, 0), False),
    "median": (lambda x, m: jnp.median(x[:, 0]), False),
    "max in a cond": (lambda x, m: lax.cond(True, lambda: jnp.max(x[:, 0]), lambda: 0.0), False),
    "a count or a constant, by a cond": (lambda x, m: lax.cond(
        False, lambda: jnp.sum(m), lambda: jnp.ones((), m.dtype)), False),
    "a count squared by a scan's carry": (lambda x, m: lax.scan(
        lambda c, _: (c * jnp.sum(m), c * jnp.sum(m)), jnp.ones((), m.dtype), None, length=2)[1],
        False),
    "a count, then a constant, from a scan": (lambda x, m: lax.scan(
        lambda c, _: (jnp.ones((), m.dtype), c), jnp.sum(m), None, length=2)[1], False),
    "counts added up by a scan from zeros": (lambda x, m: lax.scan(
        lambda c, w: (c + jnp.sum(x * w, 0), None), jnp.zeros(6), jnp.eye(2, 6))[0], True),
    "a count squared by a scan from zeros": (lambda x, m: lax.scan(
        lambda c, _: (jnp.sqrt(c) * jnp.sum(m) + jnp.sum(m), None), jnp.zeros((), m.dtype), None,
        length=3)[0], False),
    "a count plus cos(0), computed in a scan over the rows": (lambda x, m: lax.scan(
        lambda c, r: (jnp.cos(c), None), jnp.zeros((), m.dtype), x)[0] + jnp.sum(m), False),
    "a sum rounded to fp8": (lambda x, m: lax.reduce_precision(jnp.sum(x, 0), 2, 2), False),
    "a sum cast to fp8": (lambda x, m: jnp.sum(x, 0).astype(jnp.float8_e4m3fn), False),
    "counts added into ones": (lambda x, m: jnp.ones(3).at[jnp.argmax(x[:, :3], -1)].add(m),
                               False),
    "counts added into zeros": (lambda x, m: jnp.zeros(3).at[jnp.argmax(x[:, :3], -1)].add(m),
                                True),
    "a count carried by a scan from a count": (lambda x, m: lax.scan(
        lambda c, _: (c + jnp.sum(m), None), jnp.sum(m), None, length=2)[0], True),
    "count plus one": (lambda x, m: jnp.sum(m) + 1.0, False),
    "centred": (lambda x, m: jnp.sum((x[:, 0] - jnp.sum(x[:, 0])) ** 2), False),
    "cumsum": (lambda x, m: jnp.sum(jnp.cumsum(x[:, 0])), False),
    "count": (lambda x, m: jnp.sum(m), True),
    "int count": (lambda x, m: jnp.sum(m > 0).astype(jnp.int32), True),
    "histogram": (lambda x, m: jnp.bincount((x[:, 0] > 0).astype(jnp.int32), m, length=2), True),
    "sum of sums": (lambda x, m: jnp.sum(x, 0).sum() + 2.0 * jnp.sum(m), True),
    "x.T @ m": (lambda x, m: x.T @ m, True),
    "mean over features": (lambda x, m: jnp.sum(jnp.mean(x, 1) * m), True),
    "per row": (lambda x, m: m, True),
    # An adversarial review's (issue 74): traces that change with the rows, loops over them,
    # rows paired or shifted, counts passed into calls, constants, a cast to bool; linear ones
    # refused for a literal zero or a NaN.
    "max beside a Python loop": (lambda x, m: jnp.max(x[:, 0]) + jnp.stack(
        [m[i] for i in range(m.shape[0])]).sum(), False),
    "rows mixed by a Python loop, per row": (lambda x, m: jnp.stack(
        [x[i, 0] * x[(i + 1) % x.shape[0], 0] for i in range(x.shape[0])]), False),
    "rows mixed in a scan, per row": (lambda x, m: lax.scan(
        lambda c, r: (r[0], r[0] * c), 0.0, x)[1], False),
    "a count added as often as the max says": (lambda x, m: lax.while_loop(
        lambda c: c[1] < 4 * jnp.max(x[:, 0]), lambda c: (c[0] + jnp.sum(m), c[1] + 1.0),
        (0.0, 0.0))[0], False),
    "max in a fori_loop": (lambda x, m: lax.fori_loop(
        0, x.shape[0], lambda i, c: jnp.maximum(c, x[i, 0]), -jnp.inf), False),
    "norm by a scan": (lambda x, m: jnp.sqrt(lax.scan(
        lambda c, r: (c + r[0] ** 2, None), 0.0, x)[0]), False),
    "pairs of rows": (lambda x, m: jnp.sum((x[:, 0] > 0)[:, None] == (x[:, 0] > 0)[None, :]),
                      False),
    "x @ x.T": (lambda x, m: jnp.sum(x @ x.T), False),
    "diff": (lambda x, m: jnp.sum(jnp.abs(jnp.diff(x[:, 0]))), False),
    "rows from the second": (lambda x, m: jnp.sum(x[1:, 0]), False),
    "position weights": (lambda x, m: jnp.sum(x[:, 0] * jnp.arange(x.shape[0])), False),
    "rows paired by a reshape": (lambda x, m: jnp.sum(jnp.max(x[:, 0].reshape(-1, 2), 1)), False),
    "mean in a jit": (lambda x, m: jax.jit(lambda s, n: s / n)(jnp.sum(x[:, 0]), x.shape[0]),
                      False),
    "mean in a cond": (lambda x, m: lax.cond(True, lambda s, n: s / n, lambda s, n: s,
                                             jnp.sum(x[:, 0]), x.shape[0]), False),
    "mean by an array": (lambda x, m: jnp.sum(x[:, :2], 0) / np.full(2, x.shape[0], np.float32),
                         False),
    "a constant": (lambda x, m: jnp.float32(1.0), False),
    "count beside a constant": (lambda x, m: jnp.stack([jnp.sum(m), jnp.float32(1.0)]), False),
    "any, as a bool": (lambda x, m: jnp.sum(x[:, 0] > 0.5).astype(bool).astype(jnp.int32),
                       False),
    "Python sum": (lambda x, m: sum(jnp.sum(x[:, i] > 0) for i in range(3)), True),
    "jnp.histogram": (lambda x, m: jnp.histogram(x[:, 0], bins=3, range=(-2, 2))[0], True),
    "tokens flattened": (lambda x, m: jnp.sum(x.reshape(-1) > 0), True),
    "counts added to jnp.zeros": (lambda x, m: jnp.zeros(2) + jnp.stack(
        [jnp.sum(m), jnp.sum(x[:, 0] > 0)]), True),
    "a count, or zeros, by a where": (lambda x, m: jnp.where(x.shape[1] > 3, jnp.sum(
        x > 0, 0), jnp.zeros(6, jnp.int32)), True),
    "per token, flattened": (lambda x, m: (x > 0).reshape(-1).astype(jnp.int32), True),
    "the rows' count itself": (lambda x, m: jnp.array(x.shape[0]), True),
    "fractions summed, cut to int": (lambda x, m: jnp.sum(x[:, 0] ** 2).astype(jnp.int32), False),
    "a one-hot count in floats, cast to int": (lambda x, m: jnp.sum(jax.nn.one_hot(
        (x[:, 0] > 0).astype(jnp.int32), 2) * (m > 0)[:, None], 0).astype(jnp.int32), True),
    # Constants laid along the rows: evenly (a broadcast), or by their count (an adversary's).
    "weights, broadcast": (lambda x, m: jnp.full(x.shape[0], 2.0) @ m, True),
    "ones per row, beside the mask": (lambda x, m: jnp.ones((x.shape[0], 3)) * m[:, None], True),
    "ones, rows by rows": (lambda x, m: jnp.ones((x.shape[0],) * 2) @ m, False),
    "ones, a row more": (lambda x, m: jnp.sum(jnp.ones(x.shape[0] + 1)) + jnp.sum(m), False),
    "row 0, by .at[0].set": (lambda x, m: jnp.zeros(x.shape[0]).at[0].set(1.0) @ x[:, 0], False),
    "row 0, by a pad": (lambda x, m: jnp.pad(jnp.ones(1), (0, x.shape[0] - 1)) @ x[:, 0], False),
    "row 0, by dynamic_update_slice": (lambda x, m: lax.dynamic_update_slice(
        jnp.zeros(x.shape[0]), jnp.ones(1), (0,)) @ x[:, 0], False),
    "decay weights, by a fori_loop": (lambda x, m: lax.fori_loop(
        0, x.shape[0], lambda i, w: w.at[i].set(0.9 ** i), jnp.ones(x.shape[0])) @ m, False),
    "decay weights, a scan's carry passed on as its ys": (lambda x, m: lax.scan(
        lambda c, r: (c * 0.9, c), 1.0, jnp.ones(x.shape[0]))[1] @ m, False),
    "a power, by a loop over the rows": (lambda x, m: lax.fori_loop(
        0, x.shape[0], lambda i, c: c * 0.9, 1.0) * jnp.sum(m), False),
    "a power of the rows' count": (lambda x, m: jnp.float32(0.9) ** x.shape[0] * jnp.sum(m),
                                   False),
    "an entry at the rows' count": (lambda x, m: jnp.arange(99.0)[x.shape[0]] * jnp.sum(m), False),
    # Traced on the whole batch's rows, read step by step (a second adversarial review's).
    "the first 8 rows": (lambda x, m: jnp.sum(m[:8]), False),
    "ones, as many as min(n, 8)": (lambda x, m: jnp.sum(jnp.ones(min(x.shape[0], 8))), False),
    "rows mixed by a reshape": (lambda x, m: jnp.sum(x.reshape(6, -1)[0]), False),
    "the flattened rows' first n entries": (lambda x, m: jnp.sum(x.reshape(-1)[:x.shape[0]]),
                                            False),
    "rows shifted by a tile": (lambda x, m: jnp.sum(jnp.tile(m, 2)[1:x.shape[0] + 1] * m), False),
    "rows chosen by unsigned indices": (lambda x, m: jnp.sum(
        m[(x[:, 0] > 0).astype(jnp.uint32)]), False),
    "rows overwritten by unsigned indices": (lambda x, m: jnp.sum(
        m.at[(x[:, 0] > 0).astype(jnp.uint32)].set(0.0)), False),
    "a segment_sum into a segment per row": (lambda x, m: jnp.sum(jax.ops.segment_sum(
        m, (x[:, 0] > 0).astype(jnp.int32), num_segments=x.shape[0]) * m), False),
    "top_k across the rows": (lambda x, m: jnp.sum(lax.top_k(x[:, 0], x.shape[0])[1]), False),
    "qr of the rows": (lambda x, m: jnp.sum(jnp.linalg.qr(x[:, :2])[0]), False),
    "a while loop as long as a sum says": (lambda x, m: lax.while_loop(
        lambda c: c < 100.0, lambda c: c * 2.0, jnp.sum(m + 1.0)), False),
    "a count divided as integers": (lambda x, m: lax.div(jnp.sum(m.astype(jnp.int32)), 3), False),
    "a sum rounded to two mantissa bits": (lambda x, m: lax.reduce_precision(
        jnp.sum(x[:, 0]), 8, 1), False),
    "a sum picked by a count": (lambda x, m: jnp.sum(x, 0).at[jnp.sum(
        m.astype(jnp.uint32))].get(mode="clip"), False),
    # A third review's: shifts that keep the shape, writes in place, Python logic in parameters.
    "rows shifted by a pad of -1 and 1": (lambda x, m: jnp.sum(lax.pad(
        m, 0.0, [(-1, 1, 0)]) * m), False),
    "rows added at fixed places, .at[:n].add": (lambda x, m: jnp.zeros(30).at[:x.shape[0]].add(
        m), False),
    "a column chosen by the rows' count": (lambda x, m: jnp.sum(x[:, (x.shape[0] // 4) % 6]),
                                           False),
    "a power chosen by the rows' count": (lambda x, m: jnp.sum(
        x[:, 0] ** (3 if x.shape[0] > 8 else 2)), False),
    "as many copies as the rows' count says": (lambda x, m: jnp.sum(
        jnp.stack([m] * (2 if x.shape[0] > 8 else 3))), False),
    "as many branches as the rows' count says": (lambda x, m: lax.switch(2, [
        lambda v, i=i: i * jnp.sum(v) for i in range(3 if x.shape[0] > 8 else 2)], m), False),
    "positions along the features": (lambda x, m: jnp.sum(
        lax.broadcasted_iota(jnp.float32, x.shape, 1) * x), True),
    "a per-row sort, a per-row pick": (lambda x, m: jnp.sum(jnp.take_along_axis(jnp.sort(
        x, axis=1), (x[:, :1] > 0).astype(jnp.int32), axis=1)), True),
    "positions, by a Python loop": (lambda x, m: jnp.stack(
        [jnp.float32(1.0) * i for i in range(x.shape[0])]) @ m, False),
}


@pytest.mark.parametrize("name", list(_STATISTICS))
def test_a_statistic_is_linear_in_the_rows_or_refused(name: str) -> None:
  """Accepted exactly where the whole batch's statistic is the sum of the micro-batches' (the
  reference: both computed here, in float64); refused, naming the leaf and the fix, where it
  is not: ratios, reciprocals, norms, a sort, a max inside a ``cond``, a constant added."""
  stat, linear = _STATISTICS[name]
  x64, m64 = np.asarray(_X, np.float64), np.asarray(_M, np.float64)
  pool = lambda s, rows: np.sum(s, 0) if np.ndim(s) and np.shape(s)[0] % rows == 0 else s
  with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):  # (a TPU has no f64 fp8)
    whole = pool(np.asarray(stat(jnp.asarray(x64), jnp.asarray(m64))), 16)
    parts = sum(pool(np.asarray(stat(jnp.asarray(x64[i::4]), jnp.asarray(m64[i::4]))), 4)
                for i in range(4))
  assert np.allclose(whole, parts, rtol=1e-9) == linear  # the planted case

  def loss(w, x, m, stats):
    return jnp.sum((x @ w) ** 2 * m) * (1.0 + 1e-3 * jnp.sum(stats["s"]).astype(jnp.float32))

  fn = oa.microbatched(jax.value_and_grad(loss), 4, batch_argnums=(1, 2), normalize="sum",
                       global_stats=lambda w, x, m: {"s": stat(x, m)})
  w = jnp.linspace(-1.0, 1.0, 6)
  if not linear:
    with pytest.raises(ValueError, match=r"not a sum over rows: its statistic at \['s'\] is"
                       r" .*Return sums and counts, divide in the loss"):
      fn(w, _X, _M)
    return
  value, _ = fn(w, _X, _M)
  expected = loss(w, _X, _M, {"s": jnp.asarray(whole, jnp.float32)})
  np.testing.assert_allclose(value, expected, rtol=1e-5)


def test_a_statistic_squeezed_on_one_row_is_refused_naming_its_rank() -> None:
  """A micro-batch of one row: `jnp.squeeze` drops the rows' axis there and not on the whole
  batch, so the two traces' ranks differ (the walk compared shapes axis by axis and crashed)."""
  loss = lambda w, x, m, stats: jnp.sum((x @ w) * m) * jnp.sum(stats["s"])
  fn = oa.microbatched(jax.value_and_grad(loss), 16, batch_argnums=(1, 2), normalize="sum",
                       global_stats=lambda w, x, m: {"s": jnp.squeeze(x[:, :1])})
  with pytest.raises(ValueError, match=r"\['s'\] is a function of the rows' count \(`squeeze`'s"
                     r" rank"):
    fn(jnp.ones(6), _X, _M)


def test_a_stats_fn_closing_over_a_value_traced_outside_reads_it_as_a_constant() -> None:
  """A ``stats_fn`` that closes over an argument of the jitted step (a scale): both traces
  capture the one tracer, a constant of no rows (it crashed reading it as a number)."""
  loss = lambda w, x, m, stats: jnp.sum((x @ w) ** 2 * m) * jnp.sum(stats["s"])

  @jax.jit
  def step(w, x, m, scale):
    return oa.microbatched(jax.value_and_grad(loss), 4, batch_argnums=(1, 2), normalize="sum",
                           global_stats=lambda w, x, m: {"s": jnp.sum(m) * scale})(w, x, m)

  w = jnp.linspace(-1.0, 1.0, 6)
  value, grads = step(w, _X, _M, 3.0)
  whole, whole_grads = jax.value_and_grad(loss)(w, _X, _M, {"s": jnp.sum(_M) * 3.0})
  np.testing.assert_allclose(value, whole, rtol=1e-5)
  np.testing.assert_allclose(grads, whole_grads, rtol=1e-5)
