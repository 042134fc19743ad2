"""SGLang's /generate in and out: from its request body to the actors' GenerateReqs, and from a sequence's
deltas to SGLang's result shape. The HTTP route and the offline Engine both go through here, so a client gets the
same fields from either.

Logprobs travel as SGLang's triples ``[logprob, token_id, text]`` (text only with ``return_text_in_logprobs``;
the prompt's first token has no logprob: None). ``meta_info.input_token_logprobs`` covers the prompt from
``logprob_start_len`` on (-1 or absent: none of it), ``output_token_logprobs`` every generated token.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from radixserve.actors.api.protocol import GenerateBody
from radixserve.errors import InvalidRequest
from radixserve.prompts import Prompts, text_or_ids
from radixserve.sampling_params import SamplingParams
from radixserve.wire.messages import Delta, GenerateReq, prediction_details, tier_details, TokenLogprob


@dataclass(frozen=True)
class LogprobOptions:
    top: int  # alternatives per position (0: the token's own logprob only)
    text: bool  # fill the text element of each triple
    start: int | None  # the prompt's logprobs from this position on; None: none of the prompt's


@dataclass
class GenerateBatch:
    """A /generate body resolved: the request's id, one GenerateReq per sequence, how to shape the results."""

    rid: str
    gens: list[GenerateReq]
    single: bool  # one prompt, one choice: the result is a dict, not a list
    logprobs: LogprobOptions | None

    def outputs(self) -> list[GenerateOutput]:
        return [GenerateOutput(g.rid, self.logprobs) for g in self.gens]


def sequences(prompts: Prompts, params: list[SamplingParams], rid: str | list[str] | None,
              logprobs: LogprobOptions | None, priority: int | None) -> tuple[str, list[GenerateReq], bool]:
    """Every prompt's ``n`` choices as sequences, prompt-major (SGLang's order): the request's id, a GenerateReq
    per sequence, and whether the result is one dict (one prompt, one choice). The HTTP route and the Engine
    both build their requests here."""
    base, rids = sequence_rids(rid, len(prompts.items), prompts.single)
    gens = [GenerateReq(r if p.n == 1 else f"{r}-{j}", p.choice(j), top_logprobs=logprobs.top if logprobs else None,
                        priority=priority, logprob_start=logprobs.start if logprobs else None,
                        **({"text": item} if isinstance(item, str) else {"input_ids": item}))
            for r, item, p in zip(rids, prompts.items, params) for j in range(p.n)]
    return base, gens, prompts.single and params[0].n == 1


def with_processors(params: list[SamplingParams], processor: str | list[str | None] | None) -> list[SamplingParams]:
    """SGLang's top-level ``custom_logit_processor`` (one name for every prompt, or one per prompt) moved into
    each prompt's sampling params, where its ``custom_params`` are."""
    if processor is None:
        return params
    names = processor if isinstance(processor, list) else [processor] * len(params)
    if len(names) != len(params):
        raise InvalidRequest(f"got {len(names)} custom_logit_processor entries for {len(params)} prompts; give one "
                             "or one per prompt", param="custom_logit_processor")
    return [p if name is None else msgspec.structs.replace(p, custom_logit_processor=name)
            for p, name in zip(params, names)]


def generate_batch(body: GenerateBody, vocab_size: int | None) -> GenerateBatch:
    """InvalidRequest (a 400 naming the field) for what cannot run on any model of this vocabulary."""
    prompts = text_or_ids(body.text, body.input_ids, vocab_size)
    params = body.sampling_params or SamplingParams()
    if not isinstance(params, list):
        params = [params] * len(prompts.items)
    elif len(params) != len(prompts.items):
        raise InvalidRequest(f"got {len(params)} sampling_params for {len(prompts.items)} prompts; give one or one "
                             "per prompt", param="sampling_params")
    params = with_processors(params, body.custom_logit_processor)
    if vocab_size is not None:
        for p in params:
            p.check_model(vocab_size)
    start = body.logprob_start_len
    if start is not None and start < -1:
        raise InvalidRequest(f"logprob_start_len={start} must be -1 (no prompt logprobs) or a position >= 0",
                             param="logprob_start_len")
    logprobs = None
    if body.return_logprob:
        logprobs = LogprobOptions(body.top_logprobs_num or 0, body.return_text_in_logprobs,
                                  None if start is None or start < 0 else start)
    return GenerateBatch(*sequences(prompts, params, body.rid, logprobs, body.priority), logprobs)


