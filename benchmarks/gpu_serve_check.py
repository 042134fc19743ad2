"""`radixserve serve` on a GPU in bf16 under a short shared-prefix load (run by benchmarks/gpu_check.sh).

The model: $MODEL_PATH, else the bundled SmolLM2 if installed, else a random model of SmolLM2's shape with a
made-up word-level tokenizer (a GPU machine has no internet) -- the same shapes and kernels either way."""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from radixserve.server_process import ServerProcess


def model_path() -> str | None:
    if os.environ.get("MODEL_PATH"):
        return os.environ["MODEL_PATH"]
    try:
        from radixserve.model.loader import bundled_model_path

        bundled_model_path()
        return None  # the server's default
    except FileNotFoundError:
        pass
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    out = Path(tempfile.mkdtemp()) / "smollm2-shaped-random"
    vocab = {f"w{i}": i for i in range(49152)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w2").save_pretrained(out)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      tie_word_embeddings=True, eos_token_id=2)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    print(f"no SmolLM2 here: a random model of its shape at {out}")
    return str(out)


async def load(url: str, prompts: list[list[int]], max_new: int) -> list[dict]:
    async def one(session, ids):
        body = {"input_ids": ids, "stream": True,
                "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
        start, ttft, meta, ids_out = time.perf_counter(), None, None, None
        async with session.post(url + "/generate", json=body) as resp:
            async for raw in resp.content:
                if raw.startswith(b"data: {"):
                    event = json.loads(raw[6:])
                    meta, ids_out = event["meta_info"], event["output_ids"]
                    ttft = ttft or time.perf_counter() - start
        return {"ttft": ttft, "e2e": time.perf_counter() - start, "meta": meta, "ids": ids_out}

    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(*(one(session, p) for p in prompts))


def main() -> None:
    path = model_path()
    args = ["--dtype", "bfloat16", "--max-total-tokens", "200000", "--schedule-policy", "lpm"]
    server = ServerProcess(*(["--model-path", path] if path else []), *args, timeout=240)
    try:
        import urllib.request

        info = json.load(urllib.request.urlopen(server.url + "/get_server_info"))
        print("runner:", info["actors"]["runner"])
        prefix = [(i * 7919) % 40000 + 100 for i in range(512)]
        prompts = [prefix + [(i * 131 + j) % 40000 + 100 for j in range(32)] for i in range(32)]
        start = time.perf_counter()
        first = asyncio.run(load(server.url, prompts, 32))
        took = time.perf_counter() - start
        again = asyncio.run(load(server.url, prompts[:4], 32))
        print(f"32 requests, 512-token shared prefix + 32 own tokens, 32 new tokens each: {took:.2f}s, "
              f"{32 * 32 / took:.0f} tok/s, TTFT p50 {statistics.median(r['ttft'] for r in first) * 1000:.0f} ms")
        print("cached tokens, first wave:", sum(r["meta"]["cached_tokens"] for r in first),
              "| second wave (should be ~543 each):", [r["meta"]["cached_tokens"] for r in again])
        print("greedy outputs repeat:", all(a["ids"] == b["ids"] for a, b in zip(first, again)))
    finally:
        print("server exit code:", server.stop())


if __name__ == "__main__":
    main()
