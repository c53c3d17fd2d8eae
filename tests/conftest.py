"""Test session set-up.

Eight host CPU devices are forced before jax is imported, so the in-process
multi-device tests (pmap, shard_map, NamedSharding) run on a CPU-only machine.
Single-device tests are unaffected: jit places work on device 0.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
flags = os.environ["XLA_FLAGS"]
if "xla_force_host_platform_device_count" not in flags:
  os.environ["XLA_FLAGS"] = flags + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
