"""Checks the README: its python blocks run, and its links resolve.

* Every ```python block runs, top to bottom, in one fresh namespace, with
  nothing defined beforehand: a reader can paste the README's code as it is.
* Every relative link (``[text](path)``) names a file or folder of this
  repository, so it works on the repository's page; links into ``docs/`` name
  the page sources, which the built site has under the same names.

Run from anywhere: ``python docs/_ext/readme_code.py``.
"""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def main() -> int:
  text = (ROOT / "README.md").read_text()
  blocks = re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)
  if not blocks:
    print("README.md has no python block")
    return 1
  namespace: dict = {}
  for i, block in enumerate(blocks):
    exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
  print(f"README.md: {len(blocks)} python block(s) ran")

  broken = []
  links = re.findall(r"\]\(([^)\s]+)\)", text)
  for target in links:
    if re.match(r"[a-z]+:", target) or target.startswith("#"):
      continue  # absolute URLs and in-page anchors
    if not (ROOT / target.split("#")[0]).exists():
      broken.append(target)
  for target in broken:
    print(f"README.md: the link {target!r} names no file of the repository")
  if broken:
    return 1
  print(f"README.md: {len(links)} link(s) resolve")
  return 0


if __name__ == "__main__":
  sys.exit(main())
