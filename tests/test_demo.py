"""The demo (examples/demo.py) runs end to end at a tiny size and reaches its conclusions.

The full-batch arm is plain ``optax.adam`` on the whole batch: the independent
reference. The accumulate and microbatched arms must track it to float
rounding; the mean-of-means arm must not (the tiny data is grouped by length,
so its micro-batches hold very different numbers of real tokens). The arm with
a bf16 buffer rounds every add, so it is held to a looser bound: well inside
the gap that separates the mean of means from the full batch.

The same run does the adaptive-k experiment at a tiny size, with an estimate
that is ready after 2 windows and a fraction large enough that the adaptive
arm must leave ``k_small``; that its windows are the large-batch steps is the
core's tests' job (tests/test_noise_scale.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("flax.nnx")

from tests._reference import XLA_CPU, load_example

demo = load_example("demo")  # after the skip: the demo needs Flax

TINY = [
    "--steps", "6", "--k", "2", "--batch-size", "8", "--seq-len", "32",
    "--d-model", "16", "--layers", "1", "--heads", "2", "--max-files", "3",
    "--eval-batches", "1", "--group-by-length", "--no-progress",
    "--k-small", "2", "--k-large", "4", "--min-windows", "2", "--fraction", "50",
]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
  out = tmp_path_factory.mktemp("demo_out")
  results = demo.main([*TINY, "--out", str(out)])
  return out, results


def test_writes_json_and_readable_pngs(tiny_run):
  out, _ = tiny_run
  for name in ("results.json", "loss_curves.png", "memory.png", "adaptive_k.png"):
    assert (out / name).is_file(), name
  for name in ("loss_curves.png", "memory.png", "adaptive_k.png"):
    data = (out / name).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
  saved = json.loads((out / "results.json").read_text())
  assert set(saved["arms"]) == {"full_batch", "accumulate", "accumulate_bf16", "microbatched",
                                "mean_of_means"}
  assert saved["config"]["steps"] == 6 and saved["config"]["k"] == 2
  for arm, r in saved["arms"].items():
    assert len(r["losses"]) == 6, arm
    assert all(np.isfinite(r["losses"])), arm
    assert r["tokens_per_s"] > 0 and r["real_tokens"] > 0, arm
    # Temporaries are the compiler's: XLA:CPU gives every arm some, a TPU v5e none to the
    # full batch of this tiny model (tests/results/tpu.md), but the bf16 buffer's rounding.
    assert isinstance(r["temp_bytes"], int) and r["temp_bytes"] >= (1 if XLA_CPU else 0), arm
  assert saved["arms"]["accumulate_bf16"]["temp_bytes"] > 0
  assert saved["arms"]["accumulate"]["calls_per_step"] == 2
  assert saved["arms"]["accumulate_bf16"]["calls_per_step"] == 2
  assert saved["arms"]["microbatched"]["calls_per_step"] == 1


def test_exact_arms_match_full_batch_and_mean_of_means_does_not(tiny_run):
  _, results = tiny_run
  arms = results["arms"]
  # Uneven padding across micro-batches, or the contrast below would be vacuous.
  assert results["micro_batch_real_tokens"]["max"] > 1.3 * results["micro_batch_real_tokens"]["min"]
  full = np.asarray(arms["full_batch"]["losses"])
  for arm in ("accumulate", "accumulate_bf16", "microbatched", "mean_of_means"):
    # Same init and same first batch: step 1's loss is the same in every arm.
    np.testing.assert_allclose(arms[arm]["losses"][0], full[0], rtol=1e-5)
  for arm in ("accumulate", "microbatched"):
    np.testing.assert_allclose(arms[arm]["losses"], full, rtol=0, atol=2e-5)
  naive = arms["mean_of_means"]
  assert naive["max_abs_loss_diff_vs_full"] > 1e-3
  assert naive["max_abs_loss_diff_vs_full"] > 100 * results["exact_arms_max_abs_loss_diff"]
  # A bf16 buffer rounds each add (stochastically): not float rounding of the same
  # sum, but still on the full batch's side of the line the mean of means crosses.
  bf16 = arms["accumulate_bf16"]["max_abs_loss_diff_vs_full"]
  assert bf16 == results["bf16_buffer_max_abs_loss_diff"]
  assert bf16 < 1e-3 and bf16 < naive["max_abs_loss_diff_vs_full"] / 10, bf16
  # (Parameter differences are not compared: Adam turns rounding noise in a
  # near-zero gradient coordinate into a full learning-rate step.)


def test_bf16_arm_keeps_a_bf16_buffer_for_f32_params():
  tx, _, calls = demo.build_step("accumulate_bf16", None, optax.adam(1e-3), 2)
  state = tx.init({"w": jnp.zeros(3)})
  assert state.acc_grads["w"].dtype == jnp.bfloat16 and calls == 2


def test_table_lists_every_arm(tiny_run, capsys):
  _, results = tiny_run
  table = demo.format_table(results)
  for arm in ("full batch", "accumulate", "bf16 buffer", "microbatched", "mean of means"):
    assert arm in table
  assert "compiled temporaries" in table and "tokens/s" in table
  assert "train loss (mean of last 10 steps)" in table  # not a "final" loss


def test_adaptive_arm_changes_k_on_the_same_examples(tiny_run):
  out, results = tiny_run
  ad = json.loads((out / "results.json").read_text())["adaptive"]
  assert ad == json.loads(json.dumps(results["adaptive"]))
  n_micro = 6 * 2  # --steps x --k micro-batches of --batch-size / --k sequences
  assert (ad["micro_batches"], ad["micro_batch_sequences"]) == (n_micro, 4)
  arms = ad["arms"]
  assert set(arms) == {"small_k", "large_k", "adaptive_k"}
  for arm, r in arms.items():
    assert sum(r["window_k"]) == n_micro, arm  # every arm saw every example
    assert r["window_end_sequences"][-1] == n_micro * 4, arm
    assert r["optimizer_steps"] == len(r["window_k"]), arm
    np.testing.assert_allclose(r["mean_k"], n_micro / r["optimizer_steps"])
    assert np.isfinite(r["eval_loss"]) and len(r["eval_losses"]) >= 2, arm
  assert arms["small_k"]["window_k"] == [2] * 6
  assert arms["large_k"]["window_k"] == [4] * 3
  k = arms["adaptive_k"]["window_k"]
  assert k[:2] == [2, 2] and len(set(k)) > 1, k  # k_small until the estimate is ready
  # The estimate is reported once ready (2 windows), in sequences.
  b_noise = arms["adaptive_k"]["b_noise_sequences"]
  assert b_noise[0] is None and b_noise[1] is not None and b_noise[1] > 0, b_noise
  table = demo.format_adaptive_table(ad)
  for label in ("k = 2", "k = 4", "adaptive k (2..4)", "optimizer steps", "mean k"):
    assert label in table


def test_learning_rate_counted_in_examples():
  """First window (2 micro-batches of 4 sequences): Adam's first update is the
  sign of the gradient times the learning rate read at 8 examples (warm-up over
  5% of 160 examples: the peak); the schedule read at step 1 would still be
  warming up."""
  cfg = demo.Config(lr=0.5, k=2, batch_size=8, k_small=2, k_large=4)
  params = {"w": jnp.zeros(3)}
  grads = {"w": jnp.array([1.0, -2.0, 3.0])}
  _, tx = demo.adaptive_arms(cfg, 40)["small_k"]
  state = tx.init(params)
  _, state = tx.update(grads, state, params, weight=1.0, examples=8.0)
  first, state = tx.update(grads, state, params, weight=1.0, examples=8.0)
  np.testing.assert_allclose(first["w"], [-0.5, 0.5, -0.5], rtol=1e-5)
  assert float(demo.lr_schedule(cfg, 160)(8)) == 0.5
  assert float(demo.lr_schedule(cfg, 160)(1)) < 0.5


def test_bad_flags_name_the_fix(capsys):
  with pytest.raises(SystemExit):
    demo.main(["--batch-size", "10", "--k", "4"])
  assert "--batch-size (10) must be divisible by --k (4)" in capsys.readouterr().err
  with pytest.raises(SystemExit) as info:
    demo.main(["--help"])
  assert info.value.code == 0
  assert "--steps" in capsys.readouterr().out


def test_k_flag(capsys):
  """k is fixed: 4 by default (micro-batches of 8 of the default batch of 32), or ``--k``."""
  assert demo.parse_args([]).k == 4 and demo.Config().k == 4
  assert demo.parse_args(["--k", "8"]).k == 8
  with pytest.raises(SystemExit):
    demo.main(["--k", "0"])
  assert "must be divisible by --k (0)" in capsys.readouterr().err
