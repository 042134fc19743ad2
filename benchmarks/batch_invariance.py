"""The report behind ``--deterministic``: 64 concurrent clients ask 8 questions greedily; how many answers differ
from the same question asked alone? Once against a default server, once against a ``--deterministic`` one.

    python benchmarks/batch_invariance.py [--rounds 2] [--max-tokens 24] [--model-path P]
"""
from __future__ import annotations

import argparse
import asyncio

import httpx

from radixserve.server_process import ServerProcess

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 12 times 12?",
             "Write a haiku about the sea.", "Who wrote Hamlet?", "What is photosynthesis?",
             "Give me a synonym for happy.", "How many legs does a spider have?"]


def differing(url: str, model: str, rounds: int, max_tokens: int) -> tuple[int, int]:
    """(answers that differ from the question asked alone, answers) over ``rounds`` waves of 64 clients."""
    def body(q: str) -> dict:
        return {"model": model, "messages": [{"role": "user", "content": q}], "temperature": 0,
                "max_tokens": max_tokens}

    def answer(r: httpx.Response) -> str:
        return r.json()["choices"][0]["message"]["content"]

    alone = [answer(httpx.post(url + "/v1/chat/completions", json=body(q), timeout=300)) for q in QUESTIONS]

    async def wave() -> list[str]:
        async with httpx.AsyncClient(timeout=600) as client:
            rs = await asyncio.gather(*(client.post(url + "/v1/chat/completions", json=body(QUESTIONS[i % 8]))
                                        for i in range(64)))
        return [answer(r) for r in rs]

    diff = 0
    for _ in range(rounds):
        diff += sum(a != alone[i % 8] for i, a in enumerate(asyncio.run(wave())))
    return diff, 64 * rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--model-path", default=None)
    args = ap.parse_args()
    extra = ["--model-path", args.model_path] if args.model_path else []
    for flags in ([], ["--deterministic"]):
        server = ServerProcess("--max-total-tokens", "8192", *extra, *flags)
        try:
            model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
            diff, total = differing(server.url, model, args.rounds, args.max_tokens)
        finally:
            server.stop()
        print(f"{' '.join(flags) or 'default':>16}: {diff} of {total} answers differ from the question asked alone")


if __name__ == "__main__":
    main()
