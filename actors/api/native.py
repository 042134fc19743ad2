"""SGLang-native and operational routes: /generate, /abort_request, /flush_cache, /get_server_info, /health,
/metrics."""
from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from radixserve.actors.api.errors import APIError
from radixserve.actors.api.io import decode_body, first_deltas, json_response, merged, stream_events
from radixserve.actors.api.protocol import AbortBody, NativeGenerateRequest, PoliciesBody
from radixserve.actors.api.server import ApiServer
from radixserve.actors.messages import Delta, GenerateReq
from radixserve.prompts import text_or_ids
from radixserve.sampling_params import SamplingParams


class Output:
    """One request's result in SGLang's shape, accumulated from its deltas."""

    def __init__(self, rid: str, top_logprobs: int | None) -> None:
        self.rid, self.top_logprobs = rid, top_logprobs
        self.text, self.ids, self.start = "", [], time.perf_counter()
        self.token_lp: list[tuple[float, int]] = []
        self.top_lp: list[list[tuple[float, int]]] = []
        self.last: Delta | None = None

    def add(self, d: Delta) -> None:
        self.text += d.text
        self.ids += d.token_ids
        for t in d.logprobs or ():
            self.token_lp.append((t.logprob, t.token_id))
            self.top_lp.append([(lp, tid) for _, tid, lp in t.top])
        self.last = d

    def body(self) -> dict[str, Any]:
        d = self.last
        meta = {"id": self.rid, "prompt_tokens": d.prompt_tokens, "completion_tokens": d.completion_tokens,
                "cached_tokens": d.cached_tokens, "finish_reason": d.finish.to_dict() if d.finish else None,
                "e2e_latency": time.perf_counter() - self.start}
        if self.top_logprobs is not None:
            meta["output_token_logprobs"] = self.token_lp
            if self.top_logprobs > 0:
                meta["output_top_logprobs"] = self.top_lp
        return {"text": self.text, "output_ids": self.ids, "meta_info": meta}


def sequence_rids(rid: str | list[str] | None, n: int, single: bool) -> tuple[str, list[str]]:
    """The request's id and its sequences' ids: the client's (one for all, or one per prompt) or fresh ones."""
    if isinstance(rid, list):
        if len(rid) != n:
            raise APIError(400, f"rid is a list of {len(rid)} ids for {n} prompts; give one id or one per prompt",
                           param="rid")
        return f"batch-{uuid.uuid4().hex}", list(rid)  # each id names its own sequence
    base = rid or uuid.uuid4().hex
    return base, [base] if single else [f"{base}-{i}" for i in range(n)]


class NativeRoutes:
    def __init__(self, server: ApiServer) -> None:
        self.server = server

    def add_to(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/abort_request", self.abort)
        r.add_post("/flush_cache", self.flush_cache)
        r.add_get("/policies", self.get_policies)
        r.add_post("/policies", self.set_policies)
        r.add_get("/cache/stats", self.cache_stats)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/health", self.health)
        r.add_get("/metrics", self.metrics)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await decode_body(request, NativeGenerateRequest)
        vocab = self.server.limits.vocab_size
        prompts = text_or_ids(body.text, body.input_ids, vocab)
        self.server.check_size(len(prompts.items))  # refused before a single sequence is built
        params = body.sampling_params or SamplingParams()
        if vocab is not None:
            params.check_model(vocab)
        top_logprobs = body.top_logprobs_num if body.return_logprob else None
        group_rid, rids = sequence_rids(body.rid, len(prompts.items), prompts.single)
        gens = [GenerateReq(rid, params, top_logprobs=top_logprobs, priority=body.priority,
                            **({"text": p} if isinstance(p, str) else {"input_ids": p}))
                for rid, p in zip(rids, prompts.items)]
        outputs = [Output(rid, top_logprobs) for rid in rids]
        async with self.server.open(group_rid, gens) as group:
            firsts = await first_deltas(group)
            if not body.stream:
                async for i, delta in merged(group, firsts):
                    outputs[i].add(delta)
                bodies = [o.body() for o in outputs]
                return json_response(bodies[0] if prompts.single else bodies)

            async def events():
                async for i, delta in merged(group, firsts):
                    outputs[i].add(delta)
                    yield {**outputs[i].body(), "index": i}  # cumulative text, as SGLang streams

            return await stream_events(request, events())

    async def abort(self, request: web.Request) -> web.Response:
        rid = (await decode_body(request, AbortBody)).rid
        aborted = await self.server.abort(rid)
        if not aborted:
            raise APIError(404, f"no running request with id {rid!r}", param="rid")
        return json_response({"aborted": aborted})

    async def flush_cache(self, request: web.Request) -> web.Response:
        reply = await self.server.control("flush_cache")
        return json_response({"message": "cache flushed", **reply.body})

    async def get_policies(self, request: web.Request) -> web.Response:
        return json_response((await self.server.control("get_policies")).body)

    async def set_policies(self, request: web.Request) -> web.Response:
        body = await decode_body(request, PoliciesBody)
        if body.eviction is None and body.schedule is None:
            raise APIError(400, "send {\"eviction\": NAME} and/or {\"schedule\": NAME}", param="eviction")
        reply = await self.server.control("set_policies", eviction=body.eviction, schedule=body.schedule)
        if reply.error is not None:
            param = "schedule" if "schedule policy" in reply.error else "eviction"
            raise APIError(400, reply.error, param=param, code="unknown_policy" if "unknown" in reply.error
                           else "policy_failed")
        return json_response(reply.body)

    async def cache_stats(self, request: web.Request) -> web.Response:
        return json_response((await self.server.control("cache_stats")).body)

    async def server_info(self, request: web.Request) -> web.Response:
        return json_response(self.server.server_info())

    async def health(self, request: web.Request) -> web.Response:
        if not self.server.healthy:
            return json_response({"status": "unhealthy", "reason": self.server.info.get("unhealthy_reason")}, 503)
        if self.server.draining:
            return json_response({"status": "draining"}, 503)
        return json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.server.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})
