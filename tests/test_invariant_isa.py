"""The invariant kernels on more than one instruction set, by building them for each target this machine can run:
as built for this CPU, for AVX2 (x86-64-v3), for baseline x86-64 (no FMA units) and for aarch64 (NEON, under
qemu-user, where Debian's cross compiler and qemu are installed: ``make test`` installs them as root). On every
target a row computed alone equals it computed in a batch, bitwise; and every target with FMA units computes the
very same bits (16 lanes of the language, not of the machine)."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from radixserve.kernels import invariant
from radixserve.kernels.cpu_native import cpu_features

HARNESS = Path(__file__).with_name("native") / "invariant_check.cpp"
FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-std=c++17", "-Wno-psabi"]


def run(tmp_path: Path, name: str, compile_cmd: list[str], run_prefix: list[str]) -> tuple[int, str]:
    exe = tmp_path / name
    subprocess.run([*compile_cmd, *FLAGS, str(HARNESS), str(invariant.SOURCE), "-o", str(exe)], check=True,
                   capture_output=True)
    out = subprocess.run([*run_prefix, str(exe)], check=True, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "2"}).stdout.split()
    return int(out[0]), out[1]


def test_every_target_is_batch_invariant_and_fma_targets_agree_bitwise(tmp_path):
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++")
    targets = {"native": ([cxx, "-march=native"], [])}
    if platform.machine() == "x86_64":
        if {"avx2", "fma"} <= cpu_features():  # an AVX2 build runs here
            targets["x86-64-v3 (AVX2)"] = ([cxx, "-march=x86-64-v3"], [])
        targets["x86-64 (no FMA)"] = ([cxx, "-march=x86-64"], [])
    cross, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    if cross and qemu:
        targets["aarch64 (NEON, qemu)"] = ([cross, "-static"], [qemu])
    elif os.environ.get("CI") == "true" and platform.machine() == "x86_64":
        pytest.fail("CI must test aarch64: install g++-aarch64-linux-gnu and qemu-user (make test does, as root)")
    results = {name: run(tmp_path, name.split()[0], *cmd) for name, cmd in targets.items()}
    assert all(bad == 0 for bad, _ in results.values()), results
    fused = {name: h for name, (_, h) in results.items() if "no FMA" not in name and (name != "native" or
                                                                                       "fma" in cpu_features())}
    assert len(set(fused.values())) == 1, fused
