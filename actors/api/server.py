"""The api actor's core: admission, one asyncio queue per generation, and the task that reads the api inbox.

Handlers (openai.py, responses.py, sglang_routes.py) open one ``RequestGroup`` per HTTP request: its sequences (prompts x n) are
admitted or refused together, *before* anything is tokenized -- 503 while draining or past the cap on open streams,
429 past the per-request cap or the in-flight cap, 400 for a request id already in use. Leaving the group before its
sequences ended (the client went away: aiohttp cancels the handler, streaming or not) aborts them, which releases
their KV (and a stream's place) at once.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from radixserve.actors.api.errors import APIError
from radixserve.actors.api.metrics import Metrics
from radixserve.actors.transport import Channel, Endpoints
from radixserve.wire.messages import (
    AbortReq, ApiInbox, ControlReply, ControlReq, Delta, GenerateReq, RequestError, ShadowReport, Status, TextBatch,
    TextReq,
)

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what 429 and 503 answers tell the client to wait before trying again
SERVER: web.AppKey[ApiServer] = web.AppKey("server")  # the app's ApiServer, for what only has the request


@dataclass(frozen=True)
class Limits:
    """What one HTTP request, and all of them together, may ask of the server."""

    max_sequences_per_request: int = 1024 + 128  # prompts x n in one HTTP request (the server: the in-flight cap)
    max_in_flight: int = 1024 + 128  # sequences admitted and not finished: --max-queued-requests + running
    vocab_size: int | None = None  # token ids are checked against it before anything is queued
    max_streams: int = 256  # streamed (SSE) responses open at once: each holds a connection until it ends


class RequestStream:
    """The deltas of one generation (one sequence), in order; ``APIError`` if it failed."""

    def __init__(self, server: ApiServer, req: GenerateReq) -> None:
        self.server, self.req = server, req
        self.queue: asyncio.Queue[Delta | RequestError | APIError] = asyncio.Queue()
        self.start = time.perf_counter()
        self.first: float | None = None  # when the first token came
        self.last: float | None = None
        self.tokens = 0
        self.done = False

    async def next(self) -> Delta:
        item = await self.queue.get()
        if isinstance(item, RequestError):
            self.done = True
            if item.status >= 500:
                log.error("request %s failed: %s", self.req.rid, item.message)
            raise APIError(item.status, item.message, param=item.param, code=item.code,
                           retry_after=RETRY_AFTER_S if item.status in (429, 503) else None)
        if isinstance(item, APIError):
            self.done = True
            raise item
        now = time.perf_counter()
        metrics = self.server.metrics
        if item.token_ids:
            if self.last is None:
                self.first = now
                metrics.first_token(now - self.start)
            else:
                metrics.next_tokens(now - self.last, len(item.token_ids))
            self.last = now
            self.tokens += len(item.token_ids)
            metrics.generated(len(item.token_ids))
        if item.finish is not None:
            self.done = True
            metrics.finished(item.finish.type, item.prompt_tokens, item.cached_tokens, now - self.start,
                             None if self.first is None else self.first - self.start, self.tokens)
        return item

    async def __aiter__(self) -> AsyncIterator[Delta]:
        while not self.done:
            yield await self.next()


class RequestGroup:
    """The sequences of one HTTP request, admitted together; ``async with`` sends them, leaving aborts what has
    not finished."""

    def __init__(self, server: ApiServer, rid: str, gens: list[GenerateReq], stream: bool = False) -> None:
        self.server, self.rid, self.stream = server, rid, stream
        # the scheduler holds a whole result's tokens back (GenerateReq.stream): nobody reads them before its end
        self.streams = [RequestStream(server, msgspec.structs.replace(g, stream=stream)) for g in gens]

    async def __aenter__(self) -> RequestGroup:
        server = self.server
        server.open_streams += self.stream  # given back first thing in __aexit__, whatever ended the request
        server.groups[self.rid] = [s.req.rid for s in self.streams]
        for s in self.streams:
            server.pending[s.req.rid] = s
        try:
            for s in self.streams:
                await server.channel.send("tokenizer", s.req)
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        server = self.server
        server.open_streams -= self.stream
        server.groups.pop(self.rid, None)
        for s in self.streams:
            server.pending.pop(s.req.rid, None)
        for s in self.streams:
            if not s.done:  # the client left (or a sibling failed): stop the work, free the KV
                await server.channel.send("tokenizer", AbortReq(s.req.rid, "client disconnected"))
        if server.idle is not None and not server.pending:
            server.idle.set()


class ApiServer:
    def __init__(self, endpoints: Endpoints, info: dict[str, Any], limits: Limits | None = None,
                 schedulers: tuple[str, ...] = ("scheduler",)) -> None:
        self.schedulers = schedulers  # one per --dp replica
        self.channel = Channel(endpoints, "api", ApiInbox, ("tokenizer", *schedulers))
        self.info = info  # model name, args, limits: what /get_server_info and /v1/models show
        self.limits = limits or Limits()
        self.pending: dict[str, RequestStream] = {}  # every sequence in flight, by its rid
        self.groups: dict[str, list[str]] = {}  # an HTTP request's rid -> the rids of its sequences
        self.open_streams = 0  # groups admitted with stream=True and not yet left
        self.metrics = Metrics(info.get("model", "default"))  # SGLang's families are labelled by it
        self.shadow: dict[str, Any] | None = None  # the shadow's latest report (--shadow-policies)
        self.status: Status | None = None  # every replica's together
        self.statuses: dict[int, Status] = {}  # by replica
        self.healthy = True
        self.draining = False
        self.idle: asyncio.Event | None = None  # set when draining and nothing is in flight any more
        self._replies: dict[int, asyncio.Future[ControlReply]] = {}
        self._ids = itertools.count()
        self._reader: asyncio.Task | None = None

    def start(self) -> None:
        self._reader = asyncio.create_task(self._read_inbox())

    async def close(self) -> None:
        if self._reader:
            self._reader.cancel()
        self.channel.close()

    # -- admission ---------------------------------------------------------------------------------------
    def open(self, rid: str, gens: list[GenerateReq], stream: bool = False) -> RequestGroup:
        """Admit one HTTP request's sequences, or refuse them all (nothing is sent, nothing tokenized). ``stream``:
        the answer is streamed (SSE), and counts against ``Limits.max_streams`` until the group is left."""
        if not self.healthy:
            raise APIError(503, "the server is shutting down", type="service_unavailable")
        if self.draining:
            raise APIError(503, "the server is shutting down and takes no new requests", code="draining",
                           retry_after=RETRY_AFTER_S)
        n, lim = len(gens), self.limits
        self.check_size(n)
        taken = [r for r in [rid, *(g.rid for g in gens)] if r in self.pending or r in self.groups]
        if taken or len({g.rid for g in gens}) < n:
            raise APIError(400, f"request id {(taken or [rid])[0]!r} is already in use; choose another rid",
                           param="rid", code="rid_in_use")
        if len(self.pending) + n > lim.max_in_flight:
            raise APIError(429, f"the server is at capacity ({len(self.pending)} sequences in flight, at most "
                                f"{lim.max_in_flight}); retry later", code="queue_full", retry_after=RETRY_AFTER_S)
        if stream and self.open_streams >= lim.max_streams:
            raise APIError(503, f"the server has {lim.max_streams} streams open, the most it keeps (--max-streams); "
                                "retry later, or ask without \"stream\"", code="too_many_streams",
                           retry_after=RETRY_AFTER_S)
        return RequestGroup(self, rid, gens, stream)

    def check_size(self, n: int) -> None:
        """429 if one HTTP request asks for more than --max-sequences-per-request sequences (prompts x n)."""
        if n > self.limits.max_sequences_per_request:
            raise APIError(429, f"this request asks for {n} sequences (prompts x n); the server takes at most "
                                f"{self.limits.max_sequences_per_request} per request (--max-sequences-per-request):"
                                " split it into several requests", code="too_many_sequences",
                           retry_after=RETRY_AFTER_S)

    async def abort(self, rid: str) -> list[str]:
        """Abort the HTTP request ``rid`` (all its sequences) or the one sequence ``rid``; exact ids only.
        Returns the sequence ids aborted (empty: nothing by that id is in flight)."""
        hits = [r for r in self.groups.get(rid, [rid]) if r in self.pending]
        for r in hits:
            await self.channel.send("tokenizer", AbortReq(r, "aborted by /abort_request"))
        return hits

    def drain(self) -> asyncio.Event:
        """Stop admitting; the returned event is set once every request in flight has ended."""
        self.draining = True
        self.idle = asyncio.Event()
        if not self.pending:
            self.idle.set()
        return self.idle

    def fail_all(self, message: str) -> None:
        """An actor died: every waiting handler answers 503 now instead of hanging."""
        self.healthy = False
        for s in list(self.pending.values()):
            s.queue.put_nowait(APIError(503, message, type="service_unavailable"))

    # -- the inbox ---------------------------------------------------------------------------------------
    async def _read_inbox(self) -> None:
        while True:
            msg = await self.channel.recv()
            try:
                self._dispatch(msg)
            except Exception:  # never let one odd message stop every request's answers
                log.exception("internal error on %s", type(msg).__name__)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, TextBatch):
            for delta in msg.deltas:
                if (s := self.pending.get(delta.rid)) is not None:
                    s.queue.put_nowait(delta)
        elif isinstance(msg, RequestError):
            if (s := self.pending.get(msg.rid)) is not None:
                s.queue.put_nowait(msg)
        elif isinstance(msg, Status):
            self.statuses[msg.replica] = msg
            self.status = msg if len(self.schedulers) == 1 else combined(list(self.statuses.values()))
            self.metrics.status(self.status)
            if len(self.schedulers) > 1:
                self.metrics.replica_status(msg)
        elif isinstance(msg, ShadowReport):
            self.shadow = msg.body
            self.metrics.shadow(msg.body)
        elif isinstance(msg, ControlReply):
            fut = self._replies.pop(msg.reply_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    async def control(self, op: str, timeout: float = 30.0, replica: int | None = None,
                      **kw: str | None) -> ControlReply:
        """Ask the scheduler (it answers between two steps); with --dp, every replica's, or ``replica``'s alone.
        Several answers come back as one: replica 0's body with ``replicas`` (each one's) and ``total`` (the
        counts added up); an error from any of them is the answer's."""
        if replica is not None and not 0 <= replica < len(self.schedulers):
            raise APIError(400, f"replica {replica} does not exist (this server runs {len(self.schedulers)})",
                           param="replica")
        targets = self.schedulers if replica is None else (self.schedulers[replica],)
        replies = await asyncio.gather(*(self._ask(name, op, timeout, lambda i: ControlReq(i, op, **kw))
                                         for name in targets))
        if len(self.schedulers) == 1:
            return replies[0]
        bodies = [r.body for r in replies]
        indices = range(len(self.schedulers)) if replica is None else [replica]
        body = {**bodies[0], "replicas": {str(i): b for i, b in zip(indices, bodies)}, "total": added_up(bodies)}
        return ControlReply(replies[0].reply_id, body, next((r.error for r in replies if r.error), None))

    async def text(self, op: str, timeout: float = 30.0, **kw: Any) -> dict[str, Any]:
        """/tokenize and /detokenize, answered by the tokenizer actor; its error (a bad input) is a 400."""
        reply = await self._ask("tokenizer", op, timeout, lambda i: TextReq(i, op, **kw))
        if reply.error is not None:
            raise APIError(400, reply.error, param="messages" if kw.get("messages") is not None else "prompt")
        return reply.body

    async def _ask(self, actor: str, op: str, timeout: float, message: Callable[[int], Any]) -> ControlReply:
        """Send ``message(reply_id)`` to ``actor`` and wait for its ControlReply."""
        reply_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._replies[reply_id] = fut
        await self.channel.send(actor, message(reply_id))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            self._replies.pop(reply_id, None)
            raise APIError(503, f"the {actor} actor did not answer {op} within {timeout:.0f}s",
                           type="service_unavailable") from None

    def shadow_report(self) -> dict[str, Any]:
        """GET /policies/shadow: every shadow pair's windowed statistics (``enabled`` False without
        --shadow-policies)."""
        if self.shadow is not None:
            return self.shadow
        if not self.info.get("server_args", {}).get("shadow_policies"):
            return {"enabled": False, "pairs": [], "message": "shadow policies are off: start the server with "
                                                              "--shadow-policies all (or policy names)"}
        return {"enabled": True, "pairs": [], "message": "no report yet: the shadow reports once traffic arrives"}

    def server_info(self) -> dict[str, Any]:
        info = dict(self.info)
        info["status"] = msgspec.to_builtins(self.status) if self.status else None
        if len(self.schedulers) > 1:
            info["replica_status"] = [msgspec.to_builtins(self.statuses[i]) if i in self.statuses else None
                                      for i in range(len(self.schedulers))]
        info["healthy"] = self.healthy
        info["draining"] = self.draining
        info["in_flight"] = len(self.pending)
        info["open_streams"] = self.open_streams
        return info


def combined(statuses: list[Status]) -> Status:
    """The replicas' statuses as one: counts added up; the policies named where all replicas run the same ones,
    else "mixed" (so per-policy numbers are never credited to policies some replicas do not run)."""
    first = min(statuses, key=lambda s: s.replica)
    counts = {f: sum(getattr(s, f) for s in statuses) for f in Status.__struct_fields__
              if isinstance(getattr(first, f), int) and f != "replica"}
    names = {f: getattr(first, f) if len({getattr(s, f) for s in statuses}) == 1 else "mixed"
             for f in ("eviction", "schedule")}
    tiers = {k: sum(s.tiers.get(k, 0.0) for s in statuses) for k in first.tiers}
    return msgspec.structs.replace(first, **counts, **names, tiers=tiers)


def added_up(bodies: list[dict]) -> dict:
    """The counts (ints, at any depth of nested objects) that every body has, added up; rates, names and lists
    are left out: they do not add."""
    total: dict = {}
    for key, value in bodies[0].items():
        values = [b.get(key) for b in bodies]
        if isinstance(value, dict) and all(isinstance(v, dict) for v in values):
            if inner := added_up(values):
                total[key] = inner
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            total[key] = sum(values)
    return total
