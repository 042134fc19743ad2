"""The api actor's core: one asyncio queue per request, fed by a task that reads the api inbox.

Handlers (openai.py, native.py) open a ``RequestStream`` per generation; leaving it before the request ended
(client gone: aiohttp cancels the handler) aborts the request, which releases its KV locks at once.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from radixserve.actors.api.errors import APIError
from radixserve.actors.api.metrics import Metrics
from radixserve.actors.messages import (
    AbortReq, ApiInbox, ControlReply, ControlReq, Delta, ErrorOut, GenerateReq, Status, TextBatch,
)
from radixserve.actors.transport import Channel, Endpoints

log = logging.getLogger(__name__)


class RequestStream:
    """The deltas of one generation, in order; ``APIError`` if it was refused."""

    def __init__(self, server: ApiServer, req: GenerateReq) -> None:
        self.server, self.req = server, req
        self.queue: asyncio.Queue[Delta | ErrorOut | APIError] = asyncio.Queue()
        self.start = time.perf_counter()
        self.last: float | None = None
        self.done = False

    async def __aenter__(self) -> RequestStream:
        self.server.pending[self.req.rid] = self
        await self.server.channel.send("tokenizer", self.req)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.pending.pop(self.req.rid, None)
        if not self.done:  # the client left (or a sibling choice failed): stop the work, free the KV
            await self.server.channel.send("tokenizer", AbortReq(self.req.rid, "client disconnected"))

    async def next(self) -> Delta:
        item = await self.queue.get()
        if isinstance(item, ErrorOut):
            self.done = True
            raise APIError(400, item.message, param=item.param)
        if isinstance(item, APIError):
            self.done = True
            raise item
        now = time.perf_counter()
        metrics = self.server.metrics
        if item.token_ids:
            if self.last is None:
                metrics.ttft.observe(now - self.start)
            else:
                metrics.itl.observe(now - self.last)
            self.last = now
            metrics.generation_tokens.inc(len(item.token_ids))
        if item.finish is not None:
            self.done = True
            metrics.finished(item.finish.type, item.prompt_tokens, item.cached_tokens, now - self.start)
        return item

    async def __aiter__(self) -> AsyncIterator[Delta]:
        while not self.done:
            yield await self.next()


class ApiServer:
    def __init__(self, endpoints: Endpoints, info: dict[str, Any]) -> None:
        self.channel = Channel(endpoints, "api", ApiInbox, ("tokenizer", "scheduler"))
        self.info = info  # model name, args, limits: what /get_server_info and /v1/models show
        self.pending: dict[str, RequestStream] = {}
        self.metrics = Metrics()
        self.status: Status | None = None
        self.healthy = True
        self._replies: dict[int, asyncio.Future[ControlReply]] = {}
        self._ids = itertools.count()
        self._reader: asyncio.Task | None = None

    def start(self) -> None:
        self._reader = asyncio.create_task(self._read_inbox())

    async def close(self) -> None:
        if self._reader:
            self._reader.cancel()
        self.channel.close()

    def stream(self, req: GenerateReq) -> RequestStream:
        if not self.healthy:
            raise APIError(503, "the server is shutting down", type="service_unavailable")
        return RequestStream(self, req)

    async def _read_inbox(self) -> None:
        while True:
            msg = await self.channel.recv()
            if isinstance(msg, TextBatch):
                for delta in msg.deltas:
                    if (s := self.pending.get(delta.rid)) is not None:
                        s.queue.put_nowait(delta)
            elif isinstance(msg, ErrorOut):
                if (s := self.pending.get(msg.rid)) is not None:
                    s.queue.put_nowait(msg)
            elif isinstance(msg, Status):
                self.status = msg
                self.metrics.status(msg)
            elif isinstance(msg, ControlReply):
                fut = self._replies.pop(msg.reply_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    async def control(self, op: str, timeout: float = 30.0, **kw: str | None) -> ControlReply:
        """Ask the scheduler (it answers between two steps)."""
        reply_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._replies[reply_id] = fut
        await self.channel.send("scheduler", ControlReq(reply_id, op, **kw))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            self._replies.pop(reply_id, None)
            raise APIError(503, f"the scheduler did not answer {op} within {timeout:.0f}s",
                           type="service_unavailable") from None

    async def abort(self, rid: str) -> list[str]:
        """Abort ``rid`` and any choice of it (``rid-0``, ``rid-1``, ...); returns the ids aborted."""
        hits = [r for r in self.pending if r == rid or r.startswith(rid + "-")]
        for r in hits:
            await self.channel.send("tokenizer", AbortReq(r, "aborted by /abort_request"))
        return hits

    def fail_all(self, message: str) -> None:
        """An actor died: every waiting handler answers 503 now instead of hanging."""
        self.healthy = False
        for s in list(self.pending.values()):
            s.queue.put_nowait(APIError(503, message, type="service_unavailable"))

    def server_info(self) -> dict[str, Any]:
        info = dict(self.info)
        info["status"] = msgspec.to_builtins(self.status) if self.status else None
        info["healthy"] = self.healthy
        return info
