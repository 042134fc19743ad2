"""Full-stack cost of a trivial request: HTTP -> api -> tokenizer -> scheduler -> runner and back, for a
one-token completion of a one-word prompt. Starts its own server (bundled SmolLM2 unless --model-path).

    python benchmarks/serve_trivial.py [--requests 200] [--concurrency 1,16]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import aiohttp
from tqdm import tqdm

from radixserve.server_process import ServerProcess


async def run(url: str, model: str, n: int, concurrency: int) -> tuple[float, list[float]]:
    sem = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    async with aiohttp.ClientSession() as session:
        async def one(bar) -> None:
            async with sem:
                t = time.perf_counter()
                async with session.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
                latencies.append(time.perf_counter() - t)
                bar.update()

        with tqdm(total=n, desc=f"concurrency {concurrency}") as bar:
            start = time.perf_counter()
            await asyncio.gather(*(one(bar) for _ in range(n)))
            elapsed = time.perf_counter() - start
    return n / elapsed, latencies


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", default="1,16")
    args = ap.parse_args()
    extra = ["--model-path", args.model_path] if args.model_path else []
    server = ServerProcess(*extra, "--max-total-tokens", "8192")
    try:
        import httpx

        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        asyncio.run(run(server.url, model, 20, 1))  # warm-up
        print(f"\n{'concurrency':>11} {'req/s':>8} {'p50 latency = TTFT (ms)':>24} {'p90 (ms)':>9}")
        for c in map(int, args.concurrency.split(",")):
            rps, lat = asyncio.run(run(server.url, model, args.requests, c))
            q = statistics.quantiles(lat, n=10)
            print(f"{c:>11} {rps:>8.1f} {statistics.median(lat) * 1000:>24.1f} {q[8] * 1000:>9.1f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