def sequence_rids(rid: str | list[str] | None, n: int, single: bool) -> tuple[str, list[str]]:
    """The request's id and its sequences' ids: the client's (one for all, or one per prompt) or fresh ones."""
    if isinstance(rid, list):
        if len(rid) != n:
            raise InvalidRequest(f"rid is a list of {len(rid)} ids for {n} prompts; give one id or one per prompt",
                                 param="rid")
        return f"batch-{uuid.uuid4().hex}", list(rid)  # each id names its own sequence
    base = rid or uuid.uuid4().hex
    return base, [base] if single else [f"{base}-{i}" for i in range(n)]


class GenerateOutput:
    """One sequence's result in SGLang's shape, accumulated from its deltas. ``body()`` at any point gives the
    result so far (cumulative text: what SGLang streams)."""

    def __init__(self, rid: str, logprobs: LogprobOptions | None) -> None:
        self.rid, self.logprobs = rid, logprobs
        self.text, self.ids, self.start = "", [], time.perf_counter()
        self.output_lp: list[TokenLogprob] = []
        self.prompt_lp: list[TokenLogprob] = []
        self.last: Delta | None = None
        self.cached_tiers: list[int] | None = None
        self.drafts: list[int] | None = None  # speculative decoding: [draft tokens, accepted], when it drafted

    def add(self, d: Delta) -> None:
        self.text = self.text[: len(self.text) - d.cut] + d.text
        self.ids += d.token_ids
        self.output_lp += d.logprobs or ()
        self.prompt_lp += d.prompt_logprobs or ()
        self.last = d
        self.cached_tiers = d.cached_tiers or self.cached_tiers
        self.drafts = d.drafts or self.drafts

    @property
    def done(self) -> bool:
        return self.last is not None and self.last.finish is not None

    def body(self) -> dict[str, Any]:
        d = self.last
        meta: dict[str, Any] = {
            "id": self.rid, "prompt_tokens": d.prompt_tokens, "completion_tokens": d.completion_tokens,
            "cached_tokens": d.cached_tokens, "finish_reason": d.finish.to_dict() if d.finish else None,
            "e2e_latency": time.perf_counter() - self.start,
        }
        if self.cached_tiers is not None:  # with KV tiers: where the cached tokens came from
            meta["cached_tokens_details"] = tier_details(self.cached_tiers)
        if self.drafts is not None:  # speculative decoding, in OpenAI's words
            meta["completion_tokens_details"] = prediction_details([self.drafts])
        if (opts := self.logprobs) is not None:
            meta["input_token_logprobs"] = [self._triple(t.logprob, t.token_id, t.token) for t in self.prompt_lp]
            meta["output_token_logprobs"] = [self._triple(t.logprob, t.token_id, t.token) for t in self.output_lp]
            if opts.top > 0:
                meta["input_top_logprobs"] = [self._top(t) for t in self.prompt_lp]
                meta["output_top_logprobs"] = [self._top(t) for t in self.output_lp]
        return {"text": self.text, "output_ids": list(self.ids), "meta_info": meta}

    def _triple(self, logprob: float | None, token_id: int, text: str) -> list[Any]:
        return [logprob, token_id, text if self.logprobs.text else None]

    def _top(self, t: TokenLogprob) -> list[list[Any]] | None:
        if t.logprob is None:  # the prompt's first token: nothing to rank
            return None
        return [self._triple(lp, tid, tok) for tok, tid, lp in t.top]
