"""The serving scenarios of ``make bench``, each run against radixserve (radix cache on and off) and, where it
applies, the HF baselines -- same model, dtype and token ids. All prompts are seeded."""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import aiohttp
import msgspec

from harness import RunResult, best_hf, hf_batched, hf_sequential, llama_run, mean, radix_run

WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more write "
         "go see number no way could people my than first water been call who oil its now find long down day did "
         "get come made may part over new sound take only little work know place year live me back give most very "
         "after thing our just name good sentence man think say great where help through much before line right "
         "too mean old any same tell boy follow came want show also around form three small set put end does "
         "another well large must big even such because turn here why ask went men read need land different home "
         "us move try kind hand picture again change off play spell air away animal house point page letter").split()


def text(rng: random.Random, words: int) -> str:
    out = []
    while len(out) < words:
        sentence = [rng.choice(WORDS) for _ in range(rng.randrange(6, 16))]
        out += [sentence[0].capitalize(), *sentence[1:-1], sentence[-1] + "."]
    return " ".join(out[:words])


def chat_ids(tok, system: str | None, user: str) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return tok.apply_chat_template(messages)


def questions(rng: random.Random, n: int) -> list[str]:
    return [f"Question {i}: {text(rng, rng.randrange(12, 24))} What does this mean?" for i in range(n)]


