"""The optimizer state in host memory (``oa.host_state``): device bytes, pace, largest model.

Device bytes per parameter (arguments + temporaries - the state's in pinned_host) of compiled
steps, params and state donated, adam: ``accumulate(k, adam)`` against ``accumulate(k,
host_state(adam))``, compiled with ``jax.jit`` (one program); the update alone (k = 4);
an MLP's step, 4 layers of d x d, micro-batches of d rows (k = 8); the real run's step (below).
``--tpu`` (on the chip; ``--quick`` checks it on the CPU), each part in a process of its own:
the streamed update alone (separate leaves, one stacked leaf; bit for bit against the state on
the device where it fits); the largest MLP in a scan that trains two windows with a finite loss,
f32 adam, k = 4, the state on the device and with ``host_state``, bisected by compiling, each
try run; host_state at the device's largest size (the window's time, host RAM);
``host_state_tpu.{md,json}`` in ``--out``."""

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import time

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import optax_accum as oa

K, HOST, FORM = 4, "pinned_host", "one program"


def args_of(params, batch, dev, on_host, across):
  """``(params, state, batch)`` on ``dev``: arrays, where memory kinds type (not abstract ones)."""
  state = jax.eval_shape(oa.accumulate(K, optax.adam(1e-3)).init, params)
  inner = oa.offload.HostState(state.inner_opt_state) if on_host else state.inner_opt_state
  put = lambda t, s: jax.tree.map(lambda x: jax.device_put(jnp.zeros(x.shape, x.dtype), s), t)
  inner = put(inner, oa.offload.in_host_memory(dev) if on_host else dev)
  return put(params, dev), put(state, dev)._replace(inner_opt_state=inner) if across else (
      inner), put(batch, dev)


def device_bytes(m, host):
  """Arguments + temporaries on the device, of a compiled step whose state holds ``host`` bytes."""
  return m.argument_size_in_bytes + (m.host_argument_size_in_bytes or 0) - host + (
      m.temp_size_in_bytes)


def forms(row, step, params, batch, dev):
  """``row`` with the device bytes per parameter of ``step``'s one program (jitted, params and
  state donated)."""
  on_host, across = row["state"] == HOST, row["step"] != "MLP, in-step"
  args = args_of(params, batch, dev, on_host, across)
  n = sum(x.size for x in jax.tree.leaves(params))
  host = 8 * n * (row["params"] == "float32" or 0.5) if on_host else 0  # adam's mu and nu
  m = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile().memory_analysis()
  return {**row, FORM: round(device_bytes(m, host) / n, 2), "host bytes": host / n}


