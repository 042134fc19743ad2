"""What every benchmark scenario needs: prompts as token ids, radixserve driven over HTTP (all requests sent
at once, streamed, timed from the client), and the HF transformers baselines a user would otherwise write:
``generate`` one prompt at a time, and ``generate`` on the whole batch with left padding."""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import msgspec
import torch


@dataclass
class RunResult:
    """One system on one scenario: per-request TTFT and latency, totals."""

    system: str
    ttft: list[float]
    e2e: list[float]
    makespan: float
    generated: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.generated / self.makespan

    def summary(self) -> dict:
        return {"system": self.system, "requests": len(self.ttft), "throughput_tok_s": self.throughput,
                "ttft_p50_s": pct(self.ttft, 50), "ttft_p90_s": pct(self.ttft, 90), "e2e_mean_s": mean(self.e2e),
                "makespan_s": self.makespan, "generated_tokens": self.generated,
                "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None, **self.extra}


def stage_cli(doc: str, default_out: str) -> argparse.Namespace:
    """The flags every stage script takes when run alone: --dtype, --repeats, --quick, --model-path, --out."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--out", default=default_out)
    return ap.parse_args()


def write_json(res: dict, path: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out}")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


# -- radixserve over HTTP -----------------------------------------------------------------------------------
async def _generate(session: aiohttp.ClientSession, url: str, ids: list[int], max_new: int) -> tuple:
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    start = time.perf_counter()
    ttft, meta = None, None
    async with session.post(url + "/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.strip()
            if line.startswith(b"data: {"):
                meta = msgspec.json.decode(line[6:])["meta_info"]
                if ttft is None and meta["completion_tokens"] > 0:
                    ttft = time.perf_counter() - start
    return ttft, time.perf_counter() - start, meta


async def _all_at_once(url: str, prompts: list[list[int]], max_new: int, sequential: bool) -> list[tuple]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        if sequential:
            return [await _generate(session, url, p, max_new) for p in prompts]
        return await asyncio.gather(*(_generate(session, url, p, max_new) for p in prompts))


def radix_run(system: str, url: str, prompts: list[list[int]], max_new: int, sequential: bool = False) -> RunResult:
    """All prompts sent at once (or one after another), greedy, exactly ``max_new`` tokens each."""
    start = time.perf_counter()
    outs = asyncio.run(_all_at_once(url, prompts, max_new, sequential))
    makespan = time.perf_counter() - start
    return RunResult(system, [t for t, _, _ in outs], [e for _, e, _ in outs], makespan,
                     sum(m["completion_tokens"] for _, _, m in outs), sum(m["prompt_tokens"] for _, _, m in outs),
                     sum(m["cached_tokens"] for _, _, m in outs))


# -- llama.cpp's llama-server over HTTP ----------------------------------------------------------------------
async def _llama_generate(session: aiohttp.ClientSession, url: str, ids: list[int], max_new: int) -> tuple:
    body = {"prompt": ids, "n_predict": max_new, "ignore_eos": True, "stream": True, "temperature": 0,
            "cache_prompt": True}
    start = time.perf_counter()
    ttft, last = None, {}
    async with session.post(url + "/completion", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.strip()
            if line.startswith(b"data: {"):
                last = msgspec.json.decode(line[6:])
                if ttft is None and (last.get("content") or last.get("tokens")):
                    ttft = time.perf_counter() - start
    timings = last.get("timings", {})
    return ttft, time.perf_counter() - start, {"completion_tokens": timings.get("predicted_n", max_new),
                                               "prompt_tokens": len(ids),
                                               "cached_tokens": timings.get("cache_n", 0)}


def llama_run(system: str, url: str, prompts: list[list[int]], max_new: int) -> RunResult:
    """``radix_run`` against llama-server's /completion (token ids in, its own prompt cache on)."""

    async def all_at_once() -> list[tuple]:
        # llama-server closes a kept-alive connection after a few requests: one connection per request
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                         timeout=aiohttp.ClientTimeout(total=None)) as session:
            return await asyncio.gather(*(_llama_generate(session, url, p, max_new) for p in prompts))

    start = time.perf_counter()
    outs = asyncio.run(all_at_once())
    makespan = time.perf_counter() - start
    return RunResult(system, [t for t, _, _ in outs], [e for _, e, _ in outs], makespan,
                     sum(m["completion_tokens"] for _, _, m in outs), sum(m["prompt_tokens"] for _, _, m in outs),
                     sum(m["cached_tokens"] for _, _, m in outs))


# -- HF transformers baselines ------------------------------------------------------------------------------
class FirstTokenClock:
    """A stopping criterion that never stops: it notes when the first new token exists."""

    def __init__(self) -> None:
        self.first: float | None = None

    def __call__(self, input_ids, scores, **kw):
        if self.first is None:
            self.first = time.perf_counter()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def load_hf(path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.inference_mode()
def _hf_generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new: int) -> FirstTokenClock:
    from transformers import StoppingCriteriaList

    clock = FirstTokenClock()
    model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new,
                   min_new_tokens=max_new, do_sample=False, pad_token_id=model.config.pad_token_id or 0,
                   stopping_criteria=StoppingCriteriaList([clock]))
    return clock


def hf_sequential(model, prompts: list[list[int]], max_new: int) -> RunResult:
    """One ``generate`` per prompt, in order; every request arrived at t=0, so TTFT includes the wait."""
    start = time.perf_counter()
    ttft, e2e = [], []
    for p in prompts:
        ids = torch.tensor([p])
        clock = _hf_generate(model, ids, torch.ones_like(ids), max_new)
        ttft.append(clock.first - start)
        e2e.append(time.perf_counter() - start)
    return RunResult("HF sequential", ttft, e2e, time.perf_counter() - start, max_new * len(prompts))


def hf_batched(model, prompts: list[list[int]], max_new: int, pad_id: int) -> RunResult:
    """One ``generate`` over all prompts, left-padded to the longest."""
    longest = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    clock = _hf_generate(model, ids, mask, max_new)
    end = time.perf_counter()
    n = len(prompts)
    return RunResult("HF batched", [clock.first - start] * n, [end - start] * n, end - start, max_new * n)


def best_hf(*runs: RunResult) -> RunResult:
    return max(runs, key=lambda r: r.throughput)
