"""SGLang-native and operational routes: /generate, /abort_request, /flush_cache, /get_server_info, /health,
/metrics."""
from __future__ import annotations

import time
import uuid
from contextlib import AsyncExitStack
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from radixserve.actors.api.errors import APIError
from radixserve.actors.api.io import decode_body, json_response, merged, stream_events
from radixserve.actors.api.protocol import AbortBody, NativeGenerateRequest, PoliciesBody
from radixserve.actors.api.server import ApiServer
from radixserve.actors.messages import Delta, GenerateReq
from radixserve.sampling_params import SamplingParams


class Output:
    """One request's result in SGLang's shape, accumulated from its deltas."""

    def __init__(self, rid: str, logprobs: int) -> None:
        self.rid, self.want_logprobs = rid, logprobs
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
        if self.want_logprobs >= 0:
            meta["output_token_logprobs"] = self.token_lp
            if self.want_logprobs > 0:
                meta["output_top_logprobs"] = self.top_lp
        return {"text": self.text, "output_ids": self.ids, "meta_info": meta}


def prompts_of(body: NativeGenerateRequest) -> tuple[list[dict[str, Any]], bool]:
    """Each prompt as GenerateReq keyword arguments, and whether the caller sent a single one."""
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "give exactly one of text or input_ids", param="text")
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        if not texts or not all(texts):
            raise APIError(400, "text must be a non-empty string or list of non-empty strings", param="text")
        return [{"text": t} for t in texts], isinstance(body.text, str)
    ids = body.input_ids
    if ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return [{"input_ids": ids}], True
    if ids and all(isinstance(x, list) and x and all(isinstance(t, int) for t in x) for x in ids):
        return [{"input_ids": x} for x in ids], False
    raise APIError(400, "input_ids must be a non-empty list of token ids or a list of such lists", param="input_ids")


class NativeRoutes:
    def __init__(self, server: ApiServer) -> None:
        self.server = server

    def add_to(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/abort_request", self.abort)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_get("/policies", self.get_policies)
        r.add_post("/policies", self.set_policies)
        r.add_get("/cache/stats", self.cache_stats)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/health", self.health)
        r.add_get("/metrics", self.metrics)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await decode_body(request, NativeGenerateRequest)
        prompts, single = prompts_of(body)
        try:
            params = SamplingParams.coerce(body.sampling_params)
        except ValueError as exc:
            raise APIError(400, str(exc), param="sampling_params") from None
        base = body.rid or uuid.uuid4().hex
        logprobs = body.top_logprobs_num if body.return_logprob else -1
        rids = [base] if single else [f"{base}-{i}" for i in range(len(prompts))]
        gens = [GenerateReq(rid, params, logprobs=logprobs, priority=body.priority, **kw)
                for rid, kw in zip(rids, prompts)]
        outputs = [Output(rid, logprobs) for rid in rids]
        async with AsyncExitStack() as stack:
            streams = [await stack.enter_async_context(self.server.stream(g)) for g in gens]
            firsts = [await s.next() for s in streams]
            if not body.stream:
                async for i, delta in merged(streams, firsts):
                    outputs[i].add(delta)
                bodies = [o.body() for o in outputs]
                return json_response(bodies[0] if single else bodies)
            async def events():
                async for i, delta in merged(streams, firsts):
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
        if self.server.healthy:
            return json_response({"status": "ok"})
        return json_response({"status": "unhealthy", "reason": self.server.info.get("unhealthy_reason")}, 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.server.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})
