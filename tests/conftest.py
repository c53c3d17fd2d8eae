"""Test session set-up.

Eight host CPU devices are forced before jax is imported, so the in-process
multi-device tests (pmap, shard_map, NamedSharding) run on a CPU-only machine.
Single-device tests are unaffected: jit places work on device 0. With
``OPTAX_ACCUM_TEST_DEVICES=1`` nothing is forced: the platform's own devices
(one CPU), for the one-device runs (``tests/test_lifecycle.py`` starts one).

A test marked ``@pytest.mark.catches(name, ...)`` runs once as it is and then
once under each named mutant of ``tests/_mutants.py``, where an assertion must
fail (:func:`pytest_pyfunc_call`). Mutant reruns are a CPU activity: on another
backend the test runs once, and the terminal summary counts the reruns left out.
"""

import atexit
import collections
import datetime
import importlib
import os
import platform
import shutil
import tempfile
import time
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
# The MLIR locations of a program's ops hold, by JAX's default, up to 100 frames of their
# Python traceback; under pytest most frames are pytest's, lowered and parsed again in each of
# the suite's ~8000 compilations. The op's own frame (the HLO's source_file and source_line)
# is kept: 5% less CPU time on test_accumulate.py (and on a loss test file since removed). An
# environment variable, so that the processes the tests start compile the same way.
# (--xla_cpu_parallel_codegen_split_count=1 would save 12-18% more, but changes XLA:CPU's
# code enough that test_parking's bit-for-bit noise-tracking case differs by an ulp.)
os.environ.setdefault("JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS", "false")
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

from tests import _mutants, _reference  # noqa: E402

_UNDER_MUTANT = pytest.StashKey[str]()
_STARTED = pytest.StashKey[float]()
# The mutants were calibrated on XLA:CPU, the reference compiler: under each, an assertion
# fails there. Another compiler may reject a mutated program before any assertion runs (the
# TPU's refuses a While's condition computation that a patched `lax.cond` reaches from two
# callers), which says nothing about the test; so reruns happen on XLA:CPU only.
MUTANTS_LEFT_OUT_REASON = (
    f"mutant reruns run on XLA:CPU only (the compiler the mutants were calibrated on); on"
    f" {jax.default_backend()} a mutant can break compilation instead of an assertion")
_mutant_reruns_left_out: list[str] = []


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
    if not _reference.XLA_CPU:
      _mutant_reruns_left_out.append(f"{pyfuncitem.nodeid} under {name}")
      continue
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


def pytest_sessionstart(session: pytest.Session) -> None:
  session.config.stash[_STARTED] = time.time()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
  """Says how many mutant reruns this backend left out, and why; with
  ``OPTAX_ACCUM_TEST_SUMMARY=path``, writes the run's summary there (:func:`run_summary`)."""
  if _mutant_reruns_left_out:
    terminalreporter.write_line(
        f"{len(_mutant_reruns_left_out)} mutant reruns left out: {MUTANTS_LEFT_OUT_REASON}")
  path = os.environ.get("OPTAX_ACCUM_TEST_SUMMARY")
  if path:
    started = terminalreporter.config.stash.get(_STARTED, time.time())
    with open(path, "w") as f:
      f.write(run_summary(terminalreporter, time.time() - started))
    terminalreporter.write_line(f"summary written to {path}")


def _version(name: str) -> str:
  try:
    return metadata.version(name)
  except metadata.PackageNotFoundError:
    return "not installed"


