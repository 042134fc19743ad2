"""Mistral (Instruct v0.3, Nemo, Small): ``[TOOL_CALLS]`` and then a JSON array of calls (a lone object is read
too), content allowed before it::

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

``[TOOL_CALLS]`` is a special token in Mistral's tokenizers, so with tools the output keeps special tokens as text.
Mistral's chat templates take only 9-character alphanumeric call ids back, so the ids here have that shape.
"""
from __future__ import annotations

import secrets
import string

from radixserve.tool_parsers.base import (
    Scan, Tool, ToolCall, ToolParser, any_of, call_schema, decode_prefix, held, json_call, lark_json, lark_str,
    with_defs,
)

MARKER = "[TOOL_CALLS]"
ID_CHARS = string.ascii_letters + string.digits


class Mistral(ToolParser):
    name = "mistral"
    template_markers = (MARKER,)
    special_markers = True

    def scan(self, text: str, at: int, names: frozenset[str], final: bool) -> Scan:
        out = Scan()
        while True:
            start = text.find(MARKER, at)
            if start < 0:
                wait = 0 if final else held(text[at:], (MARKER,))
                out.content(text[at:len(text) - wait])
                out.consumed = len(text) - wait
                return out
            out.content(text[at:start])
            body = start + len(MARKER)
            body += len(text[body:]) - len(text[body:].lstrip())
            decoded = decode_prefix(text, body)
            if decoded is None and not final:  # the array is still being written
                out.consumed = start
                return out
            calls = _calls(decoded[0], names) if decoded is not None else None
            stop = decoded[1] if decoded is not None else len(text)
            out.pieces.extend(calls if calls is not None else [text[start:stop]])
            at = stop

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        array = {"type": "array", "items": any_of([call_schema(t) for t in tools]), "minItems": 1,
                 **({} if parallel else {"maxItems": 1})}
        return f"start: {lark_str(MARKER + ' ')} {lark_json(with_defs(array, tools))}\n"

    def call_id(self) -> str:
        return "".join(secrets.choice(ID_CHARS) for _ in range(9))


def _calls(value: object, names: frozenset[str]) -> list[ToolCall] | None:
    """Every item a call of an offered function, else None (the whole marker-and-array is content)."""
    items = value if isinstance(value, list) else [value]
    calls = [json_call(item, names) for item in items]
    return calls if calls and all(c is not None for c in calls) else None
