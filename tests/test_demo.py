"""The demo runs end to end at a tiny size and reaches the conclusions it prints.

The full-batch arm is plain ``optax.adam`` on the whole batch: the independent
reference. The accumulate and microbatched arms must track it to float
rounding; the mean-of-means arm must not (the tiny data is grouped by length,
so its micro-batches hold very different numbers of real tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flax.nnx")

from optax_accum import demo  # after the skip: the demo needs Flax

TINY = [
    "--steps", "6", "--k", "2", "--batch-size", "8", "--seq-len", "32",
    "--d-model", "16", "--layers", "1", "--heads", "2", "--max-files", "3",
    "--eval-batches", "1", "--unit", "line", "--group-by-length", "--no-progress",
]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
  out = tmp_path_factory.mktemp("demo_out")
  results = demo.main([*TINY, "--out", str(out)])
  return out, results


def test_writes_json_and_readable_pngs(tiny_run):
  out, _ = tiny_run
  for name in ("results.json", "loss_curves.png", "memory.png"):
    assert (out / name).is_file(), name
  for name in ("loss_curves.png", "memory.png"):
    data = (out / name).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
  saved = json.loads((out / "results.json").read_text())
  assert set(saved["arms"]) == {"full_batch", "accumulate", "microbatched", "mean_of_means"}
  assert saved["config"]["steps"] == 6 and saved["config"]["k"] == 2
  for arm, r in saved["arms"].items():
    assert len(r["losses"]) == 6, arm
    assert all(np.isfinite(r["losses"])), arm
    assert r["tokens_per_s"] > 0 and r["real_tokens"] > 0, arm
    assert isinstance(r["temp_bytes"], int) and r["temp_bytes"] > 0, arm
  assert saved["arms"]["accumulate"]["calls_per_step"] == 2
  assert saved["arms"]["microbatched"]["calls_per_step"] == 1


def test_exact_arms_match_full_batch_and_mean_of_means_does_not(tiny_run):
  _, results = tiny_run
  arms = results["arms"]
  # Uneven padding across micro-batches, or the contrast below would be vacuous.
  assert results["micro_batch_real_tokens"]["max"] > 1.3 * results["micro_batch_real_tokens"]["min"]
  full = np.asarray(arms["full_batch"]["losses"])
  for arm in ("accumulate", "microbatched", "mean_of_means"):
    # Same init and same first batch: step 1's loss is the same in every arm.
    np.testing.assert_allclose(arms[arm]["losses"][0], full[0], rtol=1e-5)
  for arm in ("accumulate", "microbatched"):
    np.testing.assert_allclose(arms[arm]["losses"], full, rtol=0, atol=2e-5)
  naive = arms["mean_of_means"]
  assert naive["max_abs_loss_diff_vs_full"] > 1e-3
  assert naive["max_abs_loss_diff_vs_full"] > 100 * results["exact_arms_max_abs_loss_diff"]
  # (Parameter differences are not compared: Adam turns rounding noise in a
  # near-zero gradient coordinate into a full learning-rate step.)


def test_table_lists_every_arm(tiny_run, capsys):
  _, results = tiny_run
  table = demo.format_table(results)
  for arm in ("full batch", "accumulate", "microbatched", "mean of means"):
    assert arm in table
  assert "compiled temporaries" in table and "tokens/s" in table


def test_bad_flags_name_the_fix(capsys):
  with pytest.raises(SystemExit):
    demo.main(["--batch-size", "10", "--k", "4"])
  assert "--batch-size (10) must be divisible by --k (4)" in capsys.readouterr().err
  with pytest.raises(SystemExit) as info:
    demo.main(["--help"])
  assert info.value.code == 0
  assert "--steps" in capsys.readouterr().out
