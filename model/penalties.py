"""Logit adjustments per request, beside the sampler: frequency, presence and repetition penalties over the
request's own output tokens, min_new_tokens, logit_bias. The runner samples, so it keeps the state:

    plan.new_penalties[rid]   the request's first sampling step: its spec, and an empty row of the tables
    each step                 every penalized row's logits adjusted at once, at the tokens its output holds
    after sampling            the sampled token's count + 1 (a new token takes the row's next column): O(batch)
    plan.released             the request ended (finished, aborted, failed): its row is free again

Only the tokens an output holds are touched, so a step costs O(batch x distinct output tokens), not O(batch x
vocab), and the history is never re-read: per row, ``ids[row, :n]`` are the distinct tokens in order of first
appearance and ``counts[row, :n]`` how often each appeared (``n`` grows by one per new token; the columns double
when a row runs out).

A retracted request keeps its state (its output stays, so do its counts). A row whose counts do not cover the
request's output exactly (state lost) fails that request alone, as a lost grammar does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.wire.plans import PenaltySpec


@dataclass
class _Live:
    spec: PenaltySpec
    row: int  # this request's row of the tables
    columns: dict[int, int] = field(default_factory=dict)  # token id -> its column in the row
    counted: int = 0  # output tokens counted so far


class Penalties:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.ids = torch.zeros(0, 16, dtype=torch.int64, device=device)  # [rows, columns] distinct tokens
        self.counts = torch.zeros(0, 16, dtype=torch.float32, device=device)  # [rows, columns] occurrences
        self.live: dict[str, _Live] = {}
        self._free: list[int] = []

    def update(self, new: dict[str, PenaltySpec], released: list[str]) -> None:
        """Free the released requests' rows, give the new ones an empty row (the tables grow by doubling)."""
        for rid in released:
            if (gone := self.live.pop(rid, None)) is not None:
                self._free.append(gone.row)
        for rid, spec in new.items():
            if rid in self.live:
                continue
            if not self._free:
                have = len(self.ids)
                self.ids, self.counts = (self._grown(t, max(2 * have, 8), t.shape[1]) for t in (self.ids, self.counts))
                self._free = list(range(len(self.ids) - 1, have - 1, -1))
            self.live[rid] = _Live(spec, self._free.pop())

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
        dev = logits.device
        specs = [live.spec for _, live in picked]
        width = max(len(live.columns) for _, live in picked)
        if width and any(s.repetition != 1 or s.frequency or s.presence for s in specs):
            table = torch.tensor([live.row for _, live in picked], device=self.device)
            used = torch.arange(width, device=self.device)[None, :] < torch.tensor(
                [len(live.columns) for _, live in picked], device=self.device)[:, None]
            at, col = used.nonzero(as_tuple=True)  # (penalized row, column) of every token an output holds
            tokens = self.ids[table[at], col].to(dev)
            counts = self.counts[table[at], col].to(dev)
            r = torch.tensor([j for j, _ in picked], device=dev)[at.to(dev)]

            def per_token(values: list[float]) -> torch.Tensor:
                return torch.tensor(values, dtype=logits.dtype, device=dev)[at.to(dev)]

            x = logits[r, tokens]
            rep = per_token([s.repetition for s in specs])
            x = torch.where(x > 0, x / rep, x * rep)
            x = x - per_token([s.frequency for s in specs]) * counts - per_token([s.presence for s in specs])
            logits[r, tokens] = x
        bias = [(j, t, v) for j, live in picked for t, v in zip(live.spec.bias_ids, live.spec.bias_values)]
        if bias:
            r, t, v = zip(*bias)
            logits.index_put_((torch.tensor(r, device=dev), torch.tensor(t, device=dev)),
                              torch.tensor(v, dtype=logits.dtype, device=dev), accumulate=True)
        banned = [(j, t) for j, live in picked if output_index[j] < live.spec.min_new_tokens for t in live.spec.suppressed]
        if banned:
            r, t = zip(*banned)
            logits[torch.tensor(r, device=dev), torch.tensor(t, device=dev)] = float("-inf")
        return errors

    def count(self, rows: list[str | None], next_ids: list[int | None]) -> None:
        """Count each penalized row's sampled token (a row that got none, e.g. it failed, counts nothing)."""
        hits = [(self.live[rid], token) for rid, token in zip(rows, next_ids)
                if rid is not None and token is not None and rid in self.live]
        if not hits:
            return
        cells = []
        for live, token in hits:
            column = live.columns.get(token)
            if column is None:  # the output's first occurrence of this token: the row's next column
                column = live.columns[token] = len(live.columns)
                if column >= self.ids.shape[1]:
                    width = 2 * self.ids.shape[1]
                    self.ids, self.counts = (self._grown(t, len(t), width) for t in (self.ids, self.counts))
                self.ids[live.row, column] = token
                self.counts[live.row, column] = 0
            cells.append((live.row, column))
            live.counted += 1
        r, c = zip(*cells)
        self.counts.index_put_((torch.tensor(r, device=self.device), torch.tensor(c, device=self.device)),
                               torch.ones(len(cells), device=self.device), accumulate=True)

    @staticmethod
    def _grown(table: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
        out = torch.zeros(rows, columns, dtype=table.dtype, device=table.device)
        out[: table.shape[0], : table.shape[1]] = table
        return out
