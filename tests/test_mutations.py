"""Every mutant of tests/_mutants.py is claimed by a test that must catch it.

The mutants run where they are claimed: a test marked
``@pytest.mark.catches(name, ...)`` is rerun under each named mutant
(``tests/conftest.py``) and must then fail an assertion. This module checks
the bookkeeping: no mutant left unclaimed, no claim of a mutant that does not
exist; and every prefix of ``conftest.SLOW`` (the slow tests that
``-m "not slow"`` leaves out) names a test that exists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import jax
import pytest

import optax_accum as oa
from tests import _mutants
from tests.conftest import SLOW

HERE = Path(__file__).resolve().parent


def _claims() -> dict[str, list[str]]:
  """``{mutant: [test file:line, ...]}`` from every ``pytest.mark.catches(...)`` in tests/."""
  claims: dict[str, list[str]] = {}
  for path in sorted(HERE.glob("test_*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
          and node.func.attr == "catches":
        for arg in node.args:
          assert isinstance(arg, ast.Constant), f"{path.name}:{node.lineno}: name the mutant"
          claims.setdefault(arg.value, []).append(f"{path.name}:{node.lineno}")
  return claims


def test_every_mutant_is_claimed_by_a_test() -> None:
  claims = _claims()
  unclaimed = sorted(set(_mutants.MUTANTS) - set(claims))
  assert not unclaimed, (
      f"mutants no test claims: {unclaimed}; mark the test that must catch each with"
      " @pytest.mark.catches(name)")
  unknown = {name: where for name, where in claims.items() if name not in _mutants.MUTANTS}
  assert not unknown, f"claims of mutants tests/_mutants.py does not define: {unknown}"


def test_a_mutant_is_undone_after_its_test() -> None:
  """Each mutant replaces a public function, and the real one is back once its
  monkeypatch is undone."""
  def patched() -> tuple:
    return oa.accumulate, oa.microbatched, jax.lax.cond, oa.host_state
  real = patched()
  for apply in _mutants.MUTANTS.values():
    with pytest.MonkeyPatch.context() as patch:
      apply(patch)
      assert patched() != real
    assert patched() == real


def test_every_slow_prefix_names_a_test() -> None:
  """A prefix that names nothing (a test renamed or moved) would leave the test it meant
  in the fast subset, unannounced."""
  stale = []
  for prefix in SLOW:
    path, _, name = prefix.partition("::")
    file = HERE.parent / path
    test = name.split("[")[0]
    if not file.is_file() or (test and not re.search(rf"^def {test}\(", file.read_text(), re.M)):
      stale.append(prefix)
  assert not stale, f"conftest.SLOW names no test at {stale}: fix or remove these prefixes"
