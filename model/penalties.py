"""Logit adjustments per request, beside the sampler: frequency, presence and repetition penalties over the
request's own output tokens, min_new_tokens, logit_bias. The runner samples, so it keeps the state:

    plan.new_penalties[rid]   the request's first sampling step: its spec, and a zeroed row of counts
    each step                 every penalized row's logits adjusted at once, from its counts ([P, vocab] ops)
    after sampling            counts[row, token] += 1 for each penalized row's sampled token (incremental: the
                              history is never re-read)
    plan.released             the request ended (finished, aborted, failed): its row of counts is free again

A retracted request keeps its state (its output stays, so do its counts). A row whose counts do not cover the
request's output exactly (state lost) fails that request alone, as a lost grammar does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.actors.messages import PenaltySpec


@dataclass
class _Live:
    spec: PenaltySpec
    row: int  # this request's row of ``Penalties.counts``
    counted: int = 0  # output tokens counted so far


class Penalties:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)  # one row per live request
        self.live: dict[str, _Live] = {}
        self._free: list[int] = []

    def update(self, new: dict[str, PenaltySpec], released: list[str]) -> None:
        """Free the released requests' rows, give the new ones a zeroed row (the table grows by doubling)."""
        for rid in released:
            if (gone := self.live.pop(rid, None)) is not None:
                self._free.append(gone.row)
        for rid, spec in new.items():
            if rid in self.live:
                continue
            if not self._free:
                have = len(self.counts)
                grown = torch.zeros(max(2 * have, 8), self.vocab_size, dtype=torch.float32, device=self.device)
                grown[:have] = self.counts
                self.counts = grown
                self._free = list(range(len(grown) - 1, have - 1, -1))
            row = self._free.pop()
            self.counts[row].zero_()
            self.live[rid] = _Live(spec, row)

    def apply(self, logits: torch.Tensor, rows: list[str | None], output_index: list[int]) -> dict[int, str]:
        """Adjust the penalized rows of ``logits`` (float32 ``[S, vocab]``, in place), in the order vLLM applies
        them: repetition, then frequency and presence, then logit_bias, then min_new_tokens' bans. Returns
        row -> error for a row whose state is lost (it must not be sampled)."""
        errors: dict[int, str] = {}
        picked: list[tuple[int, _Live]] = []
        for j, rid in enumerate(rows):
            if rid is None:
                continue
            live = self.live.get(rid)
            if live is None or live.counted != output_index[j]:
                errors[j] = "penalty state lost" if live is None else (
                    f"penalties counted {live.counted} tokens, the request has {output_index[j]}")
                continue
            picked.append((j, live))
        if not picked:
            return errors
        js = torch.tensor([j for j, _ in picked], device=logits.device)
        specs = [live.spec for _, live in picked]
        counts = self.counts[torch.tensor([live.row for _, live in picked], device=self.device)].to(logits.device)
        seen = counts > 0
        x = logits[js]

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=x.dtype, device=x.device)[:, None]

        if any(s.repetition != 1 for s in specs):
            rep = column([s.repetition for s in specs])
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        if any(s.frequency or s.presence for s in specs):
            x = x - column([s.frequency for s in specs]) * counts - column([s.presence for s in specs]) * seen
        bias = [(n, t, v) for n, s in enumerate(specs) for t, v in zip(s.bias_ids, s.bias_values)]
        if bias:
            r, t, v = zip(*bias)
            x.index_put_((torch.tensor(r, device=x.device), torch.tensor(t, device=x.device)),
                         torch.tensor(v, dtype=x.dtype, device=x.device), accumulate=True)
        banned = [(n, t) for n, (j, live) in enumerate(picked) if output_index[j] < live.spec.min_new_tokens
                  for t in live.spec.suppressed]
        if banned:
            r, t = zip(*banned)
            x[torch.tensor(r, device=x.device), torch.tensor(t, device=x.device)] = float("-inf")
        logits[js] = x
        return errors

    def count(self, rows: list[str | None], next_ids: list[int | None]) -> None:
        """Count each penalized row's sampled token (a row that got none, e.g. it failed, counts nothing)."""
        hits = [(self.live[rid], token) for rid, token in zip(rows, next_ids)
                if rid is not None and token is not None and rid in self.live]
        if not hits:
            return
        r = torch.tensor([live.row for live, _ in hits], device=self.device)
        t = torch.tensor([token for _, token in hits], device=self.device)
        self.counts.index_put_((r, t), torch.ones(len(hits), device=self.device), accumulate=True)
        for live, _ in hits:
            live.counted += 1
