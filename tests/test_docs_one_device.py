"""The many-devices guide and the checkpointing recipe, run on a one-device platform.

The docs build runs every page on 8 forced host devices; these two pages say their code
runs on however many devices there are, one included. This test runs each page as
``sphinx-build -b doctest`` does (its ``{testcode}`` blocks top to bottom in one namespace,
each ``{testoutput}`` compared with doctest's ``ELLIPSIS`` and ``NORMALIZE_WHITESPACE``) in a
subprocess without the forced devices: the platform's one CPU device.
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


@pytest.mark.parametrize("page", PAGES)
def test_the_page_runs_on_one_device(page: str) -> None:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  result = subprocess.run([sys.executable, __file__, page], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
  assert "ran on 1 device" in result.stdout, result.stdout


if __name__ == "__main__":
  import jax

  assert jax.device_count() == 1, jax.devices()
  problems = run_page(ROOT / sys.argv[1])
  print("\n".join(problems) or f"{sys.argv[1]} ran on 1 device")
  sys.exit(1 if problems else 0)