class SharedPrefix:
    """One long system prompt (~1k tokens) + N different questions, all sent at once (the seed's §3.2 shape)."""

    name = "shared prefix"

    def __init__(self, tok, n: int, max_new: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.system = "You are the assistant of a large company. Here is the handbook. " + text(rng, 760)
        self.prompts = [chat_ids(tok, self.system, q) for q in questions(rng, n)]
        self.system_tokens = len(tok.apply_chat_template([{"role": "system", "content": self.system}], False))
        self.max_new = max_new

    def radix(self, url: str, label: str) -> RunResult:
        import httpx

        httpx.post(url + "/flush_cache", json={})
        return radix_run(label, url, self.prompts, self.max_new)

    def llama(self, url: str, label: str) -> RunResult:
        return llama_run(label, url, self.prompts, self.max_new)

    def hf(self, model, pad_id: int) -> list[RunResult]:
        return [hf_sequential(model, self.prompts, self.max_new), hf_batched(model, self.prompts, self.max_new, pad_id)]


class SeedSmallCase:
    """The seed's small case: a one-line shared prefix, 3 questions sharing it vs 3 with a prefix each, sent one
    after another; the latency reduction the shared prefix buys."""

    name = "seed small case"

    def __init__(self, tok, max_new: int = 8, seed: int = 1) -> None:
        rng = random.Random(seed)
        shared = "You are a helpful assistant who answers questions about geography in one sentence."
        qs = ["What is the capital of France?", "What is the longest river in Africa?", "Where is Mount Fuji?"]
        self.shared = [chat_ids(tok, shared, q) for q in qs]
        self.unique = [chat_ids(tok, f"{text(rng, 12)} {text(rng, 2)}", q) for q in qs]
        self.max_new = max_new

    def radix(self, url: str, label: str) -> dict:
        import httpx

        httpx.post(url + "/flush_cache", json={})
        shared = radix_run(label, url, self.shared, self.max_new, sequential=True)
        unique = radix_run(label, url, self.unique, self.max_new, sequential=True)
        return {"system": label, "shared_latency_s": mean(shared.e2e), "unique_latency_s": mean(unique.e2e),
                "shared_ttft_s": mean(shared.ttft), "unique_ttft_s": mean(unique.ttft),
                "shared_cached_tokens": shared.cached_tokens,
                "latency_reduction": 1 - mean(shared.e2e) / mean(unique.e2e),
                "ttft_reduction": 1 - mean(shared.ttft) / mean(unique.ttft)}


class Unique:
    """N prompts sharing nothing, all at once: the cache cannot help; it must not cost either. Plain text, not
    the chat template (SmolLM2's template starts every conversation with the same default system prompt)."""

    name = "unique prompts"

    def __init__(self, tok, n: int, words: int, max_new: int, seed: int = 2) -> None:
        rng = random.Random(seed)
        self.prompts = [tok.encode(f"{text(rng, words)} In short:") for _ in range(n)]
        self.max_new = max_new

    def radix(self, url: str, label: str) -> RunResult:
        import httpx

        httpx.post(url + "/flush_cache", json={})  # runs repeat: nothing may be cached from the last one
        return radix_run(label, url, self.prompts, self.max_new)

    def hf(self, model, pad_id: int) -> list[RunResult]:
        return [hf_sequential(model, self.prompts, self.max_new), hf_batched(model, self.prompts, self.max_new, pad_id)]


@dataclass
class Chats:
    """One system's side of a multi-turn run: its conversations so far and each round's figures."""

    histories: list[list[dict]]
    rounds: list[dict] = field(default_factory=list)


class MultiTurn:
    """C conversations x R rounds (the seed's §1.2 shape): each round, every conversation sends its whole history
    plus a new question, all at once; the answers come from the server and join the history."""

    name = "multi-turn"

    def __init__(self, conversations: int, rounds: int, max_new: int, seed: int = 3) -> None:
        rng = random.Random(seed)
        self.system = "You are a patient tutor. Answer every question carefully. " + text(rng, 380)
        self.openers = [f"Conversation {c}: {text(rng, 20)}" for c in range(conversations)]
        self.followups = [[f"Follow-up {r}: {text(rng, 14)}?" for r in range(rounds)] for _ in range(conversations)]
        self.rounds, self.max_new = rounds, max_new

    def radix(self, url: str, label: str, model: str, keep_alive: bool = True) -> dict:
        """One system's whole run. ``keep_alive=False`` for llama-server, which closes a kept-alive connection
        after a few requests."""
        chats = self.start()
        for r in range(self.rounds):
            self.round(url, chats, r, model, keep_alive)
        return self.result(label, chats)

    def start(self) -> Chats:
        """One system's conversations before their first round (the system prompt each)."""
        return Chats([[{"role": "system", "content": self.system}] for _ in self.openers])

    def round(self, url: str, chats: Chats, r: int, model: str, keep_alive: bool = True) -> None:
        """Round ``r`` on one system: every conversation's next question at once, the answers joining ``chats``
        (so systems can take turns round by round, each with its own chats)."""
        asyncio.run(self._round(url, chats, r, model, keep_alive))

    @staticmethod
    def result(label: str, chats: Chats) -> dict:
        return {"system": label, "rounds": chats.rounds,
                "ttft_ratio_last_first": chats.rounds[-1]["ttft_mean_s"] / chats.rounds[0]["ttft_mean_s"]}

    async def _round(self, url: str, chats: Chats, r: int, model: str, keep_alive: bool) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                         connector=aiohttp.TCPConnector(force_close=not keep_alive)) as session:
            for c, h in enumerate(chats.histories):
                h.append({"role": "user", "content": self.openers[c] if r == 0 else self.followups[c][r]})
            outs = await asyncio.gather(*(self._turn(session, url, model, h) for h in chats.histories))
        for h, (_, answer, _) in zip(chats.histories, outs):
            h.append({"role": "assistant", "content": answer})
        prompt = sum(u["prompt_tokens"] for _, _, u in outs)
        # llama-server's usage has no cached_tokens: its hit rate is not known
        cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens") for _, _, u in outs]
        chats.rounds.append({"round": r + 1, "ttft_mean_s": mean([t for t, _, _ in outs]), "prompt_tokens": prompt,
                             "hit_rate": None if None in cached else sum(cached) / prompt})

    async def _turn(self, session, url, model, messages) -> tuple[float, str, dict]:
        return await stream_chat(session, url, {"model": model, "messages": messages, "max_tokens": self.max_new,
                                                "temperature": 0})


async def stream_chat(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, str, dict | None]:
    """One chat completion, streamed with usage: (TTFT -- the whole time if no text came --, the answer, usage)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start, ttft, answer, usage = time.perf_counter(), None, "", None
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            chunk = msgspec.json.decode(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                piece = choice.get("delta", {}).get("content")
                if piece:
                    ttft = ttft or time.perf_counter() - start
                    answer += piece
    return ttft if ttft is not None else time.perf_counter() - start, answer, usage


__all__ = ["MultiTurn", "SeedSmallCase", "SharedPrefix", "Unique", "best_hf", "stream_chat"]
