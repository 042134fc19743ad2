"""The tokenizer actor: text in (chat templates, encoding), text out (incremental detokenizing, stop strings).

Per scheduler step it gets one TokenBatch and answers the api with one TextBatch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from radixserve.actors.messages import (
    AbortReq, AddReq, Delta, ErrorOut, FinishReason, FinishReq, GenerateReq, Rejected, TextBatch, TokenBatch,
    TokenizerInbox, TokenLogprob, array, to_bytes,
)
from radixserve.actors.tokenizer import Detokenizer, TokenizerCore
from radixserve.actors.transport import ActorSpec, Channel, run_actor


@dataclass
class Tracked:
    detok: Detokenizer
    logprobs: int
    emitted: int = 0  # characters of detok.text already sent
    completion_tokens: int = 0


class TokenizerActor:
    def __init__(self, core: TokenizerCore, channel: Channel) -> None:
        self.core = core
        self.channel = channel
        self.live: dict[str, Tracked] = {}

    async def run(self) -> None:
        while True:
            msg = await self.channel.recv()
            if isinstance(msg, TokenBatch):
                await self.on_tokens(msg)
            elif isinstance(msg, GenerateReq):
                await self.on_generate(msg)
            elif isinstance(msg, AbortReq):
                await self.on_abort(msg)
            elif isinstance(msg, Rejected):
                if self.live.pop(msg.rid, None) is not None:
                    await self.channel.send("api", ErrorOut(msg.rid, msg.message, param=_param_of(msg.message)))

    async def on_generate(self, msg: GenerateReq) -> None:
        try:
            ids = self.encode(msg)
        except Exception as exc:  # a template or tokenizer error is the request's problem, never this actor's
            text = str(exc) if isinstance(exc, ValueError) else f"could not tokenize the request: {exc}"
            await self.channel.send("api", ErrorOut(msg.rid, text, param="messages" if msg.messages else "prompt"))
            return
        self.live[msg.rid] = Tracked(self.core.detokenizer(msg.params), msg.logprobs)
        await self.channel.send("scheduler", AddReq(msg.rid, to_bytes(ids), msg.params, msg.logprobs, msg.priority))

    def encode(self, msg: GenerateReq) -> list[int]:
        if msg.messages is not None:
            return self.core.apply_chat_template(msg.messages)
        if msg.input_ids is not None:
            bad = [t for t in msg.input_ids if not 0 <= t < 2**31]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary")
            return msg.input_ids
        return self.core.encode(msg.text or "")

    async def on_abort(self, msg: AbortReq) -> None:
        tracked = self.live.pop(msg.rid, None)
        if tracked is None:
            return
        reason = FinishReason("abort", message=msg.message)
        await self.channel.send("scheduler", FinishReq(msg.rid, reason))
        await self.channel.send("api", TextBatch([Delta(msg.rid, "", [], 0, tracked.completion_tokens, 0, reason)]))

    async def on_tokens(self, batch: TokenBatch) -> None:
        token_ids = array(batch.token_ids).tolist()
        prompt, cached = array(batch.prompt_tokens).tolist(), array(batch.cached_tokens).tolist()
        logprobs = self.logprobs_of(batch)
        deltas = []
        for i, rid in enumerate(batch.rids):
            t = self.live.get(rid)
            if t is None:  # already ended here (stop string, abort); the scheduler heard or will
                continue
            new = [token_ids[i]] if token_ids[i] >= 0 else []
            t.completion_tokens += len(new)
            finish = batch.finished.get(i)
            stop = t.detok.add(new) if new else None
            if stop is not None and finish is None:
                finish = FinishReason("stop", matched=stop)
                await self.channel.send("scheduler", FinishReq(rid, finish))
            if finish is not None:
                t.detok.flush()
                text = t.detok.text
                del self.live[rid]
            else:
                text = t.detok.stable_text
            delta = Delta(rid, text[t.emitted :], new, prompt[i], t.completion_tokens, cached[i], finish,
                          [logprobs[i]] if logprobs and logprobs[i] is not None else None)
            t.emitted = len(text)
            deltas.append(delta)
        if deltas:
            await self.channel.send("api", TextBatch(deltas))

    def logprobs_of(self, batch: TokenBatch) -> list[TokenLogprob | None] | None:
        if not batch.logprob:
            return None
        chosen = array(batch.logprob, np.float32).tolist()
        counts = array(batch.top_counts).tolist()
        ids = array(batch.token_ids).tolist()
        top_ids, top_lp = array(batch.top_ids).tolist(), array(batch.top_logprobs, np.float32).tolist()
        out, at = [], 0
        for i, lp in enumerate(chosen):
            top = [(self.token_text(t), t, v) for t, v in zip(top_ids[at : at + counts[i]], top_lp[at : at + counts[i]])]
            at += counts[i]
            out.append(None if math.isnan(lp) else TokenLogprob(self.token_text(ids[i]), ids[i], lp, top))
        return out

    def token_text(self, token_id: int) -> str:
        return self.core.decode([token_id], skip_special_tokens=False)


def _param_of(message: str) -> str | None:
    """The request field a scheduler rejection is about, for OpenAI's error ``param``."""
    if "max_new_tokens" in message:
        return "max_tokens"
    if "vocabulary" in message or "prompt" in message:
        return "prompt"
    return None


def build(spec: ActorSpec, channel: Channel) -> tuple[TokenizerActor, dict[str, Any]]:
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    core = TokenizerCore(spec.model_dir)
    return TokenizerActor(core, channel), {"vocab_size": core.vocab_size}


def main(spec: ActorSpec) -> None:
    run_actor("tokenizer", spec, TokenizerInbox, ("scheduler", "api"), build)
