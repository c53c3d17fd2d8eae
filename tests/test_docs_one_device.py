"""The many-devices guide and the checkpointing recipe, run on a one-device platform.

The docs build runs every page on 8 forced host devices; these two pages say their code
runs on however many devices there are, one included. This test runs each page as
``sphinx-build -b doctest`` does (its ``{testcode}`` blocks top to bottom in one namespace,
each ``{testoutput}`` compared with doctest's ``ELLIPSIS`` and ``NORMALIZE_WHITESPACE``) in a
subprocess without the forced devices: the platform's one CPU device. One subprocess runs
both pages, each in a namespace of its own (a JAX process's start is most of a page's cost).
"""

from __future__ import annotations

import contextlib
import doctest
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("docs/guides/many_devices.md", "docs/recipes/checkpointing.md")
BLOCK = re.compile(r"^```\{(testcode|testoutput)\}\n(.*?)^```", re.M | re.S)


def run_page(path: Path) -> list[str]:
  """Runs a page's code; returns one message per output that differs (none: it passed)."""
  checker, flags = doctest.OutputChecker(), doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
  namespace: dict = {}
  printed, failures = "", []
  for kind, body in BLOCK.findall(path.read_text()):
    if kind == "testcode":
      out = io.StringIO()
      with contextlib.redirect_stdout(out):
        exec(compile(body, str(path), "exec"), namespace)
      printed = out.getvalue()
      continue
    want = "\n".join(line for line in body.splitlines() if not line.startswith(":options:"))
    if not checker.check_output(want.strip() + "\n", printed, flags):
      failures.append(f"{path.name}: expected\n{want.strip()}\ngot\n{printed}")
  return failures


@pytest.fixture(scope="module")
def one_device_run() -> subprocess.CompletedProcess[str]:
  from tests._reference import session_xla_flags  # (not in the subprocess: __main__ below)

  # The session's compiler flags but the forced device count (half the CPU time).
  env = {**os.environ, "XLA_FLAGS": session_xla_flags(), "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, __file__, *PAGES], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("page", PAGES)
def test_the_page_runs_on_one_device(page: str, one_device_run) -> None:
  result = one_device_run
  assert f"{page} ran on 1 device" in result.stdout.splitlines(), (
      result.stdout[-4000:] + result.stderr[-4000:])


if __name__ == "__main__":
  import traceback

  import jax

  assert jax.device_count() == 1, jax.devices()
  failed = False
  for page in sys.argv[1:]:  # one namespace each; a page that raises fails that page alone
    try:
      problems = run_page(ROOT / page)
    except Exception:
      problems = [f"{page} raised:\n{traceback.format_exc()}"]
    print("\n".join(problems) or f"{page} ran on 1 device", flush=True)
    failed = failed or bool(problems)
  sys.exit(1 if failed else 0)