def memory(quick, dev):
  n, d, rows = 1 << (16 if quick else 26), 256 if quick else 2048, []
  mlp = {f"w{i}": jax.ShapeDtypeStruct((d, d), jnp.float32) for i in range(4)}
  loss = lambda p, x: jnp.mean(functools.reduce(lambda h, w: jnp.tanh(h @ w), p.values(), x)**2)

  def in_step(opt, p, s, x):
    u, s = opt.update(oa.microbatched(jax.value_and_grad(loss), 8)(p, x)[1], s, p)
    return optax.apply_updates(p, u), s
  for state in ("device", HOST):
    opt = optax.adam(1e-3) if state == "device" else oa.host_state(optax.adam(1e-3))
    update = lambda p, s, g, opt=opt: oa.update_and_apply(oa.accumulate(K, opt), g, s, p)
    for dt, leaves in (("float32", 4), ("bfloat16", 4), ("float32", 16)):  # n in 1-D leaves
      params = {f"w{i}": jax.ShapeDtypeStruct((n // leaves,), dt) for i in range(leaves)}
      rows.append(forms({"step": f"update, {leaves} leaves", "params": dt, "state": state},
                        update, params, params, dev))
    rows.append(forms({"step": "MLP, in-step", "params": "float32", "state": state},
                      functools.partial(in_step, opt), mlp,
                      jax.ShapeDtypeStruct((8 * d, d), jnp.float32), dev))
    # Across steps: the real run's step (`real_run`), (layers, d, d) in a lax.scan.
    layers, width = (2, 128) if quick else (8, 4096)
    held = real_run(layers, width, state == HOST, float("inf"), False, dev)["device bytes"]
    rows.append({"step": f"real run's MLP in a scan ({layers} x {width}^2)", "params": "float32",
                 "state": state, FORM: round(held / (layers * width**2), 2), "host bytes": 8.0 * (
                     state == HOST)})
  return rows


def one_device() -> jax.sharding.NamedSharding:
  """The first device, whole (a NamedSharding: JAX 0.12.1 deprecates SingleDeviceSharding)."""
  return jax.sharding.NamedSharding(jax.sharding.Mesh(jax.devices()[:1], ("d",)),
                                    jax.sharding.PartitionSpec())


def mlp_loss(p, x):
  return jnp.mean(lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p)[0] ** 2)


def real_run(layers, d, host, limit, run_it, dev=None):
  """Compiles (and with ``run_it`` runs two windows of) the step of an MLP of ``layers`` tanh
  layers of d x d in a lax.scan, f32 adam, k = 4: its device bytes, or None where it does not
  fit ``limit``; with ``run_it``, the median ms of its mid-steps and of its closing step and
  the last loss."""
  tx = oa.accumulate(K, oa.host_state(optax.adam(1e-4)) if host else optax.adam(1e-4))
  step = jax.jit(lambda p, s, x: (lambda lg: (*oa.update_and_apply(tx, lg[1], s, p), lg[0]))(
      jax.value_and_grad(mlp_loss)(p, x)), donate_argnums=(0, 1))
  dev, n = dev or one_device(), layers * d * d
  params = jax.ShapeDtypeStruct((layers, d, d), jnp.float32, sharding=dev)
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       jax.eval_shape(tx.init, params), oa.sharding.state_shardings(tx, params))
  x = jax.ShapeDtypeStruct((4 * K, d), jnp.float32, sharding=dev)
  try:
    step = step.lower(params, state, x).compile()  # runs as compiled (a jit call compiles again)
  except Exception:  # over the chip's memory: the compiler refuses it
    return None
  held = device_bytes(step.memory_analysis(), 8 * n * host)
  if held > limit or not run_it:
    return None if held > limit else {"device bytes": held}
  p = jax.random.normal(jax.random.key(0), (layers, d, d)) / d**0.5
  # Adam's and the window's initial state is zeros: placed from the host (tx.init would build
  # the inner state on the device first, where the largest host_state model has no room).
  zeros = lambda x: jax.device_put(np.zeros(x.shape, x.dtype), x.sharding)
  run, times = [p, jax.tree.map(zeros, state)], ([], [])
  for i in range(2 * K):
    xs = jax.random.normal(jax.random.key(i), (4 * K, d))
    t0 = time.perf_counter()
    *run, loss = jax.block_until_ready(step(*run, xs))
    times[i % K == K - 1].append(time.perf_counter() - t0)
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(run[1].inner_opt_state)}
  del p, xs
  return {"device bytes": held, "ms": [round(1e3 * harness.median(t[1:] or t), 1) for t in times],
          "loss": float(loss), "state kinds": sorted(kinds)}


def child(quick, *argv):
  """``--child`` in a process of its own (one holds the chip at a time): its JSON."""
  command = [sys.executable, __file__, "--child", *map(str, argv), *["--quick"] * quick]
  proc = subprocess.run(command, capture_output=True, text=True, check=False)
  found = [line for line in proc.stdout.splitlines() if line.startswith("{")]
  print(f"  {argv}: {found[-1] if found else proc.stderr[-300:]}", flush=True)
  return json.loads(found[-1]) if found else {}


def in_child(quick, what, host, d, lo, hi):
  """A child's work: ``bisect`` (the most layers in [lo, hi] whose step compiles within the
  chip's memory), ``run`` (``lo`` layers, two windows: finite loss, times, host RAM) or
  ``rate`` (:func:`update_rate` of ``lo`` leaves, one stacked leaf where ``host``)."""
  if what == "rate":  # host: stacked
    return update_rate(quick, lo, d, host)
  limit = 8 << 20 if quick else jax.devices()[0].memory_stats()["bytes_limit"]
  jax.block_until_ready(jnp.zeros(8) + 1)  # the runtime up: its host RAM is the base
  base = harness.rss()
  if what == "bisect":
    if not real_run(lo, d, host, limit, False):  # (below the bounds: from none)
      lo, hi = 0, lo - 1
    while lo < hi:  # lo fits, hi + 1 does not
      mid = (lo + hi + 1) // 2
      lo, hi = (mid, hi) if real_run(mid, d, host, limit, False) else (lo, mid - 1)
    return {"layers": lo, "limit": limit}
  out = real_run(lo, d, host, limit, True) or {}
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  return {"layers": lo, "params": lo * d * d, "limit": limit, **out, "host base": base,
          "host over base": peak - base}


