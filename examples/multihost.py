"""Multi-host data-parallel training with one gradient all-reduce per window.

Every process runs this same script. ``jax.distributed.initialize`` joins
them into one JAX runtime; the mesh spans every device of every process; each
process loads only its own rows of the global batch
(``jax.make_array_from_process_local_data``). Each device accumulates its own
partial gradients; the cross-device reduction (and the optimizer step) runs
once per window, in the emitting branch of
``accumulate(k, opt, axis_name="data")``. Two ways to write the step:

* ``--mode plain_jit``: plain ``jax.jit`` on an ``AxisType.Explicit`` mesh
  (``jax.make_mesh``'s default; no ``jax.set_mesh``), the unmodified model;
  gradients from ``local_value_and_grad(loss_fn, "data")`` come back as
  one copy per device (each device's share), as does the buffer.
* ``--mode shard_map`` (the default): gradients with respect to
  ``pcast(params, "data", to="varying")`` inside ``shard_map``, the buffer
  per device (``per_device_state``).

Local run, 2 processes x 2 CPU devices, gloo collectives over 127.0.0.1::

    python examples/multihost.py --process-id 0 --num-processes 2 --port 12355 &
    python examples/multihost.py --process-id 1 --num-processes 2 --port 12355

(add ``--mode plain_jit`` to both for the plain-jit step).

On a cluster (GPU/TPU hosts, SLURM, Open MPI) start one copy per host (or per
GPU) with no address arguments: ``jax.distributed.initialize()`` reads the
coordinator, process count and id from the environment::

    srun --ntasks-per-node=1 python examples/multihost.py --cluster

``--die-after N`` makes this process exit abruptly after N micro-steps (used by
the tests to check that the others fail fast instead of hanging).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--process-id", type=int, default=0)
  parser.add_argument("--num-processes", type=int, default=1)
  parser.add_argument("--port", type=int, default=12355, help="coordinator port on 127.0.0.1")
  parser.add_argument("--cluster", action="store_true",
                      help="real cluster: jax.distributed.initialize() with no arguments")
  parser.add_argument("--cpu-devices", type=int, default=2,
                      help="host CPU devices per process (local runs; ignored with --cluster)")
  parser.add_argument("--mode", choices=("shard_map", "plain_jit"), default="shard_map",
                      help="shard_map with per-device buffers, or plain jit on an Explicit mesh")
  parser.add_argument("--windows", type=int, default=3, help="optimizer steps")
  parser.add_argument("--k", type=int, default=4, help="micro-batches per optimizer step")
  parser.add_argument("--global-batch", type=int, default=16, help="examples per micro-step")
  parser.add_argument("--out", default=None, help="write the final params to this .npz")
  parser.add_argument("--die-after", type=int, default=None,
                      help="exit with status 3 after this many micro-steps (fault test)")
  parser.add_argument("--heartbeat-timeout", type=int, default=10,
                      help="seconds before a silent peer is declared dead")
  parser.add_argument("--init-timeout", type=int, default=60,
                      help="seconds to wait for every process to join")
  return parser.parse_args(argv)


# --- the model and data (shared with the tests' single-process reference) ----------------

D_IN, D_OUT = 8, 4
LR, MOMENTUM = 0.1, 0.9


def init_params() -> dict[str, Any]:
  import numpy as np

  rng = np.random.default_rng(0)
  return {
      "w": (rng.normal(size=(D_IN, D_OUT)) / np.sqrt(D_IN)).astype(np.float32),
      "b": np.zeros(D_OUT, np.float32),
  }


def make_data(windows: int, k: int, global_batch: int) -> tuple[Any, Any]:
  """``(windows, k, global_batch, ...)`` inputs and targets of a noisy linear teacher."""
  import numpy as np

  rng = np.random.default_rng(1)
  teacher = rng.normal(size=(D_IN, D_OUT)).astype(np.float32)
  x = rng.normal(size=(windows, k, global_batch, D_IN)).astype(np.float32)
  noise = 0.1 * rng.normal(size=(windows, k, global_batch, D_OUT)).astype(np.float32)
  return x, np.tanh(x @ teacher) + noise


def loss_fn(params: Any, x: Any, y: Any) -> Any:
  import jax.numpy as jnp

  return jnp.mean((jnp.tanh(x @ params["w"] + params["b"]) - y) ** 2)


# --- the two ways to write the train step -------------------------------------------------


def replicated(mesh: Any, host_params: Any) -> Any:
  """The host params as global arrays, replicated over ``mesh``."""
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  return jax.tree.map(
      lambda a: jax.make_array_from_callback(
          a.shape, NamedSharding(mesh, P()), lambda idx, a=a: a[idx]), host_params)


def shard_map_step(k: int, host_params: Any) -> tuple[Any, Any, Any, Any]:
  """``(params, state, train_step, batch_sharding)``: shard_map, per-device buffers."""
  from functools import partial

  import jax
  import numpy as np
  import optax
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import optax_accum as oa
  from optax_accum.sharding import per_device_state, shard_map_specs

  mesh = Mesh(np.array(jax.devices()), ("data",))
  tx = per_device_state(
      oa.accumulate(k, optax.sgd(LR, momentum=MOMENTUM), axis_name="data"), "data")
  specs = shard_map_specs(tx, host_params, "data")
  params = replicated(mesh, host_params)
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

  @jax.jit
  @partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
           out_specs=(P(), specs, P()))
  def train_step(p: Any, s: Any, x: Any, y: Any) -> tuple[Any, Any, Any]:
    # Local gradients: differentiate w.r.t. device-varying params, so that no
    # all-reduce is inserted here; it happens once per window, inside `update`.
    local = jax.lax.pcast(p, "data", to="varying")
    grads = jax.grad(loss_fn)(local, x, y)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s, s.emitted

  return params, state, train_step, NamedSharding(mesh, P("data"))


def plain_jit_step(k: int, host_params: Any) -> tuple[Any, Any, Any, Any]:
  """``(params, state, train_step, batch_sharding)``: plain jit, Explicit mesh, no set_mesh."""
  import jax
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import optax_accum as oa
  from optax_accum.sharding import local_value_and_grad

  mesh = jax.make_mesh((jax.device_count(),), ("data",))  # Explicit axes by default
  tx = oa.accumulate(k, optax.sgd(LR, momentum=MOMENTUM), axis_name="data")
  params = replicated(mesh, host_params)
  state = tx.init(params)  # the mesh comes from the params: a buffer copy per device
  grad_fn = local_value_and_grad(loss_fn, "data", batch_argnums=(1, 2))

  @jax.jit
  def train_step(p: Any, s: Any, x: Any, y: Any) -> tuple[Any, Any, Any]:
    # Each device's share of the gradient, stacked: no all-reduce here. The
    # window is reduced once, in the emitting branch, to the params' sharding.
    _, grads = grad_fn(p, x, y)
    p, s = oa.update_and_apply(tx, grads, s, p)
    return p, s, s.emitted

  return params, state, train_step, NamedSharding(mesh, P("data"))


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  if not args.cluster:  # must happen before jax is imported
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={args.cpu_devices}".strip())
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

  from functools import partial

  import jax
  import numpy as np

  if args.cluster:
    jax.distributed.initialize()
  else:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=args.init_timeout,
        heartbeat_timeout_seconds=args.heartbeat_timeout,
        shutdown_timeout_seconds=args.init_timeout,
    )
  pid, nproc = jax.process_index(), jax.process_count()
  log = partial(print, f"[process {pid}/{nproc}]", flush=True)
  log(f"{jax.local_device_count()} local / {jax.device_count()} global devices")

  build = plain_jit_step if args.mode == "plain_jit" else shard_map_step
  params, state, train_step, batch_sharding = build(args.k, init_params())
  log(f"{args.mode}: buffer {jax.typeof(state.acc_grads['w'])}")

  x, y = make_data(args.windows, args.k, args.global_batch)
  if args.global_batch % jax.device_count():
    raise SystemExit(f"--global-batch must be a multiple of {jax.device_count()} devices")
  # This process's rows: the slice held by its devices in the mesh order.
  rows = args.global_batch // nproc
  mine = slice(pid * rows, (pid + 1) * rows)

  micro_steps = 0
  start = time.perf_counter()
  for w in range(args.windows):
    for i in range(args.k):
      xb = jax.make_array_from_process_local_data(batch_sharding, x[w, i, mine])
      yb = jax.make_array_from_process_local_data(batch_sharding, y[w, i, mine])
      params, state, emitted = train_step(params, state, xb, yb)
      micro_steps += 1
      if args.die_after is not None and micro_steps >= args.die_after:
        log(f"--die-after {args.die_after}: exiting abruptly")
        os._exit(3)
    emitted.block_until_ready()
    log(f"window {w + 1} done (emitted={bool(emitted.addressable_data(0))})")
  jax.block_until_ready(params)
  log(f"{micro_steps} micro-steps in {time.perf_counter() - start:.2f}s")

  final = {k: np.asarray(v.addressable_data(0)) for k, v in params.items()}
  if args.out:
    np.savez(args.out, **final)
    log(f"wrote {args.out}")
  jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
