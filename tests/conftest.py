"""Test session set-up.

Eight host CPU devices are forced before jax is imported, so the in-process
multi-device tests (pmap, shard_map, NamedSharding) run on a CPU-only machine.
Single-device tests are unaffected: jit places work on device 0. With
``OPTAX_ACCUM_TEST_DEVICES=1`` nothing is forced: the platform's own devices
(one CPU), for the one-device runs (``tests/test_lifecycle.py`` starts one).
"""

import os

if os.environ.get("OPTAX_ACCUM_TEST_DEVICES") != "1":
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  flags = os.environ["XLA_FLAGS"]
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = flags + " --xla_force_host_platform_device_count=8"

import jax

jax.config.update("jax_enable_x64", False)
# Tests compare against float64 references with float32 tolerances. GPUs run
# float32 matmuls in TF32 by default (about 1e-3 relative per product), which
# no exactness test can absorb; pin full precision so the suite means the same
# on every backend. What TF32 does to training is measured in the README.
jax.config.update("jax_default_matmul_precision", "highest")
