"""Llama 3.1 / 3.2 JSON tool calls: the whole output is one call, or several joined by ``;``, each a JSON object
with the function's ``name`` and its ``parameters`` (``arguments`` is read too), after an optional
``<|python_tag|>``::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

An output that begins with anything else is content. One that begins like a call waits until the end (the JSON can
only be judged whole): the calls that parse are calls, and the text from the first one that does not is content.
"""
from __future__ import annotations

from radixserve.tool_parsers.base import (
    Scan, Tool, ToolCall, ToolParser, any_of, call_schema, decode_prefix, json_call, lark_json, one_or_more, opening,
    with_defs,
)

TAG = "<|python_tag|>"
KEYS = ("parameters", "arguments")


class Llama3Json(ToolParser):
    name = "llama3"
    template_markers = ('"parameters": dictionary of argument name',)  # Llama 3.1 / 3.2's own instruction

    def scan(self, text: str, at: int, names: frozenset[str], final: bool) -> Scan:
        out = Scan(consumed=len(text))
        lead = opening(text, len(TAG))
        if at > 0 or not (lead.startswith(("{", TAG)) or TAG.startswith(lead)):
            out.content(text[at:])  # content from the start: it all goes out as it comes
        elif not final:
            out.consumed = 0  # a call, or the beginning of one: judged at the end
        else:
            out.pieces = calls_then_content(text, names)
        return out

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        calls = with_defs(any_of([call_schema(t, "parameters") for t in tools]), tools)
        return one_or_more(lark_json(calls), "; ", parallel)


def calls_then_content(text: str, names: frozenset[str]) -> list[str | ToolCall]:
    """The calls at the start of ``text`` (after the tag), then the rest as content; all content if none."""
    i = len(text) - len(text.lstrip())
    i += len(TAG) if text.startswith(TAG, i) else 0
    pieces: list[str | ToolCall] = []
    while True:
        j = _skip(text, i, ";" if pieces else "")
        if j == len(text):
            return pieces or [text]
        decoded = decode_prefix(text, j)
        call = json_call(decoded[0], names, KEYS) if decoded is not None else None
        if call is None:
            return [*pieces, text[i:]] if pieces else [text]
        pieces.append(call)
        i = decoded[1]


def _skip(text: str, i: int, separator: str) -> int:
    """Past whitespace and at most one ``separator``."""
    while i < len(text) and text[i].isspace():
        i += 1
    if separator and text.startswith(separator, i):
        return _skip(text, i + len(separator), "")
    return i
