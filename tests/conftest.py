"""Test session set-up.

Eight host CPU devices are forced before jax is imported, so the in-process
multi-device tests (pmap, shard_map, NamedSharding) run on a CPU-only machine.
Single-device tests are unaffected: jit places work on device 0. With
``OPTAX_ACCUM_TEST_DEVICES=1`` nothing is forced: the platform's own devices
(one CPU), for the one-device runs (``tests/test_lifecycle.py`` starts one).

A test marked ``@pytest.mark.catches(name, ...)`` runs once as it is and then
once under each named mutant of ``tests/_mutants.py``, where an assertion must
fail (:func:`pytest_pyfunc_call`).
"""

import atexit
import importlib
import os
import shutil
import tempfile
from importlib import metadata


def _add_xla_flag(flag: str) -> None:
  """Appends ``--name=value`` to ``XLA_FLAGS`` unless ``--name`` is set there already."""
  flags = os.environ.get("XLA_FLAGS", "")
  if flag.split("=")[0] not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


if os.environ.get("OPTAX_ACCUM_TEST_DEVICES") != "1":
  _add_xla_flag("--xla_force_host_platform_device_count=8")
# The suite compiles about a thousand small programs and runs each a few times: LLVM's
# optimisation of their machine code costs more than it saves (a step of the demo's model
# compiles in 1.2 s at level 0, 4.9 s at the default; XLA's own passes, buffer assignment
# and so every `memory_analysis()` the tests read are unchanged). Users' programs are
# compiled as JAX compiles them; this is only the test session's setting.
_add_xla_flag("--xla_backend_optimization_level=0")
# jaxlib 0.10 emits XLA:CPU's fusions through MLIR fusion emitters by default; the LLVM IR
# emitters this flag selects compile the suite's programs faster (the whole suite: 7.6
# CPU-minutes instead of 12.0, 4:13 instead of 6:04 on 2 cores) into programs with the same
# `memory_analysis()` (memory_table.py --cpu prints the same rows either way). jaxlib 0.11.2
# and 0.12 do not know the flag, and XLA aborts on a flag it does not know.
if tuple(int(p) for p in metadata.version("jaxlib").split(".")[:2]) < (0, 11):
  _add_xla_flag("--xla_cpu_use_fusion_emitters=false")
# One compilation cache per session, empty when it starts, shared by the xdist workers and
# the processes the tests start: a program that two tests build alike compiles once.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="optax_accum_jax_cache_")
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

import jax  # noqa: E402  (after XLA_FLAGS: jax reads it on import)

jax.config.update("jax_enable_x64", False)
# Tests compare against float64 references with float32 tolerances. GPUs run
# float32 matmuls in TF32 by default (about 1e-3 relative per product), which
# no exactness test can absorb; pin full precision so the suite means the same
# on every backend. What TF32 does to training is measured in the README.
jax.config.update("jax_default_matmul_precision", "highest")


# -- mutants (tests/_mutants.py) ----------------------------------------------------
import pytest  # noqa: E402

from tests import _mutants  # noqa: E402

_UNDER_MUTANT = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
  config.addinivalue_line(
      "markers", "catches(*names): mutants of tests/_mutants.py this test must fail on")
  config.addinivalue_line(
      "markers", "slow: runs whole programs or other processes (conftest.SLOW); the fast"
      " subset is -m 'not slow'")


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> object:
  """After a test passes, rerun it under each mutant it claims: an assertion must fail."""
  result = yield
  names = [name for mark in pyfuncitem.iter_markers("catches") for name in mark.args]
  if _UNDER_MUTANT in pyfuncitem.stash:
    return result
  for name in names:
    if name not in _mutants.MUTANTS:
      pytest.fail(f"@pytest.mark.catches({name!r}): no such mutant in tests/_mutants.py"
                  f" (there are {sorted(_mutants.MUTANTS)})", pytrace=False)
    pyfuncitem.stash[_UNDER_MUTANT] = name
    try:
      with pytest.MonkeyPatch.context() as patch:
        _mutants.MUTANTS[name](patch)
        pyfuncitem.ihook.pytest_pyfunc_call(pyfuncitem=pyfuncitem)
    except AssertionError:
      continue
    except Exception:
      print(f"raised under the mutant {name!r}, which must fail an assertion instead")
      raise
    finally:
      del pyfuncitem.stash[_UNDER_MUTANT]
    pytest.fail(f"the mutant {name!r} survived: the test passed on it"
                f" ({' '.join(_mutants.MUTANTS[name].__doc__.split())})", pytrace=False)
  return result


# -- docstring examples that build a mesh of several devices -------------------------------
_MESH_OF_MANY = ("jax.devices()[:8]", "make_mesh((8,)", "make_mesh((4, 2)", "init_on(8)")


# -- the fast subset: `python -m pytest -m "not slow"` --------------------------------
# It leaves out what runs whole programs or other processes: the demo, the example scripts
# and the benchmarks' smoke test; two-process jobs, a killed and restarted job, the
# one-device platform, the docs pages on one device and the Flax/JAX pairing venv; and
# optax's own MultiSteps test suite run against ours. Every claim of the package keeps a
# test in the subset; CI runs everything.
SLOW = (
    "tests/test_demo.py::",
    "tests/test_moe_example.py::",
    "tests/test_multihost.py::",
    "tests/test_docs_one_device.py::",
    "tests/test_flax_pairing.py::",
    "tests/test_resnet_batchnorm.py::",
    "benchmarks/test_smoke.py::",
    "tests/test_multi_steps.py::test_optax_own_multisteps_tests_pass_against_ours",
    "tests/test_lifecycle.py::test_the_one_device_cases_on_a_one_device_platform",
    "tests/test_lifecycle.py::test_a_killed_job_resumes_bit_for_bit[",
    "tests/test_integrations.py::test_example_scripts_run[",
    "tests/test_contrastive.py::test_example_script_runs",
    "tests/test_distributed.py::test_fsdp_example_trains",
)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
  """``-n auto``: one worker per core, at most 8 (each is a JAX process with 8 host devices)."""
  return min(os.cpu_count() or 1, 8)


# CI installs the test extra: a test dependency missing there fails the run (a gap in the
# extra) instead of skipping its tests.
if os.environ.get("CI"):
  pytest.importorskip = lambda modname, *args, **kwargs: importlib.import_module(modname)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
  """Marks the slow tests; on a one-device platform, skips the docstring examples
  written for 8 devices."""
  for item in items:
    if item.nodeid.startswith(SLOW):
      item.add_marker(pytest.mark.slow)
  if jax.device_count() >= 8:
    return
  for item in items:
    examples = getattr(getattr(item, "dtest", None), "examples", ())
    if any(s in ex.source for ex in examples for s in _MESH_OF_MANY):
      item.add_marker(pytest.mark.skip(reason="an example on 8 devices: run the suite as is"))
