"""What no single client may do to everyone else: crash an actor, flood the queue, stall the server, take over
another request's id, abort requests by prefix -- and what the server answers instead (4xx, 429/503 with
Retry-After), with every refusal counted in /metrics. Against live servers on the tiny fp32 model."""
from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from conftest import ServerProcess

CHAT, COMP, GEN = "/v1/chat/completions", "/v1/completions", "/generate"


def chat(content: str = "hi", **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}


def long_generate(rid: str | None = None, tokens: int = 400) -> dict:
    body = {"text": "a long one", "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}, "stream": True}
    return {**body, "rid": rid} if rid else body


def status(url: str) -> dict:
    return httpx.get(url + "/get_server_info").json()["status"]


def wait_idle(url: str, timeout: float = 15) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = status(url)
        if s["running"] == 0 and s["waiting"] == 0 and s["protected"] == 0:
            return s
        time.sleep(0.2)
    raise AssertionError(f"the server did not go idle: {s}")


def metric(url: str, name: str, label: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name) and label in line:
            return float(line.split()[-1])
    return 0.0


@pytest.fixture(scope="module")
def small_server(tiny_models):
    """Little room on purpose: 2 running + 2 queued sequences, 8 per request, 1.5 s in the queue at most."""
    server = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32", "--max-total-tokens",
                           "1200", "--served-model-name", "tiny", "--max-running-requests", "2",
                           "--max-queued-requests", "2", "--max-sequences-per-request", "8", "--queue-timeout", "1.5",
                           "--check-invariants")
    yield server
    server.stop()


def test_top_k_that_once_killed_the_scheduler_is_a_400_and_the_server_serves_on(tiny_server):
    r = httpx.post(tiny_server.url + CHAT, json=chat(top_k=3_000_000_000), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"
    r = httpx.post(tiny_server.url + CHAT, json=chat(seed=-(10**30)), timeout=30)  # any integer seed: reduced
    assert r.status_code == 200
    assert httpx.get(tiny_server.url + "/health").json() == {"status": "ok", "tp_ranks": 1}


def test_a_rid_in_use_is_refused_and_abort_takes_exact_ids_only(tiny_server):
    url = tiny_server.url

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", url + GEN, json=long_generate("job-1")) as first:
                lines = first.aiter_lines()
                await anext(lines)
                dup = await client.post(url + GEN, json={"text": "again", "rid": "job-1"})
                prefix = await client.post(url + "/abort_request", json={"rid": "job"})
                other = await client.post(url + GEN, json={"text": "another", "rid": "job-12",
                                                           "sampling_params": {"max_new_tokens": 3}})
                exact = await client.post(url + "/abort_request", json={"rid": "job-1"})
                last = [line async for line in lines if line.startswith("data: {")][-1]
        return dup, prefix, other, exact, last

    dup, prefix, other, exact, last = asyncio.run(main())
    assert dup.status_code == 400 and dup.json()["error"]["code"] == "rid_in_use"
    assert prefix.status_code == 404, "no abort by prefix"
    assert other.status_code == 200 and other.json()["meta_info"]["completion_tokens"] == 3
    assert exact.status_code == 200 and exact.json()["aborted"] == ["job-1"]
    assert '"type":"abort"' in last, "the first request went on until its exact id was aborted"


def test_the_200000_prompt_flood_is_refused_at_once_and_a_fresh_request_is_served(small_server):
    url = small_server.url
    start = time.monotonic()
    flood = httpx.post(url + COMP, json={"model": "tiny", "prompt": ["x"] * 200_000, "max_tokens": 4}, timeout=60)
    assert flood.status_code == 429 and flood.headers["Retry-After"] == "1"
    assert flood.json()["error"]["code"] == "too_many_sequences" and "200000" in flood.json()["error"]["message"]
    fresh = httpx.post(url + CHAT, json=chat(), timeout=30)
    assert fresh.status_code == 200 and time.monotonic() - start < 10
    n = httpx.post(url + CHAT, json=chat(n=9), timeout=30)  # prompts x n counts: 1 x 9 > 8
    assert n.status_code == 429 and n.json()["error"]["code"] == "too_many_sequences"
    assert metric(url, "radixserve_rejected_requests_total", 'reason="too_many_sequences"') >= 2


def test_past_the_queue_cap_the_server_answers_429_with_retry_after(small_server):
    url = small_server.url

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            bodies = [{"model": "tiny", "prompt": [5 + i] * 20, "max_tokens": 100, "ignore_eos": True}
                      for i in range(10)]
            return await asyncio.gather(*(client.post(url + COMP, json=b) for b in bodies))

    rs = asyncio.run(main())
    refused = [r for r in rs if r.status_code == 429]
    assert refused and all(r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "queue_full"
                           for r in refused)
    assert all(r.status_code in (200, 429, 503) for r in rs)
    assert metric(url, "radixserve_rejected_requests_total", 'reason="queue_full"') >= len(refused)
    wait_idle(url)


def test_a_request_waiting_past_the_queue_timeout_fails_503(tiny_models):
    """Two long streams take both running places; only once each has streamed a token are two more requests
    sent, which then wait behind them past the 0.5 s queue timeout: on any machine the streams still have
    thousands of tokens to go (a step is at least half a millisecond of IPC), so no wall-clock slack is assumed.
    The streams are then left (the client closing them aborts them) rather than read to their end."""
    server = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32", "--max-total-tokens",
                           "4200", "--served-model-name", "tiny", "--max-running-requests", "2",
                           "--queue-timeout", "0.5")
    url = server.url

    streamed = []

    async def stream(client: httpx.AsyncClient, started: asyncio.Event, seed: int) -> None:
        body = {"input_ids": [9 + seed] * 10, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
                "stream": True}
        async with client.stream("POST", url + GEN, json=body) as r:
            streamed.append(r.status_code)
            async for _ in r.aiter_lines():
                started.set()

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            started = [asyncio.Event(), asyncio.Event()]
            streams = [asyncio.create_task(stream(client, started[i], i)) for i in range(2)]
            await asyncio.gather(*(e.wait() for e in started))  # both are running now
            body = {"model": "tiny", "max_tokens": 4}
            queued = await asyncio.gather(*(client.post(url + COMP, json={**body, "prompt": [30 + i] * 10})
                                            for i in range(2)))
            assert not any(task.done() for task in streams), "a stream ended before the queued requests did"
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            return queued

    try:
        queued = asyncio.run(main())
        assert [r.status_code for r in queued] == [503, 503]
        err = queued[0].json()["error"]
        assert err["code"] == "queue_timeout" and "--queue-timeout" in err["message"]
        assert queued[0].headers["Retry-After"] == "1"
        assert streamed == [200, 200]
        assert metric(url, "radixserve_rejected_requests_total", 'reason="queue_timeout"') == 2
        wait_idle(url)
    finally:
        server.stop()


