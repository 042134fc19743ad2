"""OpenAI's Responses API: ``POST /v1/responses`` (JSON, or SSE with the typed ``response.*`` events),
``GET /v1/responses/{id}``, ``DELETE /v1/responses/{id}``; its request is read in responses_request.py.

A response is one chat turn: ``instructions`` (a system message), then, with ``previous_response_id``, the stored
conversation of that response (its inputs and its output; not its instructions, as OpenAI does), then ``input``
(a string, or items: messages whose content is a string or ``input_text`` parts, ``function_call`` items the model
made and ``function_call_output`` items answering them). The chat template renders it and the radix cache does
the rest: a conversation chained by ``previous_response_id`` recomputes only the new turn. ``text.format``
constrains the output as ``response_format`` does on chat (``json_schema``, ``json_object``). Function ``tools``
and ``tool_choice`` are served as on chat (actors/api/tool_calls.py: the template shows them, the server's
tool-call parser reads the output, ``required`` or a named function puts the output under the calls' grammar);
each call is a ``function_call`` output item.

Stored responses (``store``, default true) live in this api process only, the ``STORED`` most recent ones: a
restart, or more responses than that, forgets them (404 naming the id). Not served here: tools other than
functions (web search, file search, ...), ``background``, reasoning items, ``top_logprobs``; they are refused with
a 400 naming the field rather than ignored.
"""
from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from typing import Any, Literal

import msgspec
from aiohttp import web

from radixserve.actors.api.errors import APIError
from radixserve.actors.api.http_io import decode_body, first_deltas, json_response, open_sse
from radixserve.actors.api.responses_request import ResponsesRequest, arguments
from radixserve.actors.api.server import ApiServer
from radixserve.actors.api.tool_calls import ToolUse
from radixserve.sampling_params import SamplingParams
from radixserve.tool_parsers import ToolCall
from radixserve.wire.messages import Delta, GenerateReq

