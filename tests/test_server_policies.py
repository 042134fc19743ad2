"""Live policy switching over HTTP: GET/POST /policies, /cache/stats epochs, policy-labelled metrics."""
from __future__ import annotations

import asyncio

import httpx

PROMPTS = [[{"role": "user", "content": f"Switch test {i}: say something about {i * 3}."}] for i in range(8)]


def test_get_and_bad_posts(tiny_server):
    url = tiny_server.url
    info = httpx.post(url + "/policies", json={"eviction": "lru", "schedule": "fcfs"}).json()
    assert info == httpx.get(url + "/policies").json()
    assert info["eviction"]["current"] == "lru" and "gdsf" in info["eviction"]["available"]
    assert info["schedule"]["current"] == "fcfs" and "lpm-aging" in info["schedule"]["available"]
    bad = httpx.post(url + "/policies", json={"eviction": "nope"})
    assert bad.status_code == 400
    err = bad.json()["error"]
    assert err["param"] == "eviction" and err["code"] == "unknown_policy" and "available: fifo, filo" in err["message"]
    assert httpx.post(url + "/policies", json={}).status_code == 400
    assert httpx.post(url + "/policies", json={"schedule": 3}).status_code == 400
    assert httpx.get(url + "/policies").json()["eviction"]["current"] == "lru", "a refused switch changes nothing"


def test_switching_mid_stream_keeps_outputs_exact(tiny_server):
    url = tiny_server.url
    body = dict(model="tiny", temperature=0, max_tokens=30)
    sequential = [httpx.post(url + "/v1/chat/completions", json={**body, "messages": m}, timeout=60)
                  .json()["choices"][0]["message"]["content"] for m in PROMPTS]
    epochs_before = len(httpx.get(url + "/cache/stats").json()["epochs"])

    async def stream(client, messages):
        text = ""
        async with client.stream("POST", url + "/v1/chat/completions",
                                 json={**body, "messages": messages, "stream": True}) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    delta = httpx.Response(200, content=line[6:]).json()["choices"]
                    text += (delta[0].get("delta", {}).get("content") or "") if delta else ""
        return text

    async def switcher(client):
        for ev, sc in [("gdsf", "lpm"), ("lfu", "dfs-weight"), ("slru", "lpm-aging"), ("mru", "random"),
                       ("lru", "fcfs")]:
            await asyncio.sleep(0.05)
            r = await client.post(url + "/policies", json={"eviction": ev, "schedule": sc})
            assert r.status_code == 200 and r.json()["eviction"]["current"] == ev

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            *texts, _ = await asyncio.gather(*(stream(client, m) for m in PROMPTS), switcher(client))
            return texts

    assert asyncio.run(main()) == sequential
    stats = httpx.get(url + "/cache/stats").json()
    assert len(stats["epochs"]) == epochs_before + 5
    last = stats["epochs"][-1]
    assert (last["eviction"], last["schedule"], last["current"]) == ("lru", "fcfs", True)
    assert set(stats["pool"]) >= {"capacity", "free", "evictable", "protected"}
    assert stats["pool"]["protected"] == 0
    for e in stats["epochs"]:
        assert set(e) >= {"eviction", "schedule", "started", "requests", "prompt_tokens", "cached_tokens",
                          "hit_rate", "evicted_tokens", "ttft_p50_s", "ttft_p99_s", "throughput_tokens_per_s"}
    assert sum(e["requests"] for e in stats["epochs"]) == stats["totals"]["requests_finished"]


def test_metrics_carry_the_policy_label(tiny_server):
    url = tiny_server.url
    httpx.post(url + "/policies", json={"eviction": "lfu"})
    httpx.post(url + "/generate", timeout=60, json={"text": "label me", "sampling_params": {"max_new_tokens": 2}})
    import time

    time.sleep(0.5)  # the scheduler reports its status a few times a second
    metrics = httpx.get(url + "/metrics").text
    assert 'radixserve_policy_requests{eviction="lfu",schedule="fcfs"}' in metrics
    assert 'radixserve_policy_cache_hit_rate{eviction="lfu",schedule="fcfs"}' in metrics
    httpx.post(url + "/policies", json={"eviction": "lru"})