def largest(quick, host, d, lo, hi):
  """The most layers that train two windows with a finite loss: bisected by compiling, then
  each try run in a fresh process, a layer fewer after a try that fails."""
  layers = child(quick, "bisect", int(host), d, lo, hi).get("layers", 0)
  for _ in range(4):
    found = child(quick, "run", int(host), d, layers, layers) if layers else {}
    if np.isfinite(found.get("loss", np.nan)):
      return found
    layers -= 1
  return {"layers": 0, "params": 0}


def update_rate(quick, leaves, d, stacked):
  """The streamed update alone, f32 adam, ``leaves`` (d, d) leaves (or one (leaves, d, d)):
  ms per update (median of 5, after one), device temporaries; against the state on the device
  where it fits: bit for bit."""
  shape = [(leaves, d, d)] if stacked else [(d, d)] * leaves
  n, dev = leaves * d * d, one_device()
  rows, trained = {}, None  # trained: the params the state on the device trained
  for where in ("device", HOST):
    tx = oa.host_state(optax.adam(1e-3)) if where == HOST else optax.adam(1e-3)
    step = jax.jit(harness.protocol_step(tx), donate_argnums=(0, 1))
    params = [jax.device_put(jax.random.normal(jax.random.key(i), s) * 0.02, dev)
              for i, s in enumerate(shape)]
    grads = [jax.device_put(jax.random.normal(jax.random.key(100 + i), s) * 1e-3, dev)
             for i, s in enumerate(shape)]
    structs = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                           jax.eval_shape(tx.init, params), oa.sharding.state_shardings(tx, params))
    try:
      compiled = step.lower(params, structs, grads).compile()
      state = jax.tree.map(lambda x: jax.device_put(np.zeros(x.shape, x.dtype), x.sharding),
                           structs)
      times = []
      for _ in range(6):
        t0 = time.perf_counter()
        params, state = jax.block_until_ready(compiled(params, state, grads))
        times.append(time.perf_counter() - t0)
    except Exception as e:  # the state on the device does not fit
      rows[where] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
      del params, grads
      continue
    ms = harness.median(times[1:]) * 1e3
    rows[where] = {"ms": round(ms, 2), "ns/param": round(ms * 1e6 / n, 3),
                   "temps MB": round(compiled.memory_analysis().temp_size_in_bytes / 1e6, 1),
                   "checksum": [float(jnp.sum(p[..., :8, :8])) for p in params]}
    if where == "device":
      trained = params
    elif trained is not None:  # host_state's, bit for bit
      rows[where]["bit for bit"] = all(bool(jnp.array_equal(a, b)) for a, b in zip(
          params, trained, strict=True))
    del params, grads, state
  gbps = 16 * n / (rows[HOST]["ms"] * 1e-3) / 1e9  # mu and nu in and out
  tree = f"one ({leaves}, {d}, {d}) leaf" if stacked else f"{leaves} leaves of {d} x {d}"
  return {"tree": tree, "params": n, **rows, "link GB/s": round(gbps, 1)}


def tpu(quick, layers):
  """The real run on the chip: the streamed update's pace; the largest model each way
  (``layers``: the bisection's bounds, the device state's, then host_state's)."""
  d, ram = 128 if quick else 4096, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  rates = [child(quick, "rate", int(stacked), d, leaves, 0) for leaves, stacked in (
      ((4, False), (4, True)) if quick else
      ((16, False), (16, True), (64, False), (64, True)))]
  # host_state's host RAM: the state (8 B/param) beside the runtime's base; bounded at 0.85.
  by_ram = int((0.85 * ram - 16 * 2**30 * (not quick)) / (10 * d * d))
  fits = {"device": largest(quick, False, d, *layers[:2]),
          HOST: largest(quick, True, d, layers[2], min(layers[3], by_ram))}
  same = child(quick, "run", 1, d, fits["device"]["layers"], 0)  # host_state at the device's size
  return {"d": d, "ram": ram, "layers by ram": by_ram, "rates": rates, "fits": fits,
          "same size": same, "ratio": round(fits[HOST]["params"] / max(
              fits["device"]["params"], 1), 2), "threads": len(os.sched_getaffinity(0))}


