"""Every mutant of tests/_mutants.py is claimed by a test that must catch it.

The mutants run where they are claimed: a test marked
``@pytest.mark.catches(name, ...)`` is rerun under each named mutant
(``tests/conftest.py``) and must then fail an assertion. This module checks
the bookkeeping: no mutant left unclaimed, no claim of a mutant that does not
exist.
"""

from __future__ import annotations

import ast
from pathlib import Path

import jax
import pytest

import optax_accum as oa
from optax_accum import contrastive
from tests import _mutants

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
    return (oa.accumulate, oa.microbatched, jax.lax.cond, jax.lax.ppermute,
            contrastive.clip_loss, contrastive.siglip_loss)
  real = patched()
  for apply in _mutants.MUTANTS.values():
    with pytest.MonkeyPatch.context() as patch:
      apply(patch)
      assert patched() != real
    assert patched() == real