STORED = 1024  # responses kept for previous_response_id and GET, the oldest forgotten first
_encoder = msgspec.json.Encoder()


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
    def __init__(self, server: ApiServer, openai) -> None:
        """``openai``: the OpenAI routes (their check of the model's name, their tool-call parser)."""
        self.server, self.openai = server, openai
        self.store = ResponseStore()

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve)
        app.router.add_delete("/v1/responses/{response_id}", self.delete)

    async def retrieve(self, request: web.Request) -> web.Response:
        """A stored response (``store``: true), as it was answered; 404 for an id not stored."""
        return json_response(self.store.get(request.match_info["response_id"])[0])

    async def delete(self, request: web.Request) -> web.Response:
        """Forget a stored response; 404 for an id not stored."""
        rid = request.match_info["response_id"]
        self.store.delete(rid)
        return json_response({"id": rid, "object": "response", "deleted": True})

    async def create(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API: ``input`` (text or items), ``instructions``, ``previous_response_id`` to go
        on from a stored response, text formats (JSON schema), function tools; streamed as its typed events."""
        body = await decode_body(request, ResponsesRequest)
        body.refuse_unserved()
        self.openai.check_model(body.model)
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
        tools = body.tool_use(self.openai.tool_parser)
        if tools is not None:
            params = tools.sampling_params(params)
        turn = Turn(body, self.server.info["model"] if body.model is None else body.model, tools)
        gen = GenerateReq(turn.id, params, messages=messages,
                          tools=tools.template_tools if tools is not None else None)
        async with self.server.open(turn.id, [gen], stream=body.stream) as group:
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
                    for event in turn.add(delta):
                        await send(resp, event)
                    delta = None if turn.finish is not None else await group.streams[0].next()
                final = self.finish(turn, conversation)
                await send(resp, turn.event("response.completed" if final["status"] == "completed"
                                            else "response.incomplete", response=final))
            except APIError as exc:  # after the headers went out: the stream's own error event says why
                self.server.metrics.rejected(exc.reason)
                await send(resp, turn.event("error", code=exc.reason, message=exc.message, param=exc.param))
            await resp.write_eof()
            return resp

    def finish(self, turn: Turn, conversation: list[dict[str, Any]]) -> dict[str, Any]:
        final = turn.body("incomplete" if turn.finish is not None and turn.finish.type == "length" else "completed")
        if turn.request.store:
            self.store.put(final, conversation + [turn.as_said()])
        return final


class Turn:
    """One response as it is written: its output items (messages and function calls, in the order the model wrote
    them), the usage, and the events and body that show it. ``add`` takes each delta and returns its events."""

    def __init__(self, request: ResponsesRequest, model: str, tools: ToolUse | None = None) -> None:
        self.request, self.model, self.tools = request, model, tools
        self.reader = tools.reader() if tools is not None else None  # None: every word is the message's
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.finish = None
        self.input_tokens = self.output_tokens = self.cached_tokens = 0
        self.items: list[dict[str, Any]] = []  # output items, each final once the next one starts
        self.writing: dict[str, Any] | None = None  # the message item text is going to
        self.calls: list[ToolCall] = []
        self.sequence = 0

    def add(self, delta: Delta) -> list[dict[str, Any]]:
        self.input_tokens, self.output_tokens, self.cached_tokens = (delta.prompt_tokens, delta.completion_tokens,
                                                                     delta.cached_tokens)
        self.finish = delta.finish or self.finish
        done = self.finish is not None
        if self.reader is None:
            content, calls = delta.text, []
        else:
            content, calls = self.reader.feed(delta.text, final=done)
        events = self._say(content) if content else []
        for call in calls:
            events += self._call(call)
        if done:
            if not self.items:  # nothing written at all: one empty message, as OpenAI answers
                events += self._say("")
            events += self._close()
        return events

    def _say(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self.writing is None:
            self.writing = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                            "role": "assistant", "content": [], "text": ""}
            self.items.append(self.writing)
            where = self._where(self.writing)
            events += [self.event("response.output_item.added", output_index=where["output_index"],
                                  item=self._shown(self.writing)),
                       self.event("response.content_part.added", **where,
                                  part={"type": "output_text", "text": "", "annotations": []})]
        self.writing["text"] += text
        if text:
            events.append(self.event("response.output_text.delta", **self._where(self.writing), delta=text))
        return events

    def _close(self) -> list[dict[str, Any]]:
        item, self.writing = self.writing, None
        if item is None:
            return []
        item["status"] = "completed"
        where = self._where(item)
        part = {"type": "output_text", "text": item["text"], "annotations": []}
        return [self.event("response.output_text.done", **where, text=item["text"]),
                self.event("response.content_part.done", **where, part=part),
                self.event("response.output_item.done", output_index=where["output_index"], item=self._shown(item))]

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        events = self._close()
        self.calls.append(call)
        item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": self.tools.parser.call_id(),
                "name": call.name, "arguments": call.arguments, "status": "completed"}
        self.items.append(item)
        index = len(self.items) - 1
        return events + [
            self.event("response.output_item.added", output_index=index,
                       item={**item, "arguments": "", "status": "in_progress"}),
            self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                       delta=call.arguments),
            self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       arguments=call.arguments),
            self.event("response.output_item.done", output_index=index, item=item)]

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item), "content_index": 0}

    @staticmethod
    def _shown(item: dict[str, Any]) -> dict[str, Any]:
        """A message item as the API shows it (its text inside its one content part, once completed)."""
        if item["type"] != "message":
            return item
        content = [{"type": "output_text", "text": item["text"], "annotations": []}] \
            if item["status"] == "completed" else []
        return {k: v for k, v in item.items() if k != "text"} | {"content": content}

    def as_said(self) -> dict[str, Any]:
        """This turn as the next one's conversation holds it: the assistant's text and calls."""
        said: dict[str, Any] = {"role": "assistant",
                                "content": "".join(i["text"] for i in self.items if i["type"] == "message")}
        calls = [i for i in self.items if i["type"] == "function_call"]
        if calls:
            said["tool_calls"] = [{"id": c["call_id"], "type": "function",
                                   "function": {"name": c["name"], "arguments": arguments(c["arguments"])}}
                                  for c in calls]
        return said

    def body(self, status: Literal["in_progress", "completed", "incomplete"]) -> dict[str, Any]:
        r = self.request
        done = status != "in_progress"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model,
            "output": [self._shown(i) for i in self.items] if done else [],
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id, "reasoning": None, "store": r.store,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": {"format": r.text.format.shown()}, "tool_choice": r.tool_choice or "auto",
            "tools": r.tools or [], "top_p": 1.0 if r.top_p is None else r.top_p,
            "truncation": r.truncation or "disabled",
            "usage": {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                      "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": self.input_tokens + self.output_tokens} if done else None,
            "user": r.user, "metadata": r.metadata or {},
        }

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def opening(self) -> list[dict[str, Any]]:
        """The events before the first output item."""
        started = self.body("in_progress")
        return [self.event("response.created", response=started),
                self.event("response.in_progress", response=started)]


async def send(resp: web.StreamResponse, event: dict[str, Any]) -> None:
    """One typed SSE event: its type as the event name, the whole event as data (what OpenAI's clients read)."""
    await resp.write(b"event: " + event["type"].encode() + b"\ndata: " + _encoder.encode(event) + b"\n\n")