def markdown(r):
  cols, head = [FORM, "host bytes"], ["step", "params", "state"]
  return "\n".join([
      f"# The optimizer state in host memory: {r['compiler']}", "", f"`{r['command']}`, jax"
      f" {r['machine']['jax']}, {r['machine']['date']}. " + " ".join(__doc__.split("\n")[2:6]),
      "", *harness.table(" | ".join(head + cols), "lllrr", [
          [x[c] for c in head] + [x.get(c, "-") for c in cols] for x in r["memory"]]), "",
      *(tpu_markdown(r["tpu"]) if "tpu" in r else [])])


def tpu_markdown(t):
  big = max((r for r in t["rates"] if "ns/param" in r[HOST]),
            key=lambda r: (r["params"], -r[HOST]["ns/param"]))
  runs = [("state on the device", t["fits"]["device"]), ("host_state", t["fits"][HOST]),
          ("host_state, the device's size", t["same size"])]
  device_ms, same_ms = t["fits"]["device"].get("ms", [0, 0]), t["same size"].get("ms", [0, 0])
  return [
      "", "The streamed update alone (f32 adam, `tx.update` + `optax.apply_updates`, params and"
      " state donated; median of 5): the state on the device where it fits.", "",
      *harness.table("tree | params | device: ns/param | host_state: ns/param | temporaries MB"
                     " | bit for bit | link GB/s", "lrrrrlr", [[
                         r["tree"], f"{r['params']:.4g}", r["device"].get("ns/param", "-"),
                         r[HOST].get("ns/param", "-"), r[HOST].get("temps MB", "-"),
                         r[HOST].get("bit for bit", "-"), r["link GB/s"]] for r in t["rates"]]),
      "", f"host update: {big[HOST]['ns/param']:.2f} ns/param ({big['tree']}, {big['params']:.3g}"
      f" params: {big['link GB/s']} GB/s over the host link, the state in and out)", "",
      f"The largest MLP (layers of {t['d']} x {t['d']} in a `lax.scan`, f32 adam, `accumulate({K},"
      " ...)`, two windows, finite loss) each way: bisected by compiling, each try run in a"
      " process of its own.", "",
      *harness.table("run | layers | params | device B/param | ms micro-step | ms closing step |"
                     " loss | host RAM over base GiB", "lrrrrrrr", [[
                         name, f.get("layers", 0), f"{f.get('params', 0):.4g}",
                         round(f.get("device bytes", 0) / max(f.get("params", 1), 1), 2),
                         *f.get("ms", ["-"] * 2), f"{f.get('loss', float('nan')):.4g}",
                         round(f.get("host over base", 0) / 2**30, 2)] for name, f in runs]), "",
      f"largest model trained: {t['ratio']:.2f}x as many parameters", "",
      "At the device's largest size a window of host_state takes"
      f" {same_ms[0] * (K - 1) + same_ms[1]:.0f} ms against"
      f" {device_ms[0] * (K - 1) + device_ms[1]:.0f} ms (micro-steps and the closing step); its"
      " host RAM over the runtime's base (peak, the state's zeros placed from numpy included):"
      f" {t['same size'].get('host over base', 0) / max(t['same size'].get('params', 1), 1):.1f}"
      f" B/param (the state: 8). {t['threads']} host threads; RAM bound: {t['layers by ram']}"
      f" layers in 0.85 of {t['ram'] / 2**30:.1f} GiB."]


def main():
  ap = harness.parser(__doc__, quick="small sizes (checks the script)", layers=[8, 64, 32, 128])
  ap.add_argument("--tpu", action="store_true", help="also the real run on the chip (--quick: CPU)")
  ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)  # `child`'s process
  args = ap.parse_args()
  if args.child:  # `child`'s process: bisect|run host d lo hi
    what, (host, d, lo, hi) = args.child[0], map(int, args.child[1:])
    print(json.dumps(in_child(args.quick, what, host == 1, d, lo, hi)))
    return
  real = {"tpu": tpu(args.quick, args.layers)} if args.tpu else {}  # before this process
  dev = one_device()  # holds the chip
  r = {"command": " ".join(["python benchmarks/bench_host_state.py", *sys.argv[1:]]),
       "machine": harness.machine(), "memory": memory(args.quick, dev),
       "compiler": f"XLA on {jax.devices()[0].device_kind}", **real}
  harness.write(args.out, "host_state_" + ("tpu" if args.tpu else "cpu"), r, markdown(r))


if __name__ == "__main__":
  main()
