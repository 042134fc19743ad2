"""The shadow process end to end: a server with --shadow-policies and --auto-policy on a tiny model, the routes and
metrics it feeds, the server outliving its shadow, and the flags that are refused."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from radixserve.server_process import ServerProcess


# -- the server's shadow process ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shadow_server(tiny_models):
    server = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32",
                           "--max-total-tokens", "300", "--served-model-name", "tiny",
                           "--shadow-policies", "lru,mru,lfu", "--auto-policy", "--auto-policy-hold", "0",
                           "--auto-policy-cooldown", "0", "--auto-policy-margin", "0.05", "--shadow-window", "600",
                           "--auto-policy-metric", "hit_rate")  # a tiny model's steps take ~1 ms: TTFTs hardly differ
    yield server
    server.stop()


def generate(url: str, ids: list[int]) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}
    return httpx.post(url + "/generate", json=body, timeout=60).json()


def test_shadows_report_and_auto_policy_switches_on_a_scan(shadow_server):
    """Four 90-token prefixes cycled through a 300-token pool: LRU always evicts the one that comes back next,
    MRU keeps some; the shadow sees it and --auto-policy switches the server to mru."""
    url = shadow_server.url
    prefixes = [[1000 + 100 * p + i for i in range(90)] for p in range(4)]
    for i in range(32):
        generate(url, prefixes[i % 4] + [5 + i])
    report = {}
    for _ in range(100):  # the shadow reports once a second
        report = httpx.get(url + "/policies/shadow").json()
        if report.get("switches") and sum(r["requests"] for r in report["pairs"]) == 3 * 32:
            break
        time.sleep(0.2)
    assert report["enabled"] and report["auto_policy"] and report["window_s"] == 600
    rows = {r["eviction"]: r for r in report["pairs"]}
    assert set(rows) == {"lru", "mru", "lfu"} and all(r["schedule"] == "fcfs" for r in rows.values())
    assert rows["mru"]["hit_rate"] > rows["lru"]["hit_rate"], rows
    assert report["switches"] and report["switches"][0]["to"]["eviction"] == "mru", json.dumps(report)
    assert "better" in report["switches"][0]["reason"]
    stats = httpx.get(url + "/cache/stats").json()
    assert stats["shadow"]["pairs"] and stats["epochs"][-1]["eviction"] == "mru"
    assert stats["epochs"][-1]["reason"].startswith("auto-policy: mru/fcfs")
    assert httpx.get(url + "/policies").json()["eviction"]["current"] == "mru"
    metrics = httpx.get(url + "/metrics").text
    assert 'radixserve_shadow_cache_hit_rate{eviction="mru",schedule="fcfs"}' in metrics
    assert "radixserve_auto_policy_switches 1.0" in metrics or "radixserve_auto_policy_switches 2.0" in metrics
    for key in ("cold_ttft_p99_s", "max_queue_wait_s", "slowest5_ttft_share"):
        assert rows["lru"][key] is not None and stats["epochs"][0][key] is not None, key


def test_the_server_serves_on_when_the_shadow_dies(shadow_server):
    import os
    import signal

    url = shadow_server.url
    pid = httpx.get(url + "/get_server_info").json()["actors"]["shadow"]["pid"]
    os.kill(pid, signal.SIGKILL)
    time.sleep(1.5)  # the launcher looks every half second
    assert httpx.get(url + "/health").status_code == 200
    assert generate(url, [5, 6, 7])["meta_info"]["completion_tokens"] == 2


def test_without_shadows_the_route_says_how_to_turn_them_on(tiny_server):
    body = httpx.get(tiny_server.url + "/policies/shadow").json()
    assert body["enabled"] is False and "--shadow-policies" in body["message"]
    assert httpx.get(tiny_server.url + "/cache/stats").json()["shadow"]["enabled"] is False


@pytest.mark.parametrize("flags, message", [
    (["--auto-policy"], "give --shadow-policies"),
    (["--shadow-policies", "lru,nope"], "neither an eviction policy"),
    (["--shadow-policies", "all", "--disable-radix-cache"], "no cache to compare"),
    (["--shadow-policies", "all", "--auto-policy-metric", "speed"], "choose one of"),
])
def test_bad_shadow_flags_are_refused(flags, message):
    from radixserve.server_args import ServerArgs

    kw = {}
    it = iter(flags)
    for flag in it:
        name = flag[2:].replace("-", "_")
        kw[name] = True if name in ("auto_policy", "disable_radix_cache") else next(it)
    with pytest.raises(ValueError, match=message):
        args = ServerArgs(**kw)
        from radixserve.lab.shadow import resolve_pairs

        resolve_pairs(args.shadow_policies, (args.eviction_policy, args.schedule_policy))
