"""Runs every ```python block of the README, after the docs' toy problem.

The README's quick start uses ``params``, ``loss_fn`` and ``micro_batches``
without defining them; ``docs/_toy.py`` (the problem every docs page starts
from) defines them. Run from the repository root: ``python docs/_ext/readme_code.py``.
"""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def main() -> int:
  blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
  if not blocks:
    print("README.md has no python block")
    return 1
  namespace: dict = {}
  exec(compile((ROOT / "docs" / "_toy.py").read_text(), "docs/_toy.py", "exec"), namespace)
  for i, block in enumerate(blocks):
    exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
  print(f"README.md: {len(blocks)} python block(s) ran")
  return 0


if __name__ == "__main__":
  sys.exit(main())
