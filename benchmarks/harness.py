"""What every benchmark script shares: the machine it ran on, and its results files.

Each script measures its own thing, then calls :func:`write` once: the
result as JSON, its markdown (printed too), and a PNG where it plots. The
timing loop (interleaved rounds, medians, paired ratios) is
``bench_accumulate.run_rounds`` / ``paired_ratio``, used by the scripts that
time a train step.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax


def machine() -> dict[str, Any]:
  """The backend, device, JAX version and host of this run."""
  return {
      "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
      "jax": jax.__version__, "cpu_count": os.cpu_count(),
      "machine": platform.machine(),
      "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg()),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }


def write(out: Path, stem: str, result: dict[str, Any], markdown: str,
          plot: Callable[[dict[str, Any], Path], None] | None = None) -> None:
  """``out/stem.json``, ``out/stem.md`` (printed) and, with ``plot``, ``out/stem.png``."""
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
  (out / f"{stem}.md").write_text(markdown if markdown.endswith("\n") else markdown + "\n")
  if plot is not None:
    plot(result, out / f"{stem}.png")
  print(markdown)
  print(f"wrote {out}/{stem}.{{json,md{',png' if plot else ''}}}")
