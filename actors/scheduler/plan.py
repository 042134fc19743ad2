"""Turning a batch of requests into the runner's ForwardPlan."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from radixserve.actors.scheduler.req import Req
from radixserve.policies.draft_trees import DraftTree
from radixserve.wire.plans import (
    ForwardPlan, GrammarSpec, PenaltySpec, ProcessorSpec, PromptLogprobs, SamplingBatch, TierOps,
)


@dataclass
class Step:
    """The plan being computed and its requests, with how many tokens each had in the pool before it."""

    plan: ForwardPlan
    reqs: list[Req]
    starts: list[int]
    floors: list[int] | None = None  # per request, what was in the pool before the step's loads (default: starts)
    drafts: list[DraftTree] | None = None  # speculative decoding: the draft each request's step verifies

    def floor_of(self, req: Req) -> int | None:
        """How many of ``req``'s tokens hold KV whatever becomes of this step (its loads from the lower tiers and
        its forward happen together, or neither does)."""
        for r, s in zip(self.reqs, self.floors or self.starts):
            if r is req:
                return s
        return None


def build_plan(step: int, mode: Literal["extend", "decode"], reqs: list[Req], starts: list[int],
               vocab_size: int, released: list[str] | None = None, tiers: TierOps | None = None,
               drafts: list[DraftTree] | None = None, follows: tuple[int, list[int]] | None = None) -> ForwardPlan:
    """``starts[i]``: how many of reqs[i]'s tokens were in the pool before this step (the rest are new).
    ``drafts`` (an extend step that verifies them): the tokens guessed to follow each decoding request, computed
    after its last token; its KV handle already holds their slots. A draft that branches (``DraftTree``) sends its
    tokens' parents (``draft_parents``), for the tree mask.

    Every request's KV handle must already hold slots for all the tokens it computes now, and a runner table row
    (``table_row``); the runner holds each row up to ``kv.synced``. A constrained request
    or penalized request that samples for the first time brings its grammar / penalties along (the caller marks
    its sampling state started once the plan is sent).

    ``follows`` (overlap: a decode step planned while the step before it computes): that step's number and, per
    request, its sampling row there; the runner takes each input token from what it sampled for that row, and
    the requests' outputs are a token longer by then than the scheduler knows now.
    """
    kv_lens = [r.kv_len for r in reqs]
    if follows is not None:
        input_ids = [0] * len(reqs)  # the runner fills them in
    elif mode == "decode":
        input_ids = [r.output_ids[-1] for r in reqs]
    elif drafts is not None:
        input_ids = [t for r, s, d in zip(reqs, starts, drafts) for t in (*r.tokens(s, r.seq_len), *d)]
    else:
        input_ids = [t for r, s, e in zip(reqs, starts, kv_lens) for t in r.tokens(s, e)]
    sample = ([True] * len(reqs) if drafts is not None or follows is not None else
              [e == r.seq_len and not r.prefill_only for r, e in zip(reqs, kv_lens)])
    starting = [r for r, s in zip(reqs, sample) if s and not r.sampler_state]
    return ForwardPlan(
        step=step,
        mode=mode,
        input_ids=np.asarray(input_ids, dtype=np.int32),
        prefix_lens=np.asarray(starts, dtype=np.int32),
        extend_lens=np.asarray(kv_lens, dtype=np.int32) - np.asarray(starts, dtype=np.int32),
        rows=np.asarray([r.table_row for r in reqs], dtype=np.int32),
        row_writes=np.asarray([r.kv.synced for r in reqs], dtype=np.int32),
        new_slots=np.concatenate([r.kv.row[r.kv.synced : r.kv.kv_len] for r in reqs]).astype(
            np.int32, copy=False),  # only what the runner does not hold yet: O(batch) when decoding
        sample=np.asarray(sample, dtype=np.uint8),
        sampling=sampling_batch([r for r, s in zip(reqs, sample) if s], vocab_size, ahead=follows is not None),
        prompt_logprobs=prompt_logprobs(mode, reqs, starts, kv_lens),
        new_grammars={r.rid: GrammarSpec(*r.params.constraint) for r in starting if r.params.constraint is not None},
        new_penalties={r.rid: penalty_spec(r) for r in starting if r.params.penalized},
        new_processors={r.rid: ProcessorSpec(r.params.custom_logit_processor, r.params.custom_params or {})
                        for r in starting if r.params.custom_logit_processor is not None},
        released=released or [],
        tiers=tiers,
        drafts=None if drafts is None else np.asarray([len(d) for d in drafts], dtype=np.int32),
        draft_parents=(np.asarray([p for d in drafts for p in d.parents], dtype=np.int32)
                       if drafts is not None and not all(d.is_chain for d in drafts) else None),
        follows=None if follows is None else follows[0],
        follow_rows=None if follows is None else np.asarray(follows[1], dtype=np.int32),
    )


def prompt_logprobs(mode: str, reqs: list[Req], starts: list[int], ends: list[int]) -> dict[int, PromptLogprobs]:
    """The prompt positions computed this step whose logprobs a request asked for."""
    if mode == "decode":
        return {}
    out = {}
    for i, (r, s, e) in enumerate(zip(reqs, starts, ends)):
        if (span := r.prompt_logprob_span(s, e)) is not None:
            first, targets = span
            out[i] = PromptLogprobs(first, np.asarray(targets, dtype=np.int32), r.top_logprobs or 0)
    return out


def sampling_batch(reqs: list[Req], vocab_size: int, ahead: bool = False) -> SamplingBatch:
    """The sampling rows of ``reqs``; "no top-k limit" (-1 or 0) travels as the vocabulary size, and a greedy
    request as temperature 0 (however small the temperature it asked for). ``ahead``: a step planned before the
    one in flight returns (each request's output a token longer by then)."""
    params = [r.params for r in reqs]
    return SamplingBatch(
        temperature=np.asarray([0.0 if p.greedy else p.temperature for p in params], dtype=np.float32),
        top_p=np.asarray([p.top_p for p in params], dtype=np.float32),
        top_k=np.asarray([p.top_k if p.top_k > 0 else vocab_size for p in params], dtype=np.int32),
        min_p=np.asarray([p.min_p for p in params], dtype=np.float32),
        seeds=[p.seed for p in params],
        output_index=np.asarray([len(r.output_ids) + ahead for r in reqs], dtype=np.int32),
        top_logprobs=[r.top_logprobs for r in reqs],
        all_greedy=all(p.greedy for p in params),
        constraints=[r.rid if p.constraint is not None else None for r, p in zip(reqs, params)]
        if any(p.constraint is not None for p in params) else [],
        penalized=[r.rid if p.penalized else None for r, p in zip(reqs, params)]
        if any(p.penalized for p in params) else [],
        processed=[r.rid if p.custom_logit_processor is not None else None for r, p in zip(reqs, params)]
        if any(p.custom_logit_processor is not None for p in params) else [],
    )


def penalty_spec(req: Req) -> PenaltySpec:
    p = req.params
    return PenaltySpec(p.frequency_penalty, p.presence_penalty, p.repetition_penalty, p.min_new_tokens,
                       sorted(req.stop_ids) if p.min_new_tokens else [], p.bias_ids,
                       [float(v) for v in (p.logit_bias or {}).values()])


def plannable(mode: Literal["extend", "decode"], req: Req, start: int, vocab_size: int) -> bool:
    """Can ``req`` be planned on its own? (Finds the request that breaks a batch's plan.)"""
    try:
        build_plan(0, mode, [req], [start], vocab_size)
        return True
    except Exception:
        return False
