"""Hermes / Qwen 2.5 / Qwen 3: each call a JSON object between ``<tool_call>`` and ``</tool_call>``, content
allowed before, between and after the calls::

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""
from __future__ import annotations

from radixserve.tool_parsers.base import (
    Scan, Tool, ToolParser, any_of, call_schema, held, json_call, lark_json, lark_str, loads, one_or_more, with_defs,
)

START, END = "<tool_call>", "</tool_call>"


class Hermes(ToolParser):
    name = "hermes"
    template_markers = (START,)

    def scan(self, text: str, at: int, names: frozenset[str], final: bool) -> Scan:
        out = Scan()
        while True:
            start = text.find(START, at)
            if start < 0:
                wait = 0 if final else held(text[at:], (START,))
                out.content(text[at:len(text) - wait])
                out.consumed = len(text) - wait
                return out
            out.content(text[at:start])
            end = text.find(END, start)
            if end < 0 and not final:  # the call is still being written
                out.consumed = start
                return out
            stop = len(text) if end < 0 else end + len(END)  # an unclosed last call is read to the end
            call = json_call(loads(text[start + len(START):stop if end < 0 else end]), names)
            out.pieces.append(call if call is not None else text[start:stop])
            at = stop

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        body = lark_json(with_defs(any_of([call_schema(t) for t in tools]), tools))
        return one_or_more(f"{lark_str(START + chr(10))} {body} {lark_str(chr(10) + END)}", "\n", parallel)
