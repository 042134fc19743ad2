"""The tokenizer actor: text in (chat templates, encoding), text out (incremental detokenizing, stop strings).

Per scheduler step that hands on tokens it gets one TokenBatch and answers the api with one TextBatch (a whole
result's tokens come in runs, ``output_interval``). Nothing a request carries can
end this actor: a request whose text cannot be encoded, or whose tokens cannot be decoded, fails alone.

With --dp replicas it also routes: each request's token ids pick a replica's scheduler through the routing policy
(the router's own code, actors/router; a token id is one character of the text it matches on), and everything
later about that request goes to the same replica.
"""
from __future__ import annotations

import logging
from typing import Any

from radixserve.actors.router.policies import Worker, load_routing_policy
from radixserve.actors.tokenizer import OutputText, TokenizerCore, output_interval
from radixserve.actors.transport import ActorSpec, Channel, replica_name, run_actor
from radixserve.tool_parsers import resolve_tool_parser
from radixserve.wire.codec import array
from radixserve.wire.messages import (
    AbortReq, AddReq, Delta, FinishReason, FinishReq, GenerateReq, RequestError, TextBatch, TextReq, TokenBatch,
    TokenizerInbox,
)

log = logging.getLogger(__name__)


class Replicas:
    """The schedulers requests can go to, and which one holds each request in flight (its ``load`` counts them)."""

    def __init__(self, names: list[str], policy: str = "cache-aware") -> None:
        self.workers = [Worker(name) for name in names]
        self.policy = load_routing_policy(policy) if len(names) > 1 else None
        self.where: dict[str, Worker] = {}  # rid -> its replica

    def route(self, rid: str, ids: list[int]) -> str:
        worker = self.workers[0] if self.policy is None else self.policy.choose("".join(map(chr, ids)), self.workers)
        worker.load += 1
        self.where[rid] = worker
        return worker.url

    def of(self, rid: str) -> str:
        worker = self.where.get(rid)
        return worker.url if worker is not None else self.workers[0].url

    def settle(self, live: dict) -> None:
        """Requests no longer in flight here no longer count on their replica."""
        for rid in [r for r in self.where if r not in live]:
            self.where.pop(rid).load -= 1


class TokenizerActor:
    def __init__(self, core: TokenizerCore, channel: Channel, replicas: Replicas | None = None,
                 stream_interval: int = 1) -> None:
        self.core = core
        self.channel = channel
        self.live: dict[str, OutputText] = {}  # every request in flight here, by rid
        self.replicas = replicas or Replicas(["scheduler"])
        self.stream_interval = stream_interval  # --stream-interval

    async def run(self) -> None:
        while True:
            msg = await self.channel.recv()
            try:
                await self.handle(msg)
            except Exception:  # a bug of ours on one message: log it, fail what it concerned, keep serving
                log.exception("internal error on %s", type(msg).__name__)
                if isinstance(msg, GenerateReq):
                    await self.fail(RequestError(msg.rid, "internal error while tokenizing (logged)", status=500,
                                                 code="internal_error"))
            self.replicas.settle(self.live)

    async def handle(self, msg: Any) -> None:
        if isinstance(msg, TokenBatch):
            await self.on_tokens(msg)
        elif isinstance(msg, GenerateReq):
            await self.on_generate(msg)
        elif isinstance(msg, AbortReq):
            await self.on_abort(msg)
        elif isinstance(msg, TextReq):
            await self.channel.send("api", self.core.text_reply(msg))
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
        await self.channel.send(self.replicas.route(msg.rid, ids),
                                AddReq(msg.rid, array(ids), msg.params, msg.top_logprobs, msg.priority,
                                       msg.logprob_start,
                                       output_interval(msg.params, msg.stream, self.stream_interval)))

    def encode(self, msg: GenerateReq) -> list[int]:
        if msg.messages is not None:
            return self.core.apply_chat_template(msg.messages, continue_final_message=msg.continue_final_message,
                                                 tools=msg.tools)
        if msg.input_ids is not None:
            return msg.input_ids  # checked against the vocabulary by the api, and again by the scheduler
        return self.core.encode(msg.text or "")

    async def on_abort(self, msg: AbortReq) -> None:
        tracked = self.live.pop(msg.rid, None)
        if tracked is None:
            return
        reason = FinishReason("abort", message=msg.message)
        await self.channel.send(self.replicas.of(msg.rid), FinishReq(msg.rid, reason))
        await self.channel.send("api", TextBatch([Delta(msg.rid, "", [], 0, tracked.completion_tokens, 0, reason)]))

    async def fail(self, err: RequestError) -> None:
        """End one request with ``err`` (a 500 on our side, a 400 of its own doing): the api answers it, the
        scheduler frees its KV."""
        self.live.pop(err.rid, None)
        reason = FinishReason("abort", message=err.message)
        await self.channel.send(self.replicas.of(err.rid), FinishReq(err.rid, reason))
        await self.channel.send("api", err)

    async def on_tokens(self, batch: TokenBatch) -> None:
        out = self.core.detokenize(batch, self.live)
        for err in out.failed:
            await self.fail(err)
        for stop in out.stops:  # a stop string ended it here: the scheduler does not know yet
            await self.channel.send(self.replicas.of(stop.rid), stop)
        if out.deltas:
            await self.channel.send("api", TextBatch(out.deltas))


def build(spec: ActorSpec, channel: Channel) -> tuple[TokenizerActor, dict[str, Any]]:
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    core = TokenizerCore(spec.tokenizer_dir or spec.model_dir, spec.server_args.chat_template)
    replicas = Replicas(scheduler_names(spec.server_args.dp), spec.server_args.routing_policy)
    # --tool-call-parser auto is resolved here, where the chat template is: the api reads it from this Ready
    parser = resolve_tool_parser(spec.server_args.tool_call_parser, core.tokenizer.chat_template)
    return TokenizerActor(core, channel, replicas, spec.server_args.stream_interval), {"vocab_size": core.vocab_size,
                                                     "chat_template": core.chat_template(),
                                                     "tool_call_parser": parser}


def scheduler_names(dp: int) -> list[str]:
    """Every replica's scheduler actor."""
    return [replica_name("scheduler", None if dp == 1 else i) for i in range(dp)]


def main(spec: ActorSpec) -> None:
    run_actor("tokenizer", spec, TokenizerInbox, (*scheduler_names(spec.server_args.dp), "api"), build)
