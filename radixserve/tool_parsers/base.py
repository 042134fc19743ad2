"""What a tool-call parser is: the model's text in, content and tool calls out (whole, or a piece at a time as the
text grows), plus the grammar that makes a model write only calls in its format.

A parser is stateless: the caller keeps the text and how much of it is settled (``Scan.consumed``), and hands the
whole text back with the settled offset each time, so one parser object serves every request at once::

    text: | settled: pieces already handed out | pending: held back (a marker may be starting, a call is open) |
          0                                    at                                                             len

A call the model wrote malformed (not JSON, a function the request did not offer) is content, never an error.
"""
from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from radixserve.errors import InvalidRequest

_SPACES = re.compile(r"\s*")
# JSON the way chat templates render it (Python's json.dumps, which Jinja's tojson uses): what models were trained on
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the request offers: its name and its parameters' JSON schema (``{}``: any arguments)."""

    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's ``function.arguments``)


@dataclass(slots=True)
class Scan:
    """What a scan settled: ``pieces`` in order (content text and calls), covering ``text[at:consumed]``; the text
    after ``consumed`` waits for more (with ``final``, nothing waits: ``consumed`` is the end of the text)."""

    pieces: list[str | ToolCall] = field(default_factory=list)
    consumed: int = 0

    def content(self, text: str) -> None:
        if text:
            self.pieces.append(text)


class ToolParser(ABC):
    """One tool-call format. Registered by name under the entry-point group ``radixserve.tool_call_parsers`` (a
    class, or a factory called with no arguments)."""

    name: ClassVar[str]
    # a chat template holding all of these renders tools in this format (how --tool-call-parser auto finds it)
    template_markers: ClassVar[tuple[str, ...]] = ()
    # the format's markers are special tokens in its models' tokenizers: the output keeps special tokens as text
    special_markers: ClassVar[bool] = False

    @abstractmethod
    def scan(self, text: str, at: int, names: frozenset[str], final: bool) -> Scan:
        """Settle what can be settled of ``text[at:]`` (``text[:at]`` is already settled; a format may look at it).
        ``names``: the functions the request offers (a call to another is content). Without ``final`` a piece is
        handed out only when nothing later can change it: text that may begin a marker waits. Reads only."""

    @abstractmethod
    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        """A Lark grammar (llguidance's) of output that is nothing but calls of ``tools`` in this format: one call,
        or with ``parallel`` one or more. Every sentence of it scans as calls. InvalidRequest (param ``tools``) if
        the format cannot express a tool."""

    def call_id(self) -> str:
        """A fresh id for a call (OpenAI's shape: ``call_`` and 24 hex digits)."""
        return "call_" + secrets.token_hex(12)


def opening(text: str, n: int) -> str:
    """The first ``n`` characters after the leading whitespace (without copying the rest: scans run every step)."""
    start = _SPACES.match(text).end()
    return text[start:start + n]


def held(text: str, markers: Iterable[str]) -> int:
    """How many characters at the end of ``text`` may be the beginning of one of ``markers`` (they wait)."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[len(text) - n:]):
                longest = n
                break
    return longest


def json_call(obj: Any, names: frozenset[str], keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """``{"name": ..., "arguments": {...}}`` (or another of ``keys``) as a call of an offered function, else None.
    Arguments given as a JSON string holding an object are taken too; none at all are ``{}``."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (json.JSONDecodeError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def loads(text: str) -> Any:
    """``json.loads``, None for text that is not one JSON value."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def decode_prefix(text: str, at: int) -> tuple[Any, int] | None:
    """The JSON value starting at ``text[at]`` and where it ends; None if there is none (yet)."""
    try:
        return json.JSONDecoder().raw_decode(text, at)
    except (json.JSONDecodeError, RecursionError):
        return None


def call_schema(tool: Tool, args_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call of ``tool`` written as ``{"name": ..., args_key: {...}}``."""
    return {"type": "object", "properties": {"name": {"const": tool.name}, args_key: arguments_schema(tool)},
            "required": ["name", args_key], "additionalProperties": False}


def arguments_schema(tool: Tool) -> dict[str, Any]:
    """The tool's parameters schema, an object whatever the schema leaves open."""
    return {"type": "object", **tool.parameters} if tool.parameters else {"type": "object"}


def with_defs(schema: dict[str, Any], tools: list[Tool]) -> dict[str, Any]:
    """``schema`` with every tool's ``$defs`` / ``definitions`` at its root, where the tools' ``#/$defs/...``
    references point once their parameters sit inside a larger schema. InvalidRequest if two tools define one name
    differently."""
    for key in ("$defs", "definitions"):
        merged: dict[str, Any] = {}
        for tool in tools:
            for name, definition in (tool.parameters.get(key) or {}).items():
                if merged.setdefault(name, definition) != definition:
                    raise InvalidRequest(f"tools define {key}/{name} differently; give the definitions one name "
                                         "each", param="tools")
        if merged:
            schema = {**schema, key: merged}
    return schema


def lark_json(schema: dict[str, Any] | bool) -> str:
    """``%json {...}``: a JSON value under ``schema``, written in JSON_STYLE."""
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": JSON_STYLE}
    return "%json " + json.dumps(schema)


def lark_str(text: str) -> str:
    return json.dumps(text)


def any_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def one_or_more(call: str, separator: str, parallel: bool) -> str:
    """The ``start`` rule: one ``call``, or with ``parallel`` one or more joined by ``separator``."""
    rest = f" ({lark_str(separator)} call)*" if parallel else ""
    return f"start: call{rest}\ncall: {call}\n"

