"""OpenAI's Responses API: ``POST /v1/responses`` (JSON, or SSE with the typed ``response.*`` events),
``GET /v1/responses/{id}``, ``DELETE /v1/responses/{id}``.

A response is one chat turn: ``instructions`` (a system message), then, with ``previous_response_id``, the stored
conversation of that response (its inputs and its output; not its instructions, as OpenAI does), then ``input``
(a string, or messages whose content is a string or ``input_text`` parts). The chat template renders it and the
radix cache does the rest: a conversation chained by ``previous_response_id`` recomputes only the new turn.
``text.format`` constrains the output as ``response_format`` does on chat (``json_schema``, ``json_object``).

Stored responses (``store``, default true) live in this api process only, the ``STORED`` most recent ones: a
restart, or more responses than that, forgets them (404 naming the id). Not served here: tools (use
/v1/chat/completions), ``background``, reasoning items, ``top_logprobs``; they are refused with a 400 naming the
field rather than ignored.
"""
from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from typing import Annotated, Any, Literal

import msgspec
from aiohttp import web
from msgspec import Meta

from radixserve.actors.api.errors import APIError
from radixserve.actors.api.io import decode_body, first_deltas, json_response, open_sse
from radixserve.actors.api.server import ApiServer
from radixserve.actors.messages import Delta, GenerateReq
from radixserve.sampling_params import SamplingParams

STORED = 1024  # responses kept for previous_response_id and GET, the oldest forgotten first
_encoder = msgspec.json.Encoder()


class InputText(msgspec.Struct):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(msgspec.Struct):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    type: Literal["message"] = "message"

    def turn(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class TextFormat(msgspec.Struct):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None

    def constraint(self) -> str | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return '{"type": "object"}'
        if self.schema is None:
            raise APIError(400, 'text.format json_schema needs {"name": ..., "schema": {...}}', param="text.format")
        return msgspec.json.encode(self.schema).decode()

    def shown(self) -> dict[str, Any]:
        return {"type": self.type, **({"name": self.name, "schema": self.schema, "strict": self.strict}
                                      if self.type == "json_schema" else {})}


class TextConfig(msgspec.Struct):
    format: TextFormat = msgspec.field(default_factory=TextFormat)


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """The fields OpenAI's clients send; others are ignored, as SGLang does."""

    input: str | list[InputMessage]
    model: str | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    seed: int | None = None  # an extension, as on chat
    stream: bool = False
    store: bool = True
    text: TextConfig = msgspec.field(default_factory=TextConfig)
    metadata: dict[str, str] | None = None
    user: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None
    top_logprobs: int | None = None

    def refuse_unserved(self) -> None:
        """A 400 naming each field whose value would change the answer in a way not served here."""
        if self.tools:
            raise APIError(400, "tools are not served on /v1/responses; call tools through /v1/chat/completions",
                           param="tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools, which /v1/responses does not serve", param="tool_choice")
        if self.background:
            raise APIError(400, "background responses are not served; send the request and wait (or stream it)",
                           param="background")
        if self.top_logprobs:
            raise APIError(400, "top_logprobs are not served on /v1/responses; use /v1/chat/completions",
                           param="top_logprobs")
        if self.truncation == "auto":
            raise APIError(400, "truncation 'auto' is not served: a conversation longer than the context fails "
                                "with a 400 instead", param="truncation")

    def turns(self) -> list[dict[str, str]]:
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return [m.turn() for m in self.input]


class ResponseStore:
    """The last STORED responses, by id: their body (for GET) and their conversation without instructions (for
    previous_response_id). Mutated only by ``put`` and ``delete``."""

    def __init__(self, size: int = STORED) -> None:
        self.size = size
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, str]]]] = OrderedDict()

    def put(self, body: dict[str, Any], conversation: list[dict[str, str]]) -> None:
        self._items[body["id"]] = (body, conversation)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, rid: str, param: str = "response_id") -> tuple[dict[str, Any], list[dict[str, str]]]:
        if rid not in self._items:
            raise APIError(404, f"no stored response {rid!r}: it was never stored (store: false), or this server "
                                f"restarted or has stored {self.size} newer ones since", param=param,
                           code="response_not_found")
        return self._items[rid]

    def delete(self, rid: str) -> None:
        self.get(rid)
        del self._items[rid]


