"""The tokenizer actor: text in (chat templates, encoding), text out (incremental detokenizing, stop strings).

Per scheduler step it gets one TokenBatch and answers the api with one TextBatch. Nothing a request carries can
end this actor: a request whose text cannot be encoded, or whose tokens cannot be decoded, fails alone.
"""
from __future__ import annotations

import logging
from typing import Any

from radixserve.actors.messages import (
    AbortReq, AddReq, Delta, FinishReason, FinishReq, GenerateReq, RequestError, TextBatch, TokenBatch,
    TokenizerInbox, array,
)
from radixserve.actors.tokenizer import OutputText, TokenizerCore
from radixserve.actors.transport import ActorSpec, Channel, run_actor

log = logging.getLogger(__name__)


class TokenizerActor:
    def __init__(self, core: TokenizerCore, channel: Channel) -> None:
        self.core = core
        self.channel = channel
        self.live: dict[str, OutputText] = {}  # every request in flight here, by rid

    async def run(self) -> None:
        while True:
            msg = await self.channel.recv()
            try:
                await self.handle(msg)
            except Exception:  # a bug of ours on one message: log it, fail what it concerned, keep serving
                log.exception("internal error on %s", type(msg).__name__)
                if isinstance(msg, GenerateReq):
                    await self.fail(msg.rid, "internal error while tokenizing (logged)")

    async def handle(self, msg: Any) -> None:
        if isinstance(msg, TokenBatch):
            await self.on_tokens(msg)
        elif isinstance(msg, GenerateReq):
            await self.on_generate(msg)
        elif isinstance(msg, AbortReq):
            await self.on_abort(msg)
        elif isinstance(msg, RequestError):  # the scheduler refused or failed it: it holds nothing there any more
            if self.live.pop(msg.rid, None) is not None:
                await self.channel.send("api", msg)

    async def on_generate(self, msg: GenerateReq) -> None:
        try:
            ids = self.encode(msg)
        except Exception as exc:  # a template or tokenizer error is the request's problem, never this actor's
            text = str(exc) if isinstance(exc, ValueError) else f"could not tokenize the request: {exc}"
            await self.channel.send("api", RequestError(msg.rid, text, param="messages" if msg.messages else "prompt"))
            return
        self.live[msg.rid] = self.core.output(msg.params)
        await self.channel.send("scheduler", AddReq(msg.rid, array(ids), msg.params, msg.top_logprobs,
                                                    msg.priority, msg.logprob_start))

    def encode(self, msg: GenerateReq) -> list[int]:
        if msg.messages is not None:
            return self.core.apply_chat_template(msg.messages)
        if msg.input_ids is not None:
            return msg.input_ids  # checked against the vocabulary by the api, and again by the scheduler
        return self.core.encode(msg.text or "")

    async def on_abort(self, msg: AbortReq) -> None:
        tracked = self.live.pop(msg.rid, None)
        if tracked is None:
            return
        reason = FinishReason("abort", message=msg.message)
        await self.channel.send("scheduler", FinishReq(msg.rid, reason))
        await self.channel.send("api", TextBatch([Delta(msg.rid, "", [], 0, tracked.completion_tokens, 0, reason)]))

    async def fail(self, rid: str, message: str) -> None:
        """End one request with a 500 on our side: the api answers it, the scheduler frees its KV."""
        self.live.pop(rid, None)
        await self.channel.send("scheduler", FinishReq(rid, FinishReason("abort", message=message)))
        await self.channel.send("api", RequestError(rid, message, status=500, code="internal_error"))

    async def on_tokens(self, batch: TokenBatch) -> None:
        out = self.core.detokenize(batch, self.live)
        for rid in out.failed:
            await self.fail(rid, "internal error while detokenizing (logged)")
        for stop in out.stops:  # a stop string ended it here: the scheduler does not know yet
            await self.channel.send("scheduler", stop)
        if out.deltas:
            await self.channel.send("api", TextBatch(out.deltas))


def build(spec: ActorSpec, channel: Channel) -> tuple[TokenizerActor, dict[str, Any]]:
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    core = TokenizerCore(spec.model_dir)
    return TokenizerActor(core, channel), {"vocab_size": core.vocab_size, "chat_template": core.chat_template()}


def main(spec: ActorSpec) -> None:
    run_actor("tokenizer", spec, TokenizerInbox, ("scheduler", "api"), build)
