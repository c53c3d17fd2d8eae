"""ARCHITECTURE.md's module table matches the package: one row per module, and
each row's "depends on" the package modules it imports at module level."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import optax_accum

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "optax_accum"


def _imports(path: Path) -> set[str]:
  """The package modules ``path`` imports at module level (a name imported from the
  package itself counts as the module that defines it)."""
  found = set()
  for node in ast.parse(path.read_text()).body:
    if isinstance(node, ast.ImportFrom) and node.module == "optax_accum":
      for alias in node.names:
        if (PACKAGE / f"{alias.name}.py").exists():
          found.add(alias.name)
        else:  # a re-exported name: `from optax_accum import update_and_apply`
          found.add(getattr(optax_accum, alias.name).__module__.rsplit(".", 1)[-1])
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("optax_accum."):
      found.add(node.module.split(".")[1])
    elif isinstance(node, ast.Import):
      found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("optax_accum."))
  return found - {path.stem}


def _table() -> dict[str, set[str]]:
  """``{module: modules in its "depends on" cell}`` from ARCHITECTURE.md's module table."""
  text = (ROOT / "ARCHITECTURE.md").read_text()
  section = text.split("## Modules", 1)[1].split("\n## ", 1)[0]
  rows = {}
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 3 and re.fullmatch(r"`\w+\.py`", cells[0]):
      rows[cells[0].strip("`")[:-3]] = set(re.findall(r"`(\w+)`", cells[2]))
  return rows


def _cell(modules: set[str]) -> str:
  return ", ".join(f"`{m}`" for m in sorted(modules)) or "—"


def test_the_module_table_lists_every_module_and_its_imports() -> None:
  table = _table()
  code = {p.stem: _imports(p) for p in sorted(PACKAGE.glob("*.py")) if p.stem != "__init__"}
  fixes = [f"add a row for `{m}.py`, depends on: {_cell(code[m])}"
           for m in sorted(set(code) - set(table))]
  fixes += [f"remove the row of `{m}.py` (no such module)" for m in sorted(set(table) - set(code))]
  fixes += [f"row `{m}.py`: depends on should read {_cell(code[m])} (it reads {_cell(table[m])})"
            for m in sorted(set(code) & set(table)) if table[m] != code[m]]
  assert not fixes, "ARCHITECTURE.md's module table is out of date:\n" + "\n".join(fixes)