def test_a_client_leaving_a_non_streaming_request_aborts_it(tiny_server):
    url = tiny_server.url
    body = {"model": "tiny", "prompt": [11] * 30, "max_tokens": 1100, "ignore_eos": True}  # seconds of work
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + COMP, json=body, timeout=1.0)  # gives up after a second; the server must notice
    s = wait_idle(url, timeout=10)
    assert s["running"] == 0 and s["protected"] == 0


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(tiny_models):
    server = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32", "--max-total-tokens",
                           "600", "--served-model-name", "tiny", "--shutdown-timeout", "30")
    try:
        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"model": "tiny", "prompt": [5] * 10, "max_tokens": 300, "ignore_eos": True, "stream": True}
                async with client.stream("POST", server.url + COMP, json=body) as resp:
                    lines = resp.aiter_lines()
                    await anext(lines)
                    server.proc.send_signal(signal.SIGTERM)
                    await asyncio.sleep(0.5)
                    refused = await client.post(server.url + CHAT, json=chat())
                    health = await client.get(server.url + "/health")
                    rest = [line async for line in lines]
            return refused, health, rest

        refused, health, rest = asyncio.run(main())
        code = server.proc.wait(timeout=30)
    finally:
        server.stop()
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["code"] == "draining"
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    assert rest[-2] == "data: [DONE]" or rest[-1] == "data: [DONE]"
    assert any('"finish_reason":"length"' in line for line in rest), "the request in flight finished"
    assert code == 0


def test_generate_batches_count_against_the_per_request_cap_too(small_server):
    r = httpx.post(small_server.url + GEN, json={"text": ["x"] * 9, "sampling_params": {"max_new_tokens": 2}},
                   timeout=30)
    assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_sequences"
    ok = httpx.post(small_server.url + GEN, json={"text": ["x"] * 2, "sampling_params": {"max_new_tokens": 2}},
                    timeout=30)
    assert ok.status_code == 200 and len(ok.json()) == 2
