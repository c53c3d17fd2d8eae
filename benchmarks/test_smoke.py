"""The benchmarks' own check, run by the README's test command with harness's doctests."""

import json
import os
import subprocess
import sys
from pathlib import Path

import bench_accumulate as bench


def run(script: str, out: Path, stem: str, *flags: str) -> dict:
  """``benchmarks/script --quick --out out`` in a fresh process on the CPU (fails with its
  stderr); the ``stem.json`` it wrote. On an accelerator, run the benchmarks themselves."""
  proc = subprocess.run([sys.executable, str(Path(__file__).with_name(script)), *flags, "--quick",
                         "--out", str(out)], capture_output=True, text=True, timeout=300,
                        check=False, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads((out / f"{stem}.json").read_text())


def test_bench_accumulate_quick(tmp_path: Path) -> None:
  result = run("bench_accumulate.py", tmp_path, "accumulate")
  seen = {(r["optimizer"], r["row"]) for r in result["records"]}
  assert {(opt, row) for opt in ("sgd", "adam") for row, _ in bench.ROWS} <= seen
  assert result["bandwidth"]["copy_GBps"] > 0
  assert (tmp_path / "accumulate.md").read_text().count("| oa.accumulate mid |") == 2
  assert (tmp_path / "accumulate.png").stat().st_size > 0


def test_bench_host_state_quick(tmp_path: Path) -> None:  # and --tpu's run, on the CPU
  result = run("bench_host_state.py", tmp_path, "host_state_tpu", "--tpu")
  tpu, rows = result["tpu"], result["memory"]  # (XLA:CPU: 22 device B/param, 14)
  fits, host = tpu["fits"], "pinned_host"
  assert fits[host]["params"] > 1.5 * fits["device"]["params"] > 0, fits
  assert all(len(f["ms"]) == 2 and f["loss"] > 0 for f in fits.values()), fits
  assert fits[host]["state kinds"] == [host] and fits["device"]["state kinds"] == ["device"]
  assert tpu["same size"]["loss"] == fits["device"]["loss"]  # the same training, bit for bit
  assert all(r[host]["bit for bit"] for r in tpu["rates"] if "bit for bit" in r[host]), tpu
  text = (tmp_path / "host_state_tpu.md").read_text()
  assert "host update: " in text and "largest model trained: " in text
  # Every program (the updates, the MLPs) sheds the whole state.
  device = {(r["step"], r["params"]): r["one program"] for r in rows if r["state"] == "device"}
  micro = [(r["one program"], device[r["step"], r["params"]] - r["host bytes"] + 0.01)
           for r in rows if r["state"] == host]
  assert len(micro) == 5 and all(m <= bound for m, bound in micro), micro


def test_accelerator_cpu_smoke(tmp_path: Path) -> None:  # --quick is --cpu-smoke
  result = run("accelerator.py", tmp_path, "cpu")
  assert len(result["meta"]["sizes"]) == 3 and "does not fit" in result["sizing"][0]
  assert {r["row"] for r in result["records"]} == {row for row, _ in bench.ROWS}
  full, *micro = result["transformer"]["rows"]  # the full batch, k / 2, k, k at "highest"
  assert not full["ran"] and full["status"].startswith("does not fit")
  assert micro[-1]["ran"] and micro[-2]["ran"] and micro[-1]["grad_diff"] < 1e-5
  assert "The compiled peaks against the chip: exact" in (tmp_path / "cpu.md").read_text()