def run_summary(terminalreporter: pytest.TerminalReporter, wall_s: float) -> str:
  """Markdown: when, on what (versions, device), the command, the counts, the wall time, the
  failures, the skip reasons and the backend's measured float32 accuracy."""
  stats = terminalreporter.stats
  reports = lambda key: stats.get(key, [])
  counts = {key: len(reports(key)) for key in ("passed", "failed", "error", "skipped", "xfailed",
                                              "xpassed") if reports(key)}
  device = jax.devices()[0]
  lines = [
      f"# Test run: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC", "",
      f"- device: {jax.device_count()} x {device.device_kind} ({jax.default_backend()})",
      f"- Python {platform.python_version()}, jax {jax.__version__}, jaxlib"
      f" {_version('jaxlib')}, libtpu {_version('libtpu')}, optax {_version('optax')},"
      f" flax {_version('flax')}",
      f"- command: `pytest {' '.join(terminalreporter.config.invocation_params.args)}`",
      f"- wall time: {wall_s:.0f} s",
      f"- counts: {', '.join(f'{n} {key}' for key, n in counts.items())}",
  ]
  if _mutant_reruns_left_out:
    lines.append(f"- {len(_mutant_reruns_left_out)} mutant reruns left out:"
                 f" {MUTANTS_LEFT_OUT_REASON}")
  errors = _reference.backend_errors()
  lines.append("- measured float32 relative errors (tests/_reference.py): "
               + ", ".join(f"{name} {error:.1e}" for name, error in errors.items()))
  for key in ("failed", "error"):
    if reports(key):
      lines += ["", f"## {key.capitalize()}", ""]
      lines += [f"- `{r.nodeid}`: {str(r.longrepr).splitlines()[-1][:200] if r.longrepr else ''}"
                for r in reports(key)]
  reasons = collections.Counter(str(r.longrepr[-1]) if isinstance(r.longrepr, tuple) else "?"
                                for r in reports("skipped"))
  if reasons:
    lines += ["", "## Skip reasons", ""]
    lines += [f"- {n} x {reason}" for reason, n in reasons.most_common()]
  return "\n".join(lines) + "\n"


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: without it, pytest must not object
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
  """``-n auto``: one worker per core, at most 8 (each is a JAX process with 8 host devices)."""
  return min(os.cpu_count() or 1, 8)


# CI installs the test extra: a test dependency missing there fails the run (a gap in the
# extra) instead of skipping its tests.
if os.environ.get("CI"):
  pytest.importorskip = lambda modname, *args, **kwargs: importlib.import_module(modname)


# Docstring examples of the library that print an XLA:CPU compiler fact: off XLA:CPU they skip,
# naming it (tests/_reference.py's xla_cpu_fact does the same for tests).
XLA_CPU_DOCTESTS = {
    "optax_accum.debug.conditionals": "XLA:CPU keeps a conditional of two cheap branches"
                                      " (a GPU's compiler turns it into selects)",
    "optax_accum.debug.copies": "the copy instructions XLA:CPU emits for a transpose",
}
# Slow tests whose processes run on JAX_PLATFORMS=cpu: they test nothing about another backend
# (and on an accelerator a process of theirs could not open the chip this one holds).
CPU_PROCESSES = ("tests/test_multihost.py::", "tests/test_docs_one_device.py::",
                 "tests/test_flax_pairing.py::", "benchmarks/test_smoke.py::",
                 "tests/test_lifecycle.py::test_a_killed_job_resumes_bit_for_bit[")


def _slow_first(config: pytest.Config, items: list[pytest.Item]) -> None:
  """In an xdist worker (each collects the same items, in the same order), the slow tests
  first, each file's in their order. ``--dist worksteal`` hands each worker a contiguous
  half of the items and later moves tests from the end of a worker's queue to the other:
  the slow ones, first in the first worker's half, are never moved, so a module fixture
  (the ResNet's and the demo's runs, 25 and 11 CPU-seconds) never runs in both workers,
  and what is moved at the end are short tests, which even out the workers' ends."""
  if hasattr(config, "workerinput"):
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
  """Marks the slow tests; off XLA:CPU, skips the examples of XLA:CPU facts and the tests
  of CPU processes; on a one-device platform, skips the docstring examples written for 8
  devices. Under pytest-xdist, the slow tests run first (:func:`_slow_first`)."""
  for item in items:
    if item.nodeid.startswith(SLOW):
      item.add_marker(pytest.mark.slow)
  _slow_first(config, items)
  for item in items:
    if _reference.XLA_CPU:
      continue
    fact = XLA_CPU_DOCTESTS.get(item.name)
    if fact is not None:
      item.add_marker(pytest.mark.skip(reason=f"prints an XLA:CPU compiler fact: {fact}"))
    if item.nodeid.startswith(CPU_PROCESSES):
      item.add_marker(pytest.mark.skip(
          reason=f"runs JAX_PLATFORMS=cpu processes: tests nothing about {jax.default_backend()}"))
  if jax.device_count() >= 8:
    return
  for item in items:
    examples = getattr(getattr(item, "dtest", None), "examples", ())
    if any(s in ex.source for ex in examples for s in _MESH_OF_MANY):
      item.add_marker(pytest.mark.skip(reason="an example on 8 devices: run the suite as is"))
