"""The command line: `radixserve demo` runs a scripted chat when stdin is not a terminal."""
from __future__ import annotations

import subprocess
import sys


def test_demo_runs_a_scripted_chat_and_reuses_the_cache(tiny_models):
    proc = subprocess.run(
        [sys.executable, "-m", "radixserve", "demo", "--model-path", str(tiny_models["llama"]), "--dtype", "float32",
         "--max-new-tokens", "8", "--max-total-tokens", "2048"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    cached = [line for line in proc.stdout.splitlines() if "prompt tokens from the radix cache" in line]
    assert len(cached) == 3
    assert not cached[1].strip().startswith("[0/"), "the second turn reuses the first"


def test_bad_flag_value_is_a_clear_error(tiny_models):
    proc = subprocess.run(
        [sys.executable, "-m", "radixserve", "demo", "--model-path", str(tiny_models["llama"]),
         "--eviction-policy", "nope"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "unknown eviction policy 'nope'" in proc.stderr
