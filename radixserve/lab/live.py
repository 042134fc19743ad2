"""Replaying a trace against a running server, once per policy pair (switched with POST /policies, the cache
flushed in between), measuring from the client side; and calibrating the simulator's cost model."""
from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Any

import aiohttp
import msgspec

from radixserve.lab.simulate import CostModel, RunResult, quantile, starvation
from radixserve.lab.trace import TraceRequest


class Client:
    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url, self.session = url.rstrip("/"), session

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        async with self.session.request(method, self.url + path, json=body) as resp:
            data = await resp.json(content_type=None)
            if resp.status != 200:
                raise RuntimeError(f"{method} {path}: {resp.status} {data}")
            return data

    async def generate(self, r: TraceRequest, stream: bool = True) -> tuple[float, float, dict] | None:
        """(ttft, e2e, final meta_info), or None if the server refused the request."""
        body = {"input_ids": r.prompt, "stream": stream, "priority": r.priority,
                "sampling_params": {"max_new_tokens": r.max_tokens, "temperature": 0, "ignore_eos": True}}
        start = time.perf_counter()
        ttft, meta = None, None
        async with self.session.post(self.url + "/generate", json=body) as resp:
            if resp.status == 400:
                return None
            if resp.status != 200:
                raise RuntimeError(f"/generate: {resp.status} {await resp.text()}")
            if not stream:
                meta = (await resp.json())["meta_info"]
                ttft = time.perf_counter() - start
            else:
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data: {"):
                        continue
                    event = msgspec.json.decode(line[6:])
                    if "error" in event:
                        raise RuntimeError(f"/generate stream error: {event['error']}")
                    if ttft is None and event["meta_info"]["completion_tokens"] > 0:
                        ttft = time.perf_counter() - start
                    meta = event["meta_info"]
        return ttft, time.perf_counter() - start, meta


async def _replay(client: Client, trace: list[TraceRequest], time_scale: float, progress) -> dict[str, Any]:
    done = {r.id: asyncio.Event() for r in trace}
    out: dict[str, tuple | None] = {}
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def one(r: TraceRequest) -> None:
        if r.after is not None:
            await done[r.after].wait()
            await asyncio.sleep(r.delay * time_scale)
        else:
            await asyncio.sleep(max(0.0, start + r.arrival * time_scale - loop.time()))
        try:
            out[r.id] = await client.generate(r)
        finally:
            done[r.id].set()
            if progress is not None:
                progress.update()

    await asyncio.gather(*(one(r) for r in trace))
    return {"results": out, "makespan": loop.time() - start}


async def run_live(url: str, trace: list[TraceRequest], pairs: list[tuple[str, str]] | None,
                   time_scale: float = 1.0, progress_factory=None) -> list[RunResult]:
    """One replay per pair, each switched to and started cold; ``pairs`` None: one replay with the policies the
    server runs (e.g. --auto-policy's own choice), named as it reports them."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        client = Client(url, session)
        cache_tokens = (await client.call("GET", "/get_server_info"))["max_total_tokens"]
        results = []
        for pair in pairs or [None]:
            await client.call("POST", "/flush_cache", {})  # every pair starts cold, and in an epoch of its own:
            if pair is not None:
                await client.call("POST", "/policies", {"eviction": pair[0], "schedule": pair[1]})
            policies = await client.call("GET", "/policies")
            eviction, schedule = policies["eviction"]["current"], policies["schedule"]["current"]
            if pair is None:
                eviction, schedule = f"as served ({eviction} at start)", f"as served ({schedule} at start)"
            bar = progress_factory(f"live {eviction}/{schedule}") if progress_factory else None
            run = await _replay(client, trace, time_scale, bar)
            if bar is not None:
                bar.close()
            stats = await client.call("GET", "/cache/stats")
            done = [v for v in run["results"].values() if v is not None]
            ttft = [t for t, _, _ in done]
            prompt = sum(m["prompt_tokens"] for _, _, m in done)
            cached = sum(m["cached_tokens"] for _, _, m in done)
            generated = sum(m["completion_tokens"] for _, _, m in done)
            results.append(RunResult(
                eviction=eviction, schedule=schedule, cache_tokens=cache_tokens, requests=len(done),
                rejected=len(trace) - len(done), prompt_tokens=prompt, cached_tokens=cached,
                hit_rate=cached / prompt if prompt else 0.0,
                ttft_p50_s=quantile(ttft, 50), ttft_p99_s=quantile(ttft, 99),
                **starvation(ttft, [t for t, _, m in done if not m["cached_tokens"]], []),
                e2e_p50_s=quantile([e for _, e, _ in done], 50),
                throughput_tokens_per_s=generated / run["makespan"], makespan_s=run["makespan"],
                server_epoch=stats["epochs"][-1],
            ))
        return results


async def _calibrate(url: str, repeats: int = 3) -> CostModel:
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 30000) for _ in range(n)]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        client = Client(url, session)

        async def prefill(n: int) -> float:
            times = []
            for _ in range(repeats):
                r = TraceRequest(id="cal", prompt=prompt(n), max_tokens=1)
                _, e2e, _ = await client.generate(r, stream=False)
                times.append(e2e)
            return statistics.median(times)

        async def decode(batch: int, steps: int = 24) -> float:
            """Seconds per decode step with ``batch`` requests decoding together."""
            reqs = [TraceRequest(id=f"cal{i}", prompt=prompt(16), max_tokens=steps + 1) for i in range(batch)]
            outs = await asyncio.gather(*(client.generate(r) for r in reqs))
            return statistics.median((e2e - ttft) / steps for ttft, e2e, _ in outs)

        await prefill(16)  # warm-up
        short, long = await prefill(32), await prefill(512)
        per_token = max((long - short) / 480, 1e-6)
        d1, d8 = await decode(1), await decode(8)
        per_seq = max((d8 - d1) / 7, 0.0)
        return CostModel(prefill_per_token=per_token, decode_per_step=max(d1 - per_seq, 1e-4),
                         decode_per_seq=per_seq, step_overhead=max(short - 32 * per_token, 0.0))


def calibrate(url: str) -> CostModel:
    """Fit the cost model to a live server: a 32- and a 512-token prefill, decode steps at batch 1 and 8."""
    return asyncio.run(_calibrate(url))


def live(url: str, trace: list[TraceRequest], pairs: list[tuple[str, str]] | None, time_scale: float = 1.0,
         progress_factory=None) -> list[RunResult]:
    return asyncio.run(run_live(url, trace, pairs, time_scale, progress_factory))