class ResponsesRoutes:
    def __init__(self, server: ApiServer, check_model) -> None:
        """``check_model``: the OpenAI routes' (a 404 for a model not served)."""
        self.server, self.check_model = server, check_model
        self.store = ResponseStore()

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve)
        app.router.add_delete("/v1/responses/{response_id}", self.delete)

    async def retrieve(self, request: web.Request) -> web.Response:
        return json_response(self.store.get(request.match_info["response_id"])[0])

    async def delete(self, request: web.Request) -> web.Response:
        rid = request.match_info["response_id"]
        self.store.delete(rid)
        return json_response({"id": rid, "object": "response", "deleted": True})

    async def create(self, request: web.Request) -> web.StreamResponse:
        body = await decode_body(request, ResponsesRequest)
        body.refuse_unserved()
        self.check_model(body.model)
        history = self.store.get(body.previous_response_id, "previous_response_id")[1] \
            if body.previous_response_id else []
        conversation = history + body.turns()
        messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
        params = SamplingParams(max_new_tokens=body.max_output_tokens,
                                temperature=1.0 if body.temperature is None else body.temperature,
                                top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
                                json_schema=body.text.format.constraint())
        if self.server.limits.vocab_size is not None:
            params.check_model(self.server.limits.vocab_size)
        turn = Turn(body, self.server.info["model"] if body.model is None else body.model)
        async with self.server.open(turn.id, [GenerateReq(turn.id, params, messages=messages)],
                                    stream=body.stream) as group:
            (first,) = await first_deltas(group)  # a request the tokenizer or scheduler refuses is still a 4xx
            if not body.stream:
                turn.add(first)
                async for delta in group.streams[0]:
                    turn.add(delta)
                return json_response(self.finish(turn, conversation))
            resp = await open_sse(request)
            try:
                for event in turn.opening():
                    await send(resp, event)
                delta: Delta | None = first
                while delta is not None:
                    if delta.text:
                        await send(resp, turn.event("response.output_text.delta", item_id=turn.item_id,
                                                    output_index=0, content_index=0, delta=delta.text))
                    turn.add(delta)
                    delta = None if turn.finish is not None else await group.streams[0].next()
                for event in turn.closing(self.finish(turn, conversation)):
                    await send(resp, event)
            except APIError as exc:  # after the headers went out: the stream's own error event says why
                self.server.metrics.rejected(exc.reason)
                await send(resp, turn.event("error", code=exc.reason, message=exc.message, param=exc.param))
            await resp.write_eof()
            return resp

    def finish(self, turn: Turn, conversation: list[dict[str, str]]) -> dict[str, Any]:
        final = turn.body("completed" if turn.finish is None or turn.finish.type != "length" else "incomplete")
        if turn.request.store:
            self.store.put(final, conversation + [{"role": "assistant", "content": turn.text}])
        return final


class Turn:
    """One response as it is written: the text so far, the usage, and the events and body that show it."""

    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self.request, self.model = request, model
        self.id, self.item_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.text, self.finish = "", None
        self.input_tokens = self.output_tokens = self.cached_tokens = 0
        self.sequence = 0

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.input_tokens, self.output_tokens, self.cached_tokens = (delta.prompt_tokens, delta.completion_tokens,
                                                                     delta.cached_tokens)
        self.finish = delta.finish or self.finish

    def message(self, status: str) -> dict[str, Any]:
        content = [self.part()] if status == "completed" else []
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": []}

    def body(self, status: Literal["in_progress", "completed", "incomplete"]) -> dict[str, Any]:
        r = self.request
        done = status != "in_progress"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model,
            "output": [self.message("completed")] if done else [], "parallel_tool_calls": bool(r.parallel_tool_calls),
            "previous_response_id": r.previous_response_id, "reasoning": None, "store": r.store,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": {"format": r.text.format.shown()}, "tool_choice": r.tool_choice or "auto", "tools": [],
            "top_p": 1.0 if r.top_p is None else r.top_p, "truncation": r.truncation or "disabled",
            "usage": {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                      "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": self.input_tokens + self.output_tokens} if done else None,
            "user": r.user, "metadata": r.metadata or {},
        }

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def opening(self) -> list[dict[str, Any]]:
        """The events before the first text: the response, its message item, the message's text part."""
        started = self.body("in_progress")
        return [self.event("response.created", response=started),
                self.event("response.in_progress", response=started),
                self.event("response.output_item.added", output_index=0, item=self.message("in_progress")),
                self.event("response.content_part.added", item_id=self.item_id, output_index=0, content_index=0,
                           part={"type": "output_text", "text": "", "annotations": []})]

    def closing(self, final: dict[str, Any]) -> list[dict[str, Any]]:
        """The events after the last text, ending with the response as stored."""
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        last = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return [self.event("response.output_text.done", **where, text=self.text),
                self.event("response.content_part.done", **where, part=self.part()),
                self.event("response.output_item.done", output_index=0, item=self.message("completed")),
                self.event(last, response=final)]


async def send(resp: web.StreamResponse, event: dict[str, Any]) -> None:
    """One typed SSE event: its type as the event name, the whole event as data (what OpenAI's clients read)."""
    await resp.write(b"event: " + event["type"].encode() + b"\ndata: " + _encoder.encode(event) + b"\n\n")
