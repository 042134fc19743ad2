"""Scoring a text the way decoding computes it: teacher-forced decode steps, one token a step with the true token
fed back, so a kernel that decodes differently from how it prefills (the native step's int8 activations under
--quantization, a compiled graph's fused rounding) is scored on what it computes when it generates.

Drives the engine's runner directly over slots 1..n of its KV pool: the engine's cache is flushed before and after,
and nothing else runs meanwhile, so no request holds those slots.
"""
from __future__ import annotations

import math

import torch

from radixserve import Engine
from radixserve.kernels.base import AttentionBatch
from radixserve.model.forward_batch import ForwardBatch


def _batch(runner, tokens: list[int], row: torch.Tensor, mode: str) -> ForwardBatch:
    """One request's step: ``tokens`` new at the end of its ``row`` of slots (``runner._run`` prepares the
    attention metadata if the native step turns it down)."""
    new, prefix = len(tokens), len(row) - len(tokens)
    attn = AttentionBatch(mode=mode, prefix_lens=[prefix], extend_lens=[new], slots=row, out_slots=row[prefix:],
                          dtype=runner.dtype, group=runner._group)
    positions = torch.arange(prefix, prefix + new)
    cos, sin = runner.rope.lookup(positions)
    return ForwardBatch(input_ids=torch.tensor(tokens), positions=positions, logit_rows=torch.tensor([new - 1]),
                        cos=cos, sin=sin, attn=attn, attn_backend=runner.attn, kv=runner.kv)


def decode_logprobs(engine: Engine, ids: list[int], start: int) -> list[float]:
    """log p(ids[t] | ids[:t]) for t = start .. len(ids) - 1: ids[:start] prefilled, then one decode step a token."""
    runner = engine.runner
    if len(ids) >= runner.kv.k.shape[1]:
        raise ValueError(f"{len(ids)} tokens do not fit the engine's pool of {runner.kv.k.shape[1] - 1}")
    engine.flush_cache()
    row = torch.arange(1, len(ids) + 1)  # slot 0 is the dummy
    out = []
    with torch.inference_mode():
        logits = runner._run(_batch(runner, ids[:start], row[:start], "extend"))
        out.append(torch.log_softmax(logits[0].float(), -1)[ids[start]].item())
        for t in range(start, len(ids) - 1):
            logits = runner._run(_batch(runner, [ids[t]], row[: t + 1], "decode"))
            out.append(torch.log_softmax(logits[0].float(), -1)[ids[t + 1]].item())
    engine.flush_cache()
    return out


def chunked_perplexity(engine: Engine, ids: list[int], chunk: int) -> float:
    """llama-perplexity's method through decode steps: chunks of ``chunk`` tokens, each scoring its second half."""
    lps: list[float] = []
    for s in range(0, len(ids) - chunk + 1, chunk):
        lps += decode_logprobs(engine, ids[s : s + chunk], chunk // 2)
    return math.exp(-sum(lps) / len(lps))
