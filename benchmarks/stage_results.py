"""A stage's own results file, ``benchmarks/results/<stage>/results.json``: committed (unlike results.json, which
holds the last full run and stays local), so the report shows the stage's last run whatever else was rerun since,
and names the machine and commit it came from. Torch-free: stages that start their own processes import it."""
from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path


def machine() -> dict:
    """What a result was measured on: the CPU, the CPUs this process may use, the commit, the load at the start, and
    what radixserve's C++ kernels are built for ($RADIXSERVE_MARCH: x86-64-v3 builds AVX2 ones on an AVX-512 CPU)."""
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    return {"cpu": model, "cpus_in_mask": len(os.sched_getaffinity(0)), "commit": commit,
            "load_average_at_start": os.getloadavg()[0],
            "radixserve_march": os.environ.get("RADIXSERVE_MARCH", "native")}


def load_stage(results_dir: Path, stage: str) -> dict | None:
    path = results_dir / stage / "results.json"
    return json.loads(path.read_text()) if path.exists() else None


def save_stage(res: dict, results_dir: Path, stage: str) -> Path:
    path = results_dir / stage / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2))
    return path
