"""A third-party policy package, built and pip-installed by the test, used by name; broken plugins are named
in a clear error and never take the engine or the server down."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import ServerProcess, install_apart

PLUGIN = Path(__file__).parent / "plugin_pkg"


@pytest.fixture(scope="module")
def plugin_installed(tmp_path_factory) -> dict[str, str]:
    """The environment of a process that has the plugin package installed."""
    return install_apart(PLUGIN, tmp_path_factory.mktemp("plugin"))


def run_python(code: str, env: dict[str, str]) -> str:
    """In a fresh interpreter: entry points are read at import time of the process."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_plugin_policies_are_found_and_used_by_name(plugin_installed, tiny_models):
    out = run_python(f"""
from radixserve import Engine
from radixserve.policies import available
print(sorted(available("eviction")), sorted(available("schedule")))
prompts = [[5, 6, 7, 8, 9, 10], [5, 6], [11, 12, 13]]
params = {{"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
plain = Engine({str(tiny_models["llama"])!r}, dtype="float32").generate(input_ids=prompts, sampling_params=params)
e = Engine({str(tiny_models["llama"])!r}, dtype="float32", max_total_tokens=20, check_invariants=True,
           eviction_policy="demo-largest-first", schedule_policy="demo-shortest-first")
got = e.generate(input_ids=prompts, sampling_params=params)
assert [r["output_ids"] for r in got] == [r["output_ids"] for r in plain]
print(e.policies()["eviction"]["current"], e.policies()["schedule"]["current"], e.cache_stats()["totals"]["evicted_tokens"] > 0)
""", plugin_installed)
    assert "demo-largest-first" in out and "demo-shortest-first" in out
    assert out.strip().endswith("demo-largest-first demo-shortest-first True")


def test_broken_plugins_are_named_and_the_engine_carries_on(plugin_installed, tiny_models):
    out = run_python(f"""
from radixserve import Engine
e = Engine({str(tiny_models["llama"])!r}, dtype="float32", max_total_tokens=60, check_invariants=True)
try:
    e.set_policies(schedule="demo-broken-import")
except ValueError as exc:
    print("IMPORT:", exc)
e.set_policies(eviction="demo-broken-key", schedule="demo-broken-order")
out = e.generate(input_ids=[[1, 2, 3, 4, 5] * 4, [6, 7, 8] * 5], sampling_params={{"max_new_tokens": 20}})
info = e.policies()
print("CURRENT:", info["eviction"]["current"], info["schedule"]["current"])
print("ERRORS:", info["errors"])
""", plugin_installed)
    assert "IMPORT: schedule policy 'demo-broken-import' (radixserve_demo_policies.missing_module:Nothing) " \
           "failed to load: ModuleNotFoundError" in out
    assert "CURRENT: lru fcfs" in out
    assert "demo-broken-order" in out and "demo-broken-key" in out and "broken on purpose" in out


def test_server_switches_to_a_plugin_and_survives_broken_ones(plugin_installed, tiny_models):
    server = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32", "--max-total-tokens",
                           "300", "--eviction-policy", "demo-largest-first", "--check-invariants", env=plugin_installed)
    try:
        url = server.url
        assert httpx.get(url + "/policies").json()["eviction"]["current"] == "demo-largest-first"
        bad = httpx.post(url + "/policies", json={"schedule": "demo-broken-import"})
        assert bad.status_code == 400 and "demo-broken-import" in bad.json()["error"]["message"]
        ok = httpx.post(url + "/policies", json={"schedule": "demo-broken-order"})
        assert ok.status_code == 200 and ok.json()["schedule"]["current"] == "demo-broken-order"
        r = httpx.post(url + "/generate", timeout=60, json={"input_ids": [[3] * 40, [4] * 40],
                                                            "sampling_params": {"max_new_tokens": 8}})
        assert r.status_code == 200
        info = httpx.get(url + "/policies").json()
        assert info["schedule"]["current"] == "fcfs", "back on the policy in charge before"
        assert any("demo-broken-order" in e for e in info["errors"])
        assert httpx.get(url + "/health").status_code == 200
    finally:
        assert server.stop() == 0
