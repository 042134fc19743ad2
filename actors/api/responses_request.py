"""The request of OpenAI's Responses API (``POST /v1/responses``): its fields, its ``input`` items made into the
chat template's messages, its function tools made into the chat route's (actors/api/responses.py serves it)."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from radixserve.actors.api.errors import APIError
from radixserve.actors.api.protocol import (
    FunctionDef, FunctionRef, JsonSchemaFormat, NamedToolChoice, ResponseFormat, ToolDef,
)
from radixserve.actors.api.tool_calls import ToolUse
from radixserve.tool_parsers import ToolParser


class InputText(msgspec.Struct):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(msgspec.Struct):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None


class FunctionCallItem(msgspec.Struct):
    """A call the model made earlier, sent back in the conversation."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = "{}"
    id: str | None = None
    status: str | None = None


class FunctionOutputItem(msgspec.Struct):
    """What a call returned."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


ITEMS = {"message": InputMessage, "function_call": FunctionCallItem, "function_call_output": FunctionOutputItem}


def template_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` items as the chat template takes them: messages; each run of function calls as one assistant
    message with ``tool_calls`` (arguments as objects); each output as a ``tool`` message. A 400 naming the item."""
    out: list[dict[str, Any]] = []
    for i, raw in enumerate(items):
        kind = raw.get("type", "message") if isinstance(raw, dict) else None
        if kind not in ITEMS:
            raise APIError(400, f"input[{i}] is a {kind!r} item; served: messages, function_call and "
                                "function_call_output", param=f"input[{i}].type")
        try:
            item = msgspec.convert(raw, ITEMS[kind])
        except msgspec.ValidationError as exc:
            raise APIError(400, f"input[{i}]: {exc}", param=f"input[{i}]") from None
        if isinstance(item, InputMessage):
            text = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            out.append({"role": "system" if item.role == "developer" else item.role, "content": text})
        elif isinstance(item, FunctionOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        else:
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": arguments(item.arguments, i)}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
    return out


def arguments(text: str, index: int | None = None) -> dict[str, Any]:
    """A call's arguments as the templates write them (an object); a 400 naming the item if they are not one
    (``index`` None: the model's own call, whose unparsable arguments are taken as none)."""
    try:
        value = json.loads(text) if text.strip() else {}
    except (json.JSONDecodeError, RecursionError):
        value = None
    if isinstance(value, dict):
        return value
    if index is None:
        return {}
    raise APIError(400, f"input[{index}].arguments must be a JSON object (as text)", param=f"input[{index}].arguments")


class TextFormat(msgspec.Struct):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None

    def constraint(self) -> str | None:
        """The schema the output must follow (None: free text), as chat's ``response_format`` says it."""
        if self.type == "json_schema" and self.schema is None:
            raise APIError(400, 'text.format json_schema needs {"name": ..., "schema": {...}}', param="text.format")
        inner = JsonSchemaFormat(self.name or "response", self.schema) if self.type == "json_schema" else None
        return ResponseFormat(self.type, inner).schema()

    def shown(self) -> dict[str, Any]:
        return {"type": self.type, **({"name": self.name, "schema": self.schema, "strict": self.strict}
                                      if self.type == "json_schema" else {})}


class TextConfig(msgspec.Struct):
    format: TextFormat = msgspec.field(default_factory=TextFormat)


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """The fields OpenAI's clients send; others are ignored, as SGLang does."""

    input: str | list[dict[str, Any]]
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
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None
    top_logprobs: int | None = None

    def refuse_unserved(self) -> None:
        """A 400 naming each field whose value would change the answer in a way not served here."""
        if self.background:
            raise APIError(400, "background responses are not served; send the request and wait (or stream it)",
                           param="background")
        if self.top_logprobs:
            raise APIError(400, "top_logprobs are not served on /v1/responses; use /v1/chat/completions",
                           param="top_logprobs")
        if self.truncation == "auto":
            raise APIError(400, "truncation 'auto' is not served: a conversation longer than the context fails "
                                "with a 400 instead", param="truncation")

    def turns(self) -> list[dict[str, Any]]:
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return template_items(self.input)

    def tool_use(self, parser: ToolParser | None) -> ToolUse | None:
        """The function tools as the chat route serves them (Responses' flat ``{"type": "function", "name": ...}``
        made into chat's ``{"function": {...}}``); a 400 naming any other kind of tool."""
        defs = []
        for i, tool in enumerate(self.tools or ()):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise APIError(400, f"tools[{i}] is a {kind!r} tool; only function tools are served",
                               param=f"tools[{i}].type")
            try:
                fields = {k: v for k, v in tool.items() if k in ("name", "description", "parameters", "strict")}
                defs.append(ToolDef("function", msgspec.convert(fields, FunctionDef)))
            except msgspec.ValidationError as exc:
                raise APIError(400, f"tools[{i}]: {exc}", param=f"tools[{i}]") from None
        choice: str | NamedToolChoice | None = None
        if isinstance(self.tool_choice, dict):
            if self.tool_choice.get("type") != "function" or not isinstance(self.tool_choice.get("name"), str):
                raise APIError(400, 'tool_choice names a function as {"type": "function", "name": ...}',
                               param="tool_choice")
            choice = NamedToolChoice("function", FunctionRef(self.tool_choice["name"]))
        elif self.tool_choice is not None:
            if self.tool_choice not in ("none", "auto", "required"):
                raise APIError(400, "tool_choice is none, auto, required or a function", param="tool_choice")
            choice = self.tool_choice
        if not defs and choice not in (None, "none", "auto"):
            raise APIError(400, f"tool_choice {self.tool_choice!r} needs tools", param="tool_choice")
        return ToolUse.build(defs, choice, self.parallel_tool_calls, self.text.format.type != "text", parser)
