"""TPU speed probe: where the window's time goes (experiment, not a benchmark).

  python .tpu/speed.py 256      # N = 256 Mi f32 params in 8 leaves, adam, k = 4
"""
import json
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax
from jax import lax

import optax_accum as oa

OUT = os.environ.get("OUT", "/tmp/out")
os.makedirs(OUT, exist_ok=True)
N = int(float(sys.argv[1]) * 2**20) if len(sys.argv) > 1 else 256 * 2**20
WINDOWS = int(sys.argv[2]) if len(sys.argv) > 2 else 12
LEAVES, K = 8, 4
ADAM = optax.adam(1e-3)
TAG = os.environ.get("TAG", "")
LOG = open(f"{OUT}/speed{TAG}.txt", "a")
RESULTS = {}


def say(*a):
  s = " ".join(str(x) for x in a)
  print(s, flush=True)
  LOG.write(s + "\n")
  LOG.flush()


def tree(fill):
  return {f"w{i}": jnp.full((N // LEAVES,), fill * (i + 1), jnp.float32) for i in range(LEAVES)}


def hlo_facts(compiled):
  text = compiled.as_text()
  copies = [ln for ln in text.splitlines() if re.search(r"= \S+ copy(-start)?\(", ln)]
  big = [ln for ln in copies if re.search(r"f32\[(\d+)\]", ln)
         and int(re.search(r"f32\[(\d+)\]", ln).group(1)) >= N // LEAVES // 2]
  ma = compiled.memory_analysis()
  return {"copies": len(copies), "big_copies": len(big),
          "conditionals": text.count(" conditional("), "whiles": text.count(" while("),
          "temps_P": ma.temp_size_in_bytes / (4 * N),
          "text": text}


def time_program(name, step, state, k, hlo_file=None):
  params, grads = tree(0.01), tree(0.001)
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile()
  facts = hlo_facts(compiled)
  if hlo_file:
    with open(f"{OUT}/{hlo_file}", "w") as f:
      f.write(facts["text"])
  carry = [params, state]
  times = {"mid": [], "emit": [], "step": []}
  calls = 0
  for w in range(WINDOWS + 1):
    for _ in range(k or 4):
      phase = "step" if k is None else ("emit" if calls % k == k - 1 else "mid")
      t0 = time.perf_counter()
      carry = list(jax.block_until_ready(compiled(carry[0], carry[1], grads)))
      dt = time.perf_counter() - t0
      calls += 1
      if w:
        times[phase].append(dt)
  del carry
  res = {ph: statistics.median(ts) * 1e3 for ph, ts in times.items() if ts}
  res.update({k2: v for k2, v in facts.items() if k2 != "text"})
  RESULTS[name] = res
  say(f"{name:38s} " + " ".join(f"{ph} {v:8.3f} ms" for ph, v in res.items() if ph in times)
      + f" | copies {res['copies']} big {res['big_copies']} cond {res['conditionals']}"
      f" while {res['whiles']} temps {res['temps_P']:.2f}P")
  return compiled


def floor_and_copy():
  acc, g = tree(0.0), tree(0.001)
  f = jax.jit(lambda a, g: jax.tree.map(jnp.add, a, g), donate_argnums=(0,)).lower(acc, g).compile()
  for _ in range(3):
    acc = jax.block_until_ready(f(acc, g))
  ts = []
  for _ in range(30):
    t0 = time.perf_counter()
    acc = jax.block_until_ready(f(acc, g))
    ts.append(time.perf_counter() - t0)
  floor = statistics.median(ts) * 1e3
  src = jnp.arange(2**28, dtype=jnp.float32)
  dst = jnp.zeros_like(src)
  c = jax.jit(lambda d, s: s * 1.0, donate_argnums=(0,), keep_unused=True).lower(dst, src).compile()
  cs = []
  for _ in range(20):
    t0 = time.perf_counter()
    dst = jax.block_until_ready(c(dst, src))
    cs.append(time.perf_counter() - t0)
  bw = 2 * 2**30 / statistics.median(cs) / 1e9
  floor_bw = 3 * 4 * N / bw / 1e6
  RESULTS["floor"] = {"measured_ms": floor, "copy_GBps": bw, "floor_from_copy_ms": floor_bw}
  say(f"N={N} ({N / 2**20:g}M): copy bw {bw:.1f} GB/s -> 3P floor {floor_bw:.3f} ms;"
      f" measured acc+=g {floor:.3f} ms")
  del acc, g, src, dst


# ------------------------------------------------------------------ minimal designs
def adam_emit(p, inner, buf):
  red = jax.tree.map(lambda b: b * (1.0 / K), buf)
  u, inner2 = ADAM.update(red, inner, p)
  return optax.apply_updates(p, u), inner2


def add(acc, g, mini):
  return jax.tree.map(lambda a, x: jnp.where(mini == 0, 0.0, a) + x, acc, g)


def branch(design, pred, emit_fn, mid_fn, *ops):
  if design == "cond":  # mid is branch 0
    return lax.cond(pred, emit_fn, mid_fn, *ops)
  if design == "emit0":
    return lax.switch(jnp.where(pred, 0, 1), [emit_fn, mid_fn], *ops)
  raise ValueError(design)


def apply_step(design, add_where):
  def step(p, st, g):
    acc, inner, mini = st
    count = mini + 1
    emits = count >= K
    if add_where == "outside":
      buf = add(acc, g, mini)
      if design == "while":
        _, p2, inner2 = lax.while_loop(
            lambda c: c[0], lambda c: (False, *adam_emit(c[1], c[2], buf)), (emits, p, inner))
      else:
        p2, inner2 = branch(design, emits, adam_emit, lambda p, i, b: (p, i), p, inner, buf)
      acc2 = buf
    else:  # the add in the mid branch; the emitting branch folds it into the update
      def emit_in(p, i, a):
        p2, i2 = adam_emit(p, i, add(a, g, mini))
        return p2, i2, a
      p2, inner2, acc2 = branch(design, emits, emit_in, lambda p, i, a: (p, i, add(a, g, mini)),
                                p, inner, acc)
    return p2, (acc2, inner2, jnp.where(emits, 0, count))
  return step


def two_conds_step(order):
  """Two conditionals, each passing its operands through as branch 0: the add on mid-steps
  (in place), the update on emitting steps (the add folded into it)."""
  def step(p, st, g):
    acc, inner, mini = st
    count = mini + 1
    emits = count >= K
    p2, inner2 = lax.cond(emits, lambda p, i, a: adam_emit(p, i, add(a, g, mini)),
                          lambda p, i, a: (p, i), p, inner, acc)
    if order == "after":  # the add waits for the update's read of the buffer
      acc, p2, inner2 = lax.optimization_barrier((acc, p2, inner2))
    acc2 = lax.cond(jnp.logical_not(emits), lambda a: add(a, g, mini), lambda a: a, acc)
    return p2, (acc2, inner2, jnp.where(emits, 0, count))
  return step


def protocol_after_step():
  """The update parked in the buffer by a conditional that passes through on mid-steps; the add
  and the updates' select after it, where XLA can fuse them with the caller's apply_updates."""
  def step(p, st, g):
    acc, inner, mini = st
    count = mini + 1
    emits = count >= K

    def emit_in(i, a):
      u, i2 = ADAM.update(jax.tree.map(lambda b: b * (1.0 / K), add(a, g, mini)), i, p)
      return i2, u
    inner2, b = lax.cond(emits, emit_in, lambda i, a: (i, a), inner, acc)
    acc2 = jax.tree.map(lambda b, x: jnp.where(emits, b, jnp.where(mini == 0, 0.0, b) + x), b, g)
    updates = jax.tree.map(lambda b: jnp.where(emits, b, 0.0), b)
    return optax.apply_updates(p, updates), (acc2, inner2, jnp.where(emits, 0, count))
  return step


def protocol_step(design):
  def step(p, st, g):
    acc, inner, mini = st
    count = mini + 1
    emits = count >= K

    def emit_in(i, a):
      buf = add(a, g, mini)
      u, i2 = ADAM.update(jax.tree.map(lambda b: b * (1.0 / K), buf), i, p)
      return i2, u  # parked in the buffer
    inner2, buf = branch(design, emits, emit_in, lambda i, a: (i, add(a, g, mini)), inner, acc)
    updates = jax.tree.map(lambda b: jnp.where(emits, b, 0.0), buf)
    return optax.apply_updates(p, updates), (buf, inner2, jnp.where(emits, 0, count))
  return step


def minimal_state():
  return (tree(0.0), ADAM.init(tree(0.01)), jnp.zeros([], jnp.int32))


def main():
  say(f"== {jax.devices()} jax {jax.__version__} {time.strftime('%F %T')}")
  floor_and_copy()
  # The library and the anchors.
  acc = oa.accumulate(K, ADAM)
  time_program("plain adam", lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
      *ADAM.update(g, s, p)), ADAM.init(tree(0.01)), None)
  time_program("oa.update_and_apply", lambda p, s, g: oa.update_and_apply(acc, g, s, p),
               acc.init(tree(0.01)), K, hlo_file=f"hlo_uaa{TAG}.txt" if N >= 2**28 else None)
  time_program("oa.accumulate protocol", lambda p, s, g: (lambda u, s: (
      optax.apply_updates(p, u), s))(*acc.update(g, s, p)), acc.init(tree(0.01)), K,
      hlo_file=f"hlo_acc{TAG}.txt" if N >= 2**28 else None)
  xms = optax.MultiSteps(ADAM, K)
  time_program("optax.MultiSteps", lambda p, s, g: (lambda u, s: (
      optax.apply_updates(p, u), s))(*xms.update(g, s, p)), xms.init(tree(0.01)), K)
  if os.environ.get("LIBONLY"):
    return
  # Minimal designs: where the add runs, the branch order, a while loop.
  for design in ("cond", "emit0", "while"):
    time_program(f"apply add-outside {design}", apply_step(design, "outside"), minimal_state(), K)
  for design in ("cond", "emit0"):
    time_program(f"apply add-inside {design}", apply_step(design, "inside"), minimal_state(), K)
    time_program(f"protocol park {design}", protocol_step(design), minimal_state(), K)
  for order in ("free", "after"):
    time_program(f"apply two-conds {order}", two_conds_step(order), minimal_state(), K)
  time_program("protocol add-after", protocol_after_step(), minimal_state(), K)
  save()


def save():
  with open(f"{OUT}/speed{TAG}_{N >> 20}M.json", "w") as f:
    json.dump({"N": N, "results": RESULTS}, f, indent=1)


def profile():
  """A trace of two windows of update_and_apply and the protocol; per-op device time."""
  acc = oa.accumulate(K, ADAM)
  steps = {"uaa": lambda p, s, g: oa.update_and_apply(acc, g, s, p),
           "protocol": lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
               *acc.update(g, s, p))}
  trace_dir = f"/tmp/trace{TAG}"
  for name, step in steps.items():
    params, grads = tree(0.01), tree(0.001)
    f = jax.jit(step, donate_argnums=(0, 1))
    carry = [params, acc.init(tree(0.01))]
    for _ in range(K):
      carry = list(jax.block_until_ready(f(carry[0], carry[1], grads)))
    with jax.profiler.trace(f"{trace_dir}/{name}"):
      for i in range(2 * K):
        with jax.profiler.TraceAnnotation(f"{name}_{'emit' if i % K == K - 1 else 'mid'}_{i}"):
          carry = list(jax.block_until_ready(f(carry[0], carry[1], grads)))
    del carry
  import glob
  with open(f"{OUT}/profile{TAG}.txt", "w") as out:
    for name in steps:
      for path in glob.glob(f"{trace_dir}/{name}/**/*.xplane.pb", recursive=True):
        data = jax.profiler.ProfileData.from_file(path)
        for plane in data.planes:
          if "TPU:0" not in plane.name and "/device:" not in plane.name:
            continue
          for line in plane.lines:
            evs = [(e.name, e.start_ns, e.duration_ns) for e in line.events]
            if not evs:
              continue
            out.write(f"## {name} plane {plane.name} line {line.name}: {len(evs)} events\n")
            for ev in evs[:400]:
              out.write(f"{ev[1] / 1e6:14.3f} {ev[2] / 1e3:10.1f}us {ev[0]}\n")


if __name__ == "__main__":
  main()
  save()
  if os.environ.get("PROFILE", "1") == "1":
    try:
      profile()
    except Exception as e:  # the numbers above are what matters
      say("profile failed:", repr(e)[:500])
