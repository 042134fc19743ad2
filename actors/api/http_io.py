"""Reading request bodies (decode = validate) and writing responses: JSON and server-sent events."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from radixserve.actors.api.errors import APIError, from_validation
from radixserve.actors.api.server import SERVER, RequestGroup, RequestStream
from radixserve.actors.api.unknown_fields import note_ignored, undeclared
from radixserve.wire.messages import Delta

T = TypeVar("T")
_encoder = msgspec.json.Encoder()


async def decode_body(request: web.Request, kind: type[T]) -> T:
    """The body as ``kind``. A struct declared without ``forbid_unknown_fields`` ignores fields it does not
    declare, as SGLang does (unknown_fields.py: named in the response's header, or a 400 where they matter)."""
    raw = await request.read()
    if not raw:
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        body = msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise from_validation(exc) from None
    except msgspec.DecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    if not kind.__struct_config__.forbid_unknown_fields:
        note_ignored(request, undeclared(raw, kind), kind.__struct_fields__)
    return body


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=_encoder.encode(body), status=status, content_type="application/json")


async def open_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    return resp


async def send_event(resp: web.StreamResponse, body: Any) -> None:
    await resp.write(b"data: " + _encoder.encode(body) + b"\n\n")


async def send_done(resp: web.StreamResponse) -> None:
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()


async def stream_events(request: web.Request, events: AsyncIterator[Any]) -> web.StreamResponse:
    """Send ``events`` as SSE, then ``[DONE]``. An error after the stream started (the headers are gone) is sent
    as an OpenAI error event, so the client learns why it ended."""
    resp = await open_sse(request)
    try:
        async for body in events:
            await send_event(resp, body)
    except APIError as exc:
        if (server := request.app.get(SERVER)) is not None:
            server.metrics.rejected(exc.reason)
        await send_event(resp, exc.body())
    await send_done(resp)
    return resp


async def first_deltas(group: RequestGroup) -> list[Delta]:
    """Each sequence's first delta: a request refused by the tokenizer or the scheduler is still a clean 4xx
    (no response has started)."""
    return [await s.next() for s in group.streams]


async def merged(group: RequestGroup, firsts: list[Delta]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) as they arrive from all of ``group``'s sequences, starting with their already-read
    ``firsts``."""
    streams = group.streams
    queue: asyncio.Queue[tuple[int, Delta | APIError]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((i, delta))
        except APIError as exc:
            queue.put_nowait((i, exc))

    for i, first in enumerate(firsts):
        queue.put_nowait((i, first))
    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, item = await queue.get()
            if isinstance(item, APIError):
                raise item
            yield i, item
            remaining -= item.finish is not None
    finally:
        for t in tasks:
            t.cancel()
