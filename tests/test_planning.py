"""`plan_k` against compiled peaks computed here, independently.

Every candidate is compiled in the test itself (`jax.jit(...).lower(...)
.compile().memory_analysis()`, peak = argument + output + temp - alias); the
plan must pick the smallest candidate within the limit, compile no more than
ceil(log2(n)) + 1 of the n candidates (counted as calls of `make_step`), and
run nothing. In-step with `microbatched`, across steps with `accumulate`, on
`ShapeDtypeStruct`s, with a donating jitted step, on an 8-device mesh
(tests/conftest.py forces 8 host devices), and on a step whose peaks are not
monotone in k by construction.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum as oa
from optax_accum.planning import HEADROOM, Plan, PlanRow, compiled_peak_bytes
from tests._reference import premise

D_IN, HIDDEN = 32, 64
BATCH = 256
OPT = optax.adam(1e-3)
NO_PARAMS = jax.ShapeDtypeStruct((0,), jnp.float32)  # argument 0 of a fake step: no bytes

cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="pins XLA:CPU's numbers")


def loss(params: dict, batch: dict) -> jax.Array:
  h = jnp.tanh(batch["x"] @ params["w1"])
  h = jnp.tanh(h @ params["w2"])
  return jnp.mean((h @ params["w3"] - batch["y"]) ** 2)


def param_types() -> dict:
  f32 = jnp.float32
  return {"w1": jax.ShapeDtypeStruct((D_IN, HIDDEN), f32),
          "w2": jax.ShapeDtypeStruct((HIDDEN, HIDDEN), f32),
          "w3": jax.ShapeDtypeStruct((HIDDEN,), f32)}


def batch_types(rows: int = BATCH, sharding: Any = None) -> dict:
  return {"x": jax.ShapeDtypeStruct((rows, D_IN), jnp.float32, sharding=sharding),
          "y": jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=sharding)}


class Counting:
  """``make_step`` that counts its calls and the batch rows each step was traced with."""

  def __init__(self, make: Callable[[int], Callable[..., Any]]) -> None:
    self.make, self.ks, self.rows = make, [], []

  def __call__(self, k: int) -> Callable[..., Any]:
    self.ks.append(k)
    step = self.make(k)

    def traced(params, opt_state, batch):
      self.rows.append(batch["x"].shape[0])
      return step(params, opt_state, batch)
    return traced


def in_step(k: int) -> Callable[..., Any]:
  grad_fn = oa.microbatched(jax.value_and_grad(loss), k)

  def step(params, opt_state, batch):
    value, grads = grad_fn(params, batch)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value
  return step


def across(k: int) -> Callable[..., Any]:
  tx = oa.accumulate(k, OPT)

  def step(params, opt_state, micro):
    value, grads = jax.value_and_grad(loss)(params, micro)
    params, opt_state = oa.update_and_apply(tx, grads, opt_state, params)
    return params, opt_state, value
  return step


#: One jitted step per (mode, k, donated), so a candidate compiled once is not recompiled
#: (jax caches a jitted function's compiles): the peaks below and the plans then share them.
_JITTED: dict[tuple[str, int, bool], Any] = {}


def cached(mode: str, donate: bool = False) -> Callable[[int], Any]:
  make = {"in_step": in_step, "across": across}[mode]

  def get(k: int) -> Any:
    key = (mode, k, donate)
    if key not in _JITTED:
      _JITTED[key] = jax.jit(make(k), donate_argnums=(0, 1) if donate else ())
    return _JITTED[key]
  return get


class Calls:
  """``make_step`` that records the k it is called with."""

  def __init__(self, make: Callable[[int], Any]) -> None:
    self.make, self.ks = make, []

  def __call__(self, k: int) -> Any:
    self.ks.append(k)
    return self.make(k)


def independent_peak(step: Callable[..., Any], *args: Any) -> int:
  """The peak, by the definition, from a compile done here."""
  lowered = (step if hasattr(step, "lower") else jax.jit(step)).lower(*args)
  m = lowered.compile().memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes)


def bound(n: int) -> int:
  return math.ceil(math.log2(n)) + 1


def limits_between(peaks: dict[int, int]) -> list[int]:
  """A limit equal to each distinct peak and one byte below it, plus one above all."""
  values = sorted(set(peaks.values()))
  return [*values, *(v - 1 for v in values), values[-1] * 2]


def expected_k(peaks: dict[int, int], limit: int) -> int | None:
  return min((k for k, p in peaks.items() if p <= limit), default=None)


def check_plan(plan: Plan, make: Calls | Counting, peaks: dict[int, int], limit: int) -> None:
  assert plan.k == expected_k(peaks, limit)
  assert plan.peak_bytes == peaks[plan.k] <= limit == plan.memory_limit
  assert plan.micro_batch_size == BATCH // plan.k
  assert len(make.ks) == len(set(make.ks)) == len(plan.table) <= bound(len(plan.candidates))
  assert [r.k for r in plan.table] == sorted(make.ks)
  for row in plan.table:
    assert row.peak_bytes == peaks[row.k] and row.fits == (peaks[row.k] <= limit), row
    assert row.micro_batch_size == BATCH // row.k
  assert plan.monotone and [r.note for r in plan.table if r.note] == ["chosen"]


def falling(peaks: dict[int, int], *ks: int) -> None:
  """The premise of a test that expects a k: the compiled peaks fall strictly along ``ks``
  (XLA:CPU's buffer assignment for this model; a TPU's gave one peak for every k)."""
  premise(all(peaks[a] > peaks[b] for a, b in itertools.pairwise(ks)),
          f"compiled peaks that fall strictly with k along {ks}:"
          f" {[peaks[k] for k in ks]}")


@pytest.fixture(scope="module")
def state_types() -> Any:
  return jax.eval_shape(OPT.init, param_types())


@pytest.fixture(scope="module")
def in_step_peaks(state_types) -> dict[int, int]:
  args = (param_types(), state_types, batch_types())
  return {k: independent_peak(cached("in_step")(k), *args)
          for k in (1, 2, 4, 8, 16, 32, 64, 128, 256)}


@pytest.fixture(scope="module")
def across_peaks(state_types) -> dict[int, int]:
  state = jax.eval_shape(oa.accumulate(2, OPT).init, param_types())
  return {k: independent_peak(cached("across")(k), param_types(), state, batch_types(BATCH // k))
          for k in (1, 2, 4, 8, 16, 32, 64, 128, 256)}


# ----------------------------------------------------------------------------- in-step

def test_in_step_picks_the_smallest_k_within_every_limit(in_step_peaks, state_types):
  ks = sorted(in_step_peaks)
  falling(in_step_peaks, *ks)
  args = (param_types(), state_types, batch_types())
  fresh = Counting(in_step)  # steps the planner has never seen, traced on the whole batch
  check_plan(oa.plan_k(fresh, *args, batch_argnums=2, memory_limit=in_step_peaks[8]),
             fresh, in_step_peaks, in_step_peaks[8])
  assert set(fresh.rows) == {BATCH}
  for limit in limits_between(in_step_peaks):  # the same compiled candidates, every limit
    make = Calls(cached("in_step"))
    if expected_k(in_step_peaks, limit) is None:
      with pytest.raises(ValueError, match="no candidate k fits"):
        oa.plan_k(make, *args, batch_argnums=2, memory_limit=limit)
      assert len(make.ks) <= bound(len(ks)) and max(make.ks) == BATCH
      continue
    plan = oa.plan_k(make, *args, batch_argnums=2, memory_limit=limit)
    assert plan.candidates == tuple(ks)  # every divisor of 256
    check_plan(plan, make, in_step_peaks, limit)


def test_the_search_is_exact_and_within_its_compile_bound_for_any_count():
  """A monotone fake step (peak = 4 bytes of input + 4 bytes per output element)."""
  elems = {k: 1200 - 100 * i for i, k in enumerate((1, 2, 3, 4, 6, 8, 12, 24, 48))}
  steps = {k: jax.jit(fake_step(elems)(k)) for k in elems}
  x = jax.ShapeDtypeStruct((48,), jnp.float32)
  peaks = {k: independent_peak(steps[k], NO_PARAMS, x) for k in elems}
  for n in range(1, len(elems) + 1):
    ks = sorted(elems)[:n]
    sub = {k: peaks[k] for k in ks}
    for limit in limits_between(sub):
      make = Calls(steps.__getitem__)
      want = expected_k(sub, limit)
      if want is None:
        with pytest.raises(ValueError, match="no candidate k fits"):
          oa.plan_k(make, NO_PARAMS, x, memory_limit=limit, candidates=ks)
      else:
        plan = oa.plan_k(make, NO_PARAMS, x, memory_limit=limit, candidates=ks)
        assert (plan.k, plan.peak_bytes) == (want, sub[want]) and plan.monotone
        assert plan.table == tuple(
            PlanRow(k, 48 // k, sub[k], sub[k] <= limit, "chosen" if k == want else "")
            for k in sorted(make.ks))
      assert len(make.ks) == len(set(make.ks)) <= bound(n), (n, limit, make.ks)


def test_arrays_plan_as_their_shape_dtype_structs_and_nothing_runs(in_step_peaks, state_types):
  ran = []

  def make(k):
    step = in_step(k)

    def spied(params, opt_state, batch):
      jax.debug.callback(lambda: ran.append(k))
      return step(params, opt_state, batch)
    return spied

  rng = np.random.default_rng(0)
  params = {n: jnp.asarray(rng.normal(size=s.shape), s.dtype) for n, s in param_types().items()}
  batch = {n: jnp.asarray(rng.normal(size=s.shape), s.dtype) for n, s in batch_types().items()}
  limit = in_step_peaks[8] + 1000
  falling(in_step_peaks, 4, 8, 16)
  premise(in_step_peaks[4] > limit and independent_peak(
      make(8), param_types(), state_types, batch_types()) == in_step_peaks[8],
      "a step with a jax.debug.callback has the plain step's compiled peak, and k=4's is"
      " more than 1000 bytes above k=8's")
  concrete = oa.plan_k(make, params, OPT.init(params), batch, batch_argnums=2,
                       memory_limit=limit, candidates=[4, 8, 16])
  abstract = oa.plan_k(make, param_types(), state_types, batch_types(), batch_argnums=-1,
                       memory_limit=limit, candidates=[4, 8, 16])
  assert concrete.k == abstract.k == 8
  assert concrete.table == abstract.table
  assert ran == []  # compiled, never run


# ----------------------------------------------------------------------------- across steps

def test_across_steps_compiles_the_micro_batch(across_peaks):
  ks = sorted(across_peaks)
  state = jax.eval_shape(oa.accumulate(2, OPT).init, param_types())
  args = (param_types(), state, batch_types())
  fresh = Counting(across)
  plan = oa.plan_k(fresh, *args, batch_argnums=2, memory_limit=across_peaks[4] - 1,
                   across_steps=True)
  assert fresh.rows == [BATCH // k for k in fresh.ks]  # cut to global // k rows
  assert plan.k == expected_k(across_peaks, across_peaks[4] - 1) > 4
  assert plan.peak_bytes == across_peaks[plan.k]
  for limit in (across_peaks[4] - 1, across_peaks[16], across_peaks[64] + 1):
    make = Calls(cached("across"))
    plan = oa.plan_k(make, *args, batch_argnums=2, memory_limit=limit, across_steps=True)
    assert plan.candidates == tuple(ks)
    assert plan.k == expected_k(across_peaks, limit) > 1
    assert plan.peak_bytes == across_peaks[plan.k]
    assert len(make.ks) <= bound(len(ks))
    for row in plan.table:
      assert row.peak_bytes == across_peaks[row.k] and row.micro_batch_size == BATCH // row.k


# ----------------------------------------------------------------------------- donation

def test_a_donating_jitted_step_is_lowered_as_it_is(in_step_peaks, state_types):
  args = (param_types(), state_types, batch_types())
  donated = {}
  for k in (1, 2, 4, 8):
    m = cached("in_step", donate=True)(k).lower(*args).compile().memory_analysis()
    assert m.alias_size_in_bytes > 0
    donated[k] = independent_peak(cached("in_step", donate=True)(k), *args)
    assert donated[k] < in_step_peaks[k]
  falling(donated, 1, 2)
  premise(in_step_peaks[2] > donated[2] >= in_step_peaks[4],
          "at k=2's donated peak, k=2 fits only donating and k=4 fits plain")
  # The donated peak of k = 2 is below its plain peak: only the donating step fits at k = 2.
  limit = donated[2]
  made = []

  def make(k):
    made.append(k)
    return cached("in_step", donate=True)(k)  # a jax.jit object with donate_argnums

  plan = oa.plan_k(make, *args, batch_argnums=2, memory_limit=limit, candidates=[1, 2, 4, 8])
  assert (plan.k, plan.peak_bytes) == (2, donated[2]) == (expected_k(donated, limit), limit)
  assert len(made) <= bound(4)
  plain = oa.plan_k(cached("in_step"), *args, batch_argnums=2, memory_limit=limit,
                    candidates=[1, 2, 4, 8])
  plain_peaks = {k: in_step_peaks[k] for k in (1, 2, 4, 8)}
  assert plain.k == expected_k(plain_peaks, limit) > 2
  assert plain.peak_bytes == in_step_peaks[plain.k]


# ----------------------------------------------------------------------------- a mesh

@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py)")
@pytest.mark.parametrize("across_steps", [False, True])
def test_per_device_peaks_under_an_8_device_mesh(across_steps):
  rows = 8 * 256  # 256 rows per device
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  data, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep),
                        param_types())
  make_step = across if across_steps else in_step
  init = oa.accumulate(2, OPT).init if across_steps else OPT.init
  steps = {k: jax.jit(make_step(k)) for k in (1, 2, 4, 8)}
  with jax.set_mesh(mesh):
    state = jax.eval_shape(init, params)
    batch = batch_types(rows, data)
    trivial = oa.plan_k(lambda k: lambda p, b: b["x"].sum(), params, batch, memory_limit=2**30)
    assert trivial.candidates == (1, 2, 4, 8, 16, 32, 64, 128, 256)  # divisors of 256

    def args_for(k):
      return (params, state, batch_types(rows // k, data) if across_steps else batch)

    peaks = {k: independent_peak(step, *args_for(k)) for k, step in steps.items()}
    # Per device: the replicated params and state, and an eighth of the batch.
    m = steps[4].lower(*args_for(4)).compile().memory_analysis()
  unsharded = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), args_for(4))
  one = jax.jit(make_step(4)).lower(*unsharded).compile().memory_analysis()
  batch_bytes = sum(math.prod(s.shape) * 4 for s in jax.tree.leaves(unsharded[2]))
  assert m.argument_size_in_bytes == one.argument_size_in_bytes - batch_bytes + batch_bytes // 8
  with jax.set_mesh(mesh):
    assert peaks[1] > peaks[2] > peaks[4] > peaks[8]  # premise
    make = Calls(steps.__getitem__)
    plan = oa.plan_k(make, params, state, batch, batch_argnums=2, across_steps=across_steps,
                     memory_limit=(peaks[2] + peaks[4]) // 2, candidates=[1, 2, 4, 8])
  # The planner's cut keeps the batch's sharding, or its peaks would not be these.
  assert (plan.k, plan.peak_bytes, plan.micro_batch_size) == (4, peaks[4], rows // 4)
  assert make.ks == [4, 2] and all(r.peak_bytes == peaks[r.k] for r in plan.table)


# ----------------------------------------------------------------------------- monotonicity

def fake_step(out_elems: dict[int, int]) -> Callable[[int], Callable[..., Any]]:
  """Steps whose peak is set per k: argument + an output of ``out_elems[k]`` floats."""
  def make(k):
    return lambda params, x: jnp.zeros((out_elems[k],), jnp.float32) + jnp.sum(x)
  return make


def test_peaks_that_are_not_monotone_are_flagged_and_only_a_checked_k_is_returned():
  x = jax.ShapeDtypeStruct((64,), jnp.float32)  # 256 bytes
  # k = 8 is compiled first, then 32, then 16, whose peak is above k = 8's;
  # k = 2 would fit but is never compiled.
  elems = {1: 4000, 2: 100, 4: 3000, 8: 2000, 16: 2500, 32: 500, 64: 400}
  peaks = {k: independent_peak(fake_step(elems)(k), NO_PARAMS, x) for k in elems}
  premise(peaks[32] <= 4000 < min(peaks[8], peaks[16]) and peaks[2] <= 4000,
          f"a step's compiled peak is its argument and output bytes, unpadded: {peaks}")
  made = []

  def make(k):
    made.append(k)
    return fake_step(elems)(k)

  plan = oa.plan_k(make, NO_PARAMS, x, memory_limit=4 * 1000, candidates=sorted(elems))
  assert made == [8, 32, 16]
  assert plan.k == 32 and plan.peak_bytes == peaks[32] and not plan.monotone
  rows = {r.k: r for r in plan.table}
  assert rows[32].note == "chosen" and rows[32].fits
  assert rows[16].note.startswith("not monotone: peak above k=8's") and not rows[16].fits
  assert rows[8].note == ""
  assert "not monotone" in str(plan) and "candidates=" in str(plan)


def test_a_micro_batch_of_one_that_needs_more_than_two_is_flagged_when_nothing_fits():
  x = jax.ShapeDtypeStruct((4,), jnp.float32)
  elems = {1: 1000, 2: 300, 4: 500}  # as XLA can do for a micro-batch of one (k = 4)
  peaks = {k: independent_peak(fake_step(elems)(k), NO_PARAMS, x) for k in elems}
  premise(peaks[4] > peaks[2] < peaks[1],
          f"a step's compiled peak is its argument and output bytes, unpadded: {peaks}")
  with pytest.raises(ValueError) as info:  # k = 2 is compiled first, then k = 4
    oa.plan_k(fake_step(elems), NO_PARAMS, x, memory_limit=peaks[2] - 1)
  msg = str(info.value)
  assert f"smallest compiled peak is {peaks[2]:,} bytes" in msg and "at k=2" in msg
  assert "not monotone: peak above k=2's" in msg


# ----------------------------------------------------------------------------- the peak

@cpu_only
def test_xla_cpu_peak_memory_leaves_the_temporaries_out(in_step_peaks, state_types):
  for k, donate in ((1, False), (4, False), (4, True)):
    args = (param_types(), state_types, batch_types())
    compiled = cached("in_step", donate)(k).lower(*args).compile()
    m = compiled.memory_analysis()
    assert m.temp_size_in_bytes > 10_000
    ours = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    ours -= m.alias_size_in_bytes
    assert compiled_peak_bytes(compiled) == ours
    without_temps = ours - m.temp_size_in_bytes
    assert abs(m.peak_memory_in_bytes - without_temps) <= 64  # alignment, not temporaries
    assert m.peak_memory_in_bytes < ours - m.temp_size_in_bytes // 2


def test_str_renders_the_table(in_step_peaks, state_types):
  falling(in_step_peaks, 4, 8, 16)
  plan = oa.plan_k(cached("in_step"), param_types(), state_types, batch_types(),
                   batch_argnums=2, memory_limit=in_step_peaks[16], candidates=[4, 8, 16, 32])
  text = str(plan)
  assert text.startswith("plan_k: k = 16 (micro-batches of 16)")
  assert "peak (MiB)" in text and "fits" in text and "chosen" in text
  assert f"{in_step_peaks[16] / 2**20:.2f}" in text
  assert len(text.splitlines()) == 2 + len(plan.table)
  assert isinstance(plan.table[0], PlanRow) and plan.compile_s > 0


def test_numpy_integers_are_ints_like_every_other_entry_point(in_step_peaks, state_types):
  """A limit and candidates read from a numpy array (np.int64) plan like Python ints."""
  falling(in_step_peaks, 4, 8, 16)
  args = (param_types(), state_types, batch_types())
  ints = oa.plan_k(cached("in_step"), *args, batch_argnums=2, memory_limit=in_step_peaks[16],
                   candidates=[4, 8, 16])
  numpy = oa.plan_k(cached("in_step"), *args, batch_argnums=np.int64(2),
                    memory_limit=np.int64(in_step_peaks[16]),
                    candidates=np.array([4, 8, 16], np.int64))
  assert numpy.k == ints.k == 16 and numpy.table == ints.table
  assert all(type(row.k) is int for row in numpy.table)


# ----------------------------------------------------------------------------- bad input

def test_nothing_fits_names_the_smallest_peak_and_what_to_try(in_step_peaks, state_types):
  limit = in_step_peaks[256] - 1
  falling(in_step_peaks, 64, 128, 256)
  with pytest.raises(ValueError) as info:
    oa.plan_k(cached("in_step"), param_types(), state_types, batch_types(), batch_argnums=2,
              memory_limit=limit, candidates=[64, 128, 256])
  msg = str(info.value)
  assert f"{in_step_peaks[256]:,} bytes" in msg and "at k=256" in msg
  assert f"memory_limit={limit:,} bytes" in msg
  for hint in ("jax.checkpoint", "bf16", "sharding", "larger global batch"):
    assert hint in msg, hint


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="other backends report a limit")
def test_no_memory_limit_on_cpu_asks_for_one(state_types):
  with pytest.raises(ValueError, match=r"reports none.*pass `memory_limit`"):
    oa.plan_k(in_step, param_types(), state_types, batch_types(), batch_argnums=2)


def test_no_memory_limit_plans_within_headroom_of_the_smallest_device(
    monkeypatch, in_step_peaks, state_types):
  """``memory_limit=None``: HEADROOM (0.9) of the smallest ``bytes_limit`` the local
  devices report (devices that report one, faked here: XLA:CPU reports none)."""
  class Device:
    def __init__(self, stats):
      self.stats = stats

    def memory_stats(self):
      if self.stats is None:
        raise RuntimeError("no stats on this backend")
      return self.stats

  # The 0.9 decides: k=2's peak fits the smaller device's whole limit but not 90% of it.
  smallest = int(in_step_peaks[2] / 0.95)
  premise(in_step_peaks[4] <= int(HEADROOM * smallest),
          f"k=4's compiled peak is at most 0.9 / 0.95 of k=2's: {in_step_peaks[4]:,} and"
          f" {in_step_peaks[2]:,} bytes")
  devices = [Device({"bytes_limit": smallest}), Device(None), Device({}),
             Device({"bytes_limit": 4 * smallest})]
  monkeypatch.setattr(jax, "local_devices", lambda: devices)
  plan = oa.plan_k(cached("in_step"), param_types(), state_types, batch_types(),
                   batch_argnums=2, candidates=[1, 2, 4])
  assert plan.memory_limit == int(HEADROOM * smallest)
  assert plan.k == 4 and in_step_peaks[4] <= plan.memory_limit < in_step_peaks[2]


def test_bad_arguments_name_the_argument_and_the_fix(state_types):
  args = (param_types(), state_types, batch_types())
  with pytest.raises(ValueError, match=r"argument 2\['x'\] is a scalar"):
    oa.plan_k(in_step, *args[:2], {"x": jax.ShapeDtypeStruct((), jnp.float32)},
              batch_argnums=2, memory_limit=2**30)
  with pytest.raises(ValueError, match=r"disagree on the batch size.*256.*128"):
    oa.plan_k(in_step, args[0], args[1], {"x": batch_types()["x"],
                                          "y": batch_types(128)["y"]},
              batch_argnums=2, memory_limit=2**30)
  with pytest.raises(ValueError, match=r"disagree on the batch size"):
    oa.plan_k(lambda k: lambda p, a, b: a["x"].sum() + b["x"].sum(), args[0], batch_types(),
              batch_types(128), batch_argnums=(1, 2), memory_limit=2**30)
  for bad in (0, -1, True, float("nan"), "1GB"):
    with pytest.raises(ValueError, match="`memory_limit` must be a positive number of bytes"):
      oa.plan_k(in_step, *args, batch_argnums=2, memory_limit=bad)
  with pytest.raises(ValueError, match=r"`batch_argnums` contains 3, but .* 3 positional"):
    oa.plan_k(in_step, *args, batch_argnums=3, memory_limit=2**30)
  with pytest.raises(TypeError, match="`batch_argnums` must be an int"):
    oa.plan_k(in_step, *args, batch_argnums="2", memory_limit=2**30)
  with pytest.raises(ValueError, match=r"256 examples cannot be split into 3 .*"
                                       r"\(a k in `candidates`\)"):
    oa.plan_k(in_step, *args, batch_argnums=2, memory_limit=2**30, candidates=[2, 3])
  with pytest.raises(ValueError, match="`candidates` is empty"):
    oa.plan_k(in_step, *args, batch_argnums=2, memory_limit=2**30, candidates=[])
  with pytest.raises(TypeError, match="`make_step` must be a function"):
    oa.plan_k(None, *args, batch_argnums=2, memory_limit=2**30)


def test_a_step_that_fails_for_one_k_is_named(state_types):
  args = (param_types(), state_types, batch_types())

  def raises_at_4(k):
    if k == 4:
      raise NotImplementedError("no kernel for four")
    return in_step(k)

  with pytest.raises(RuntimeError, match=r"make_step\(4\) failed \(make_step\).*no kernel"):
    oa.plan_k(raises_at_4, *args, batch_argnums=2, memory_limit=2**30, candidates=[2, 4, 8])

  def traces_badly_at_4(k):
    step = in_step(k)
    if k == 4:
      return lambda p, s, b: step(p, s, {"x": b["x"][:, :3], "y": b["y"]})
    return step

  with pytest.raises(RuntimeError, match=r"(?s)make_step\(4\) failed \(lowering its step\).*"
                     r"leave 4 out of `candidates`"):
    oa.plan_k(traces_badly_at_4, *args, batch_argnums=2, memory_limit=2**30,
              candidates=[2, 4, 8])
