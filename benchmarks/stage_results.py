"""A stage's own results file, ``benchmarks/results/<stage>/results.json``: committed (unlike results.json, which
holds the last full run and stays local), so the report shows the stage's last run whatever else was rerun since,
and names the machine and commit it came from. Torch-free: stages that start their own processes import it."""
from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path


ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8")  # what the kernels here and llama.cpp's build choose by


def machine() -> dict:
    """What a result was measured on: the CPU, its instruction sets, its cores and the CPUs this process may use,
    the load at the start, the versions (radixserve's commit, torch, transformers, the llama.cpp a peer stage
    builds and the instruction sets its build uses), and what radixserve's C++ kernels are built for
    ($RADIXSERVE_MARCH: x86-64-v3 builds AVX2 ones on an AVX-512 CPU)."""
    info = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    flags = set(info.get("flags", "").split())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    # the results files an earlier stage of the same run wrote are not changes to what is measured
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                            ":(exclude)benchmarks/results"], capture_output=True, text=True,
                           cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    from llama_cpp import VERSION as LLAMA_CPP_VERSION, host_isa  # torch-free

    return {"cpu": info.get("model name", platform.processor()), "isa": [f for f in ISA_FLAGS if f in flags],
            "cores": os.cpu_count(), "cpus_in_mask": len(os.sched_getaffinity(0)), "commit": commit,
            "uncommitted_changes": bool(dirty), "load_average_at_start": os.getloadavg()[0],
            "radixserve_march": os.environ.get("RADIXSERVE_MARCH", "native"),
            # torch's products (oneDNN) held below what the CPU has, e.g. AVX512_CORE_BF16 to stand in for a CPU
            # without AMX: None when not set
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
            "versions": {"python": platform.python_version(), "torch": _version("torch"),
                         "transformers": _version("transformers")},
            "llama_cpp": {"version": f"llama-cpp-python {LLAMA_CPP_VERSION}'s vendored llama.cpp",
                          "isa": host_isa(), "amx": False}}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def load_stage(results_dir: Path, stage: str) -> dict | None:
    path = results_dir / stage / "results.json"
    return json.loads(path.read_text()) if path.exists() else None


def save_stage(res: dict, results_dir: Path, stage: str) -> Path:
    path = results_dir / stage / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2))
    return path
