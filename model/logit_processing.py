"""The runner's side of named logit processors (radixserve/logit_processors.py): which processor and parameters
each request uses, and one call per processor per step over the rows that use it. Kept like the penalties:

    plan.new_processors[rid]   the request's first sampling step: its processor's name and custom_params
    each step                  rows grouped by processor; each processor called once with its rows' logits
    plan.released              the request ended: forgotten (a retracted request keeps its entry)
"""
from __future__ import annotations

import logging
from collections import defaultdict

import torch

from radixserve.logit_processors import LogitProcessor, load
from radixserve.wire.plans import ProcessorSpec

log = logging.getLogger(__name__)


class LogitProcessing:
    def __init__(self, names: tuple[str, ...] = ()) -> None:
        """``names``: the processors this server enables (loaded now: a broken plugin fails the start)."""
        self.processors: dict[str, LogitProcessor] = {name: load(name) for name in names}
        self.live: dict[str, ProcessorSpec] = {}

    def update(self, new: dict[str, ProcessorSpec], released: list[str]) -> None:
        for rid in released:
            self.live.pop(rid, None)
        self.live.update(new)

    def apply(self, logits: torch.Tensor, rows: list[str | None], output_index: list[int]) -> dict[int, str]:
        """Run each processor once over its rows of ``logits`` (float32 ``[S, vocab]``, changed in place).
        Returns row -> error for the rows that must not be sampled: their processor raised, returned something
        else than their logits' shape, or the runner lost their entry."""
        errors: dict[int, str] = {}
        groups: dict[str, list[int]] = defaultdict(list)
        for j, rid in enumerate(rows):
            if rid is None:
                continue
            spec = self.live.get(rid)
            if spec is None or spec.name not in self.processors:
                errors[j] = ("logit processor state lost" if spec is None
                             else f"logit processor {spec.name!r} is not loaded")
                continue
            groups[spec.name].append(j)
        for name, picked in groups.items():
            index = torch.tensor(picked, dtype=torch.int64, device=logits.device)
            part = logits.index_select(0, index)
            try:
                out = self.processors[name](part, [self.live[rows[j]].params for j in picked],
                                            [output_index[j] for j in picked])
                out = part if out is None else out
                if not isinstance(out, torch.Tensor) or out.shape != part.shape:
                    raise TypeError(f"returned {type(out).__name__} {tuple(getattr(out, 'shape', ()))}, not logits "
                                    f"of shape {tuple(part.shape)}")
                logits.index_copy_(0, index, out.to(logits.dtype))
            except Exception as exc:  # a plugin's bug fails its rows, never the step
                log.exception("logit processor %r failed on %d rows", name, len(picked))
                errors.update({j: f"logit processor {name!r} failed: {type(exc).__name__}: {exc}" for j in picked})
        return errors
