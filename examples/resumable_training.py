"""A training job that survives being killed: checkpoints mid-window, resumes from the latest.

Plain ``jax.jit`` on an Explicit mesh over every device of every process, ``k``
micro-batches per optimizer step with ``accumulate(k, optimizer, axis_name="data")`` and
the gradients of ``local_value_and_grad``. Every ``--save-every`` micro-steps an orbax
``CheckpointManager`` saves the params and the state, at a window boundary or in the
middle of a window: the buffer holds one partial sum per device, an ordinary array that
each process saves its own shards of. Started again with the same ``--ckpt-dir`` (after a
crash, a preemption, ``kill -9``), the job restores the latest checkpoint and ends with
the params an uninterrupted run reaches, bit for bit.

One process, 8 CPU devices::

    python examples/resumable_training.py --ckpt-dir /tmp/job --cpu-devices 8

Two processes of 4 CPU devices each (gloo collectives over 127.0.0.1)::

    python examples/resumable_training.py --ckpt-dir /tmp/job --num-processes 2 --process-id 0 &
    python examples/resumable_training.py --ckpt-dir /tmp/job --num-processes 2 --process-id 1

To resume on another number of devices, restore to host arrays and lay the state out
with ``optax_accum.sharding.reshard_state`` (``examples/checkpoint_resume.py``).
``--stall-after N`` makes the job wait after micro-step N, to be killed (the tests).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--ckpt-dir", required=True, help="the CheckpointManager's directory")
  parser.add_argument("--steps", type=int, default=12, help="micro-steps in all")
  parser.add_argument("--k", type=int, default=4, help="micro-batches per optimizer step")
  parser.add_argument("--save-every", type=int, default=3, help="micro-steps between saves")
  parser.add_argument("--cpu-devices", type=int, default=4, help="host CPU devices per process")
  parser.add_argument("--num-processes", type=int, default=1)
  parser.add_argument("--process-id", type=int, default=0)
  parser.add_argument("--port", type=int, default=12356, help="coordinator port on 127.0.0.1")
  parser.add_argument("--out", default=None, help="write the final params to this .npz")
  parser.add_argument("--stall-after", type=int, default=None,
                      help="wait forever after this micro-step (to be killed)")
  return parser.parse_args(argv)


GLOBAL_BATCH, D_IN, D_OUT = 16, 8, 4


def init_params() -> dict[str, Any]:
  import numpy as np

  rng = np.random.default_rng(0)
  return {"w": (rng.normal(size=(D_IN, D_OUT)) / np.sqrt(D_IN)).astype(np.float32),
          "b": np.zeros(D_OUT, np.float32),
          "temperature": np.asarray(1.0, np.float32)}  # a scalar param


def batch(step: int) -> tuple[Any, Any]:
  """Micro-step ``step``'s global batch: the same on every run and every process."""
  import numpy as np

  rng = np.random.default_rng(1000 + step)
  x = rng.normal(size=(GLOBAL_BATCH, D_IN)).astype(np.float32)
  return x, (x @ np.arange(D_IN * D_OUT, dtype=np.float32).reshape(D_IN, D_OUT) / 10.0)


def loss_fn(params: Any, x: Any, y: Any) -> Any:
  import jax.numpy as jnp

  return jnp.mean((params["temperature"] * (x @ params["w"]) + params["b"] - y) ** 2)


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={args.cpu_devices}")
  import jax
  import numpy as np
  import optax
  import orbax.checkpoint as ocp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import optax_accum as oa
  from optax_accum.sharding import local_value_and_grad

  if args.num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args.port}", args.num_processes, args.process_id)
  pid = jax.process_index()
  log = lambda *a: print(f"[process {pid}/{jax.process_count()}]", *a, flush=True)

  mesh = jax.make_mesh((jax.device_count(),), ("data",))  # Explicit axes by default
  tx = oa.accumulate(args.k, optax.adam(1e-2), axis_name="data")
  params = jax.device_put(init_params(), NamedSharding(mesh, P()))
  state = tx.init(params)  # the buffer: one partial sum per device, sharded over "data"
  grad_fn = local_value_and_grad(loss_fn, "data", batch_argnums=(1, 2))

  @jax.jit
  def train_step(params: Any, state: Any, x: Any, y: Any) -> tuple[Any, Any]:
    _, grads = grad_fn(params, x, y)
    return oa.update_and_apply(tx, grads, state, params)

  manager = ocp.CheckpointManager(os.path.abspath(args.ckpt_dir))
  start = manager.latest_step() or 0
  if start:
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "state": state})
    restored = manager.restore(start, args=ocp.args.StandardRestore(target))
    params, state = restored["params"], restored["state"]
    log(f"resumed from micro-step {start} (mini_step {int(state.mini_step)})")

  rows = NamedSharding(mesh, P("data"))
  mine = slice(pid * GLOBAL_BATCH // jax.process_count(),
               (pid + 1) * GLOBAL_BATCH // jax.process_count())  # this process's rows
  for step in range(start, args.steps):
    x, y = (jax.make_array_from_process_local_data(rows, a[mine]) for a in batch(step))
    params, state = train_step(params, state, x, y)
    if (step + 1) % args.save_every == 0:
      manager.save(step + 1, args=ocp.args.StandardSave({"params": params, "state": state}))
      manager.wait_until_finished()
      log(f"saved after micro-step {step + 1} (mini_step {int(state.mini_step)})")
    if args.stall_after is not None and step + 1 == args.stall_after:
      log("stalling: waiting to be killed")
      time.sleep(3600)
  log(f"done: {int(state.gradient_step)} optimizer steps")
  if args.out and pid == 0:  # every process holds the replicated params whole
    np.savez(args.out, **{k: np.asarray(v.addressable_data(0)) for k, v in params.items()})
  manager.close()


if __name__ == "__main__":
  main()
