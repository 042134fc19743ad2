"""SGLang's routes and the operational ones: /generate, /get_model_info, /get_server_info, /abort_request,
/flush_cache, /health, /health_generate, /metrics -- the contract SGLang's own frontend
(``sglang.RuntimeEndpoint``) relies on."""
from __future__ import annotations

import asyncio
import uuid

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from radixserve.actors.api.errors import APIError
from radixserve.actors.api.http_io import decode_body, first_deltas, json_response, merged, stream_events
from radixserve.actors.api.protocol import AbortBody, GenerateBody, PoliciesBody
from radixserve.actors.api.server import ApiServer
from radixserve.actors.api.sglang_generate import generate_batch
from radixserve.actors.api.sglang_info import sglang_names
from radixserve.sampling_params import SamplingParams
from radixserve.wire.messages import GenerateReq

HEALTH_GENERATE_TIMEOUT_S = 20.0


class SGLangRoutes:
    def __init__(self, server: ApiServer) -> None:
        self.server = server

    def add_to(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/abort_request", self.abort)
        r.add_post("/flush_cache", self.flush_cache)
        r.add_get("/policies", self.get_policies)
        r.add_post("/policies", self.set_policies)
        r.add_get("/policies/shadow", self.shadow)
        r.add_get("/cache/stats", self.cache_stats)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/model_info", self.model_info)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/metrics", self.metrics)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """SGLang's /generate: ``text`` or ``input_ids`` (one or a batch), ``sampling_params``, logprobs;
        the answer's ``meta_info`` has the prompt, cached and completion tokens."""
        body = await decode_body(request, GenerateBody)
        self.server.check_size(body.num_sequences())  # refused before a single sequence is built
        batch = generate_batch(body, self.server.limits.vocab_size)
        outputs = batch.outputs()
        async with self.server.open(batch.rid, batch.gens, stream=body.stream) as group:
            firsts = await first_deltas(group)
            if not body.stream:
                async for i, delta in merged(group, firsts):
                    outputs[i].add(delta)
                bodies = [o.body() for o in outputs]
                return json_response(bodies[0] if batch.single else bodies)

            async def events():
                async for i, delta in merged(group, firsts):
                    outputs[i].add(delta)
                    yield {**outputs[i].body(), "index": i}  # cumulative text, as SGLang streams

            return await stream_events(request, events())

    async def abort(self, request: web.Request) -> web.Response:
        """End a running request by its ``rid`` (SGLang's /abort_request); 404 when none runs under it."""
        rid = (await decode_body(request, AbortBody)).rid
        aborted = await self.server.abort(rid)
        if not aborted:
            raise APIError(404, f"no running request with id {rid!r}", param="rid")
        return json_response({"aborted": aborted})

    async def flush_cache(self, request: web.Request) -> web.Response:
        """Empty the radix cache (only what no running request holds); ``?keep_storage=true`` keeps the
        KV tiers' storage (L3)."""
        keep = request.query.get("keep_storage", "false").lower()
        if keep not in ("true", "false", "1", "0"):
            raise APIError(400, f"keep_storage={keep!r}: give true or false", param="keep_storage")
        reply = await self.server.control("flush_cache", keep_storage=keep in ("true", "1"))
        return json_response({"message": "cache flushed", **reply.body, **reply.body.get("total", {})})

    async def get_policies(self, request: web.Request) -> web.Response:
        """The eviction, schedule (and with KV tiers write and prefetch, with speculation draft) policies in
        charge, and every name that can replace them."""
        return json_response((await self.server.control("get_policies")).body)

    async def set_policies(self, request: web.Request) -> web.Response:
        """Switch policies by name while serving: ``{"eviction", "schedule", "write", "prefetch", "draft"}``
        (any of them; ``replica`` for one --dp replica); 400 names an unknown policy."""
        body = await decode_body(request, PoliciesBody)
        if all(v is None for v in (body.eviction, body.schedule, body.write, body.prefetch, body.draft)):
            raise APIError(400, "send {\"eviction\": NAME}, {\"schedule\": NAME}, {\"write\": NAME}, "
                                "{\"prefetch\": NAME} and/or {\"draft\": NAME}", param="eviction")
        reply = await self.server.control("set_policies", replica=body.replica, eviction=body.eviction,
                                          schedule=body.schedule, write=body.write, prefetch=body.prefetch,
                                          draft=body.draft)
        if reply.error is not None:
            param = next((k for k in ("schedule", "write", "prefetch", "draft") if f"{k} polic" in reply.error),
                         "eviction")
            raise APIError(400, reply.error, param=param, code="unknown_policy" if "unknown" in reply.error
                           else "policy_failed")
        return json_response(reply.body)

    async def cache_stats(self, request: web.Request) -> web.Response:
        """The scheduler's cache statistics: the pool, totals, hit rates, each policy epoch, speculation,
        the KV tiers, and the shadows' report."""
        body = (await self.server.control("cache_stats")).body
        return json_response({**body, "shadow": self.server.shadow_report()})

    async def shadow(self, request: web.Request) -> web.Response:
        """The shadow policies' report (--shadow-policies): every pair's windowed statistics on the live
        traffic, the leader, and --auto-policy's switches."""
        return json_response(self.server.shadow_report())

    async def model_info(self, request: web.Request) -> web.Response:
        """SGLang's model description: the paths, whether it generates, and the chat template's role markers
        (what SGLang's frontend and radixserve.lang use)."""
        return json_response(self.server.info["model_info"])

    async def server_info(self, request: web.Request) -> web.Response:
        """radixserve's fields, and beside them SGLang's (sglang_info.py); where a name is both, radixserve's."""
        info = self.server.server_info()
        return json_response({**sglang_names(info, info.get("replica_status") or [info["status"]]), **info})

    async def health(self, request: web.Request) -> web.Response:
        """200 while the server serves; 503 when an actor died (with the reason) or while it drains."""
        if not self.server.healthy:
            return json_response({"status": "unhealthy", "reason": self.server.info.get("unhealthy_reason")}, 503)
        if self.server.draining:
            return json_response({"status": "draining"}, 503)
        return json_response({"status": "ok", "tp_ranks": self.server.info.get("tp_ranks", 1)})

    async def health_generate(self, request: web.Request) -> web.Response:
        """SGLang's deeper check: one token through the whole stack (tokenizer, scheduler, model); 200 once it
        comes back, 503 if it fails or takes longer than HEALTH_GENERATE_TIMEOUT_S."""
        if not self.server.healthy or self.server.draining:
            return await self.health(request)
        rid = f"health-{uuid.uuid4().hex}"
        gen = GenerateReq(rid, SamplingParams(max_new_tokens=1, temperature=0.0), input_ids=[0])
        try:
            async with self.server.open(rid, [gen]) as group:
                async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
                    async for _ in group.streams[0]:
                        pass
        except (APIError, TimeoutError) as exc:
            return json_response({"status": "unhealthy", "reason": str(exc) or "no token in time"}, 503)
        return json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus metrics: SGLang's ``sglang:*`` families and radixserve's own ``radixserve_*``."""
        return web.Response(body=self.server.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})
