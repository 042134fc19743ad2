"""Concurrency, client disconnects and actor crashes, against servers on the tiny fp32 model."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest

from conftest import ServerProcess

PROMPTS = [[{"role": "user", "content": f"Request number {i}: tell me about topic {i * 7 % 13}."}] for i in range(32)]


def test_32_concurrent_streams_match_sequential(tiny_server):
    sync = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x")
    kw = dict(model="tiny", temperature=0, max_tokens=20)

    async def stream_one(client, messages):
        chunks = await client.chat.completions.create(messages=messages, stream=True, **kw)
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    async def all_at_once():
        client = openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0)
        return await asyncio.gather(*(stream_one(client, m) for m in PROMPTS))

    concurrent = asyncio.run(all_at_once())
    one_by_one = [sync.chat.completions.create(messages=m, **kw).choices[0].message.content for m in PROMPTS]
    assert concurrent == one_by_one
    assert len(set(one_by_one)) > 1, "different prompts, different outputs: the streams did not mix"


def status(server) -> dict:
    return httpx.get(server.url + "/get_server_info").json()["status"]


def test_disconnected_streams_release_their_kv(tiny_server):
    async def hang_up(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": "tiny", "prompt": [7 + i] * 50, "max_tokens": 400, "temperature": 0, "stream": True,
                "ignore_eos": True}
        got = 0
        async with client.stream("POST", tiny_server.url + "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                got += line.startswith("data:")
                if got >= 3:
                    break  # leaving the context closes the connection mid-stream
        return got

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(hang_up(client, i) for i in range(6)))

    assert asyncio.run(main()) == [3] * 6
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        s = status(tiny_server)
        if s["running"] == 0 and s["waiting"] == 0 and s["protected"] == 0:
            break
        time.sleep(0.2)
    assert s["running"] == 0 and s["protected"] == 0, s
    # nearly the whole pool (1200 slots) for one request: only possible if the hung-up ones let go
    r = httpx.post(tiny_server.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": list(range(100, 600)), "max_tokens": 650, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 650
    # and /abort_request works on a running one
    async def abort_one():
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"text": "x", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}, "stream": True,
                    "rid": "to-abort"}
            async with client.stream("POST", tiny_server.url + "/generate", json=body) as resp:
                lines = resp.aiter_lines()
                await anext(lines)
                ab = await client.post(tiny_server.url + "/abort_request", json={"rid": "to-abort"})
                last = [line async for line in lines if line.startswith("data: {")][-1]
                return ab, last

    ab, last = asyncio.run(abort_one())
    assert ab.status_code == 200 and ab.json()["aborted"] == ["to-abort"]
    assert '"type":"abort"' in last


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split()[2] != "Z"


def test_killing_the_runner_ends_the_server(tiny_models):
    server = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32", "--max-total-tokens",
                           "600")
    try:
        actors = httpx.get(server.url + "/get_server_info").json()["actors"]
        pids = [a["pid"] for a in actors.values()]
        os.kill(actors["runner"]["pid"], signal.SIGKILL)
        start = time.monotonic()
        code = server.proc.wait(timeout=20)
        took = time.monotonic() - start
    finally:
        server.stop()
    assert code != 0 and took < 10
    assert "the runner actor exited with code -9" in server.output()
    time.sleep(0.5)
    assert not any(alive(p) for p in pids), "orphaned actor processes"


def test_sigterm_is_a_clean_exit(tiny_models):
    server = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32", "--max-total-tokens",
                           "600", "--api-key", "sesame")
    try:
        assert httpx.get(server.url + "/health").status_code == 200  # open without a key
        denied = httpx.get(server.url + "/v1/models")
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        ok = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200
        info = httpx.get(server.url + "/get_server_info", headers={"Authorization": "Bearer sesame"}).json()
        pids = [a["pid"] for a in info["actors"].values()]
        assert "sesame" not in str(info), "the key is not shown"
    finally:
        code = server.stop()
    assert code == 0
    time.sleep(0.5)
    assert not any(alive(p) for p in pids)
    assert not os.path.exists(info["runtime_dir"]), "the runtime dir was removed"


def test_generate_flush_and_metrics(tiny_server):
    url = tiny_server.url
    one = httpx.post(url + "/generate", timeout=60, json={"text": "metrics check prompt, fairly long " * 3,
                                                          "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert one.status_code == 200 and one.json()["meta_info"]["completion_tokens"] == 4
    batch = httpx.post(url + "/generate", timeout=60, json={"input_ids": [[1, 2, 3], [4, 5]],
                                                            "sampling_params": {"max_new_tokens": 2}})
    assert [len(r["output_ids"]) for r in batch.json()] == [2, 2]
    with httpx.stream("POST", url + "/generate", timeout=60, json={
            "text": "stream me", "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]" and '"completion_tokens":3' in events[-2]
    again = httpx.post(url + "/generate", timeout=60, json={"text": "metrics check prompt, fairly long " * 3,
                                                            "sampling_params": {"max_new_tokens": 4}})
    assert again.json()["meta_info"]["cached_tokens"] > 0
    flushed = httpx.post(url + "/flush_cache", json={}, timeout=60).json()
    assert flushed["tokens_freed"] > 0
    cold = httpx.post(url + "/generate", timeout=60, json={"text": "metrics check prompt, fairly long " * 3,
                                                           "sampling_params": {"max_new_tokens": 4}})
    assert cold.json()["meta_info"]["cached_tokens"] == 0
    metrics = httpx.get(url + "/metrics").text
    for name in ("radixserve_cache_hit_rate", "radixserve_cached_tokens_total", "radixserve_prompt_tokens_total",
                 "radixserve_generation_tokens_total", "radixserve_time_to_first_token_seconds_bucket",
                 "radixserve_inter_token_latency_seconds_bucket", "radixserve_e2e_request_latency_seconds_bucket",
                 "radixserve_num_running_requests", "radixserve_num_queued_requests", "radixserve_kv_pool_usage"):
        assert name in metrics, name
    hit = [line for line in metrics.splitlines() if line.startswith("radixserve_cache_hit_rate ")][0]
    assert 0 < float(hit.split()[1]) < 1


def test_an_actor_failing_to_start_is_named(tiny_models, tmp_path):
    """A checkpoint with a weight missing: the runner cannot start, and the error says so (exit 1, no hang)."""
    import shutil
    import subprocess
    import sys

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_models["llama"], broken)
    weights = load_file(broken / "model.safetensors")
    weights.pop("model.layers.1.mlp.down_proj.weight")
    save_file(weights, broken / "model.safetensors")
    proc = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--model-path", str(broken), "--port", "0"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1
    assert "the runner actor failed to start: ValueError: checkpoint is missing 1 weights" in proc.stderr
