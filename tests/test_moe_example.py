"""The MoE example (examples/moe.py) runs in its short form and reaches its conclusions.

Four ways to feed the load-balancing loss its expert counts at k = 8: each
micro-batch's own, the causal buffer and the last window's (``accumulate``'s
global statistics), the whole batch's (``microbatched(..., global_stats=)``).
At this size nothing is learnt; what must hold at any size: the exact mode's
gradient is the whole batch's (its blocks rematerialised), the exact mode is
at distance 0 from itself by construction and the others are not, and the
files are written.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("flax.linen")

from tests._reference import load_example

moe = load_example("moe")


def test_the_short_form_writes_its_table_and_the_exact_mode_is_the_whole_batch(tmp_path):
  results = moe.main(["--quick", "--out", str(tmp_path)])
  assert results["exact_vs_whole_batch"] < 1e-5  # float32, blocks under nn.remat
  for point in results["distance"].values():
    assert all(d > 1e-3 for d in point["balance"].values())  # causal, lagged, per micro-batch
  saved = json.loads((tmp_path / "moe.json").read_text())
  assert set(saved["modes"]) == set(moe.MODES)
  assert "| exact |" in (tmp_path / "moe.md").read_text()
  assert (tmp_path / "moe.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
