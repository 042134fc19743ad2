"""Token sampling: greedy, temperature, top-k, top-p, min-p; per-request seeds.

Sampling draws ``argmax(p / q)`` with ``q ~ Exp(1)`` per vocabulary entry, which picks token i with
probability p_i. A seeded request's noise depends only on (seed, index of the token in its output), so it gets
the same tokens whatever else is in the batch, and after a retraction too.
"""
from __future__ import annotations

import numpy as np
import torch

from radixserve.actors.messages import ForwardPlan, array

_MIX_A, _MIX_B, _MASK = 6364136223846793005, 1442695040888963407, (1 << 63) - 1


def seeded_noise(seed: int, index: int, vocab: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device)
    g.manual_seed((seed * _MIX_A + (index + 1) * _MIX_B) & _MASK)
    return torch.empty(vocab, device=device).exponential_(generator=g)


def sample(logits: torch.Tensor, plan: ForwardPlan) -> torch.Tensor:
    """``logits``: float32 ``[n, vocab]``, one row per request that samples (in batch order)."""
    if plan.all_greedy:
        return logits.argmax(dim=-1)
    keep = array(plan.sample, np.uint8).astype(bool)
    temp = torch.from_numpy(array(plan.temperature, np.float32)[keep].copy()).to(logits.device)
    top_k = torch.from_numpy(array(plan.top_k, np.int32)[keep].astype(np.int64)).to(logits.device)
    top_p = torch.from_numpy(array(plan.top_p, np.float32)[keep].copy()).to(logits.device)
    min_p = torch.from_numpy(array(plan.min_p, np.float32)[keep].copy()).to(logits.device)
    seeds = array(plan.seed, np.int64)[keep].tolist()
    index = array(plan.sample_index, np.int32)[keep].tolist()

    greedy = (temp == 0) | (top_k == 1)
    out = logits.argmax(dim=-1)
    rows = (~greedy).nonzero().flatten()
    if len(rows) == 0:
        return out
    probs = torch.softmax(logits[rows] / temp[rows, None], dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    k = torch.where(top_k[rows] > 0, top_k[rows], probs.shape[-1])
    drop = rank >= k[:, None]
    drop |= (sorted_p.cumsum(-1) - sorted_p) > top_p[rows, None]  # top-p: keep the smallest set reaching p
    drop |= sorted_p < sorted_p[:, :1] * min_p[rows, None]
    sorted_p = sorted_p.masked_fill(drop, 0.0)  # the most likely token always survives
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    noise = torch.empty_like(probs).exponential_()
    for j, r in enumerate(rows.tolist()):
        if seeds[r] >= 0:
            noise[j] = seeded_noise(seeds[r], index[r], probs.shape[-1], probs.device)
    out[rows] = (probs / noise).argmax(dim=-1)
    return out


def logprobs_of(logits: torch.Tensor, next_ids: torch.Tensor, plan: ForwardPlan) -> tuple[bytes, bytes, bytes]:
    """For the requests that asked: the chosen token's log-probability (``[B]``, NaN elsewhere) and their top-k
    alternatives back to back in batch order. Log-probabilities of the model's own distribution (before
    temperature and filters), as OpenAI reports them. Empty bytes when nobody asked."""
    batch_rows = np.flatnonzero(array(plan.sample, np.uint8))  # logits row j is batch row batch_rows[j]
    want = array(plan.logprobs, np.int32)[batch_rows]
    rows = np.flatnonzero(want >= 0)
    if len(rows) == 0:
        return b"", b"", b""
    rows_t = torch.from_numpy(rows).to(logits.device)
    logp = torch.log_softmax(logits[rows_t], dim=-1)
    chosen = np.full(plan.batch_size, np.nan, dtype=np.float32)
    chosen[batch_rows[rows]] = logp.gather(1, next_ids[rows_t][:, None])[:, 0].cpu().numpy()
    top_ids, top_lp = [np.zeros(0, np.int32)], [np.zeros(0, np.float32)]
    k = int(want[rows].max())
    if k > 0:
        values, ids = (t.cpu().numpy() for t in logp.topk(k, dim=-1))
        for j, r in enumerate(rows):
            top_ids.append(ids[j, : want[r]].astype(np.int32))
            top_lp.append(values[j, : want[r]].astype(np.float32))
    return chosen.tobytes(), np.concatenate(top_ids).tobytes(), np.concatenate(top_lp).tobytes()
