"""Pythonic tool calls (Llama 3.2 / 4, ToolACE): the whole output is a Python list of calls with keyword
arguments, literals only, optionally between ``<|python_start|>`` and ``<|python_end|>``::

    [get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]

An output that begins with anything else is content; one that begins with ``[`` waits until the end and is calls
only if all of it parses (read with ``ast``, never evaluated). ``true`` / ``false`` / ``null`` are read as their
Python names, since the grammar writes arguments as JSON.
"""
from __future__ import annotations

import ast
import json
from typing import Any

from radixserve.errors import InvalidRequest
from radixserve.tool_parsers.base import Scan, Tool, ToolCall, ToolParser, lark_json, lark_str, opening, with_defs

START, END = "<|python_start|>", "<|python_end|>"
NAMES = {"true": True, "false": False, "null": None}
MAX_OPTIONAL = 16  # a grammar writes optional keyword arguments in their order: its size grows with their square


class Pythonic(ToolParser):
    name = "pythonic"
    template_markers = ("[func_name1(",)  # the example call Llama's pythonic templates give

    def scan(self, text: str, at: int, names: frozenset[str], final: bool) -> Scan:
        out = Scan(consumed=len(text))
        lead = opening(text, len(START))
        if at > 0 or not (lead.startswith(("[", START)) or START.startswith(lead)):
            out.content(text[at:])
        elif not final:
            out.consumed = 0
        else:
            calls = parse(text.strip().removeprefix(START).strip().removesuffix(END), names)
            out.pieces = calls if calls else [text]
        return out

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        rules = [f"call: {' | '.join(f'f{i}' for i in range(len(tools)))}"]
        for i, tool in enumerate(tools):
            rules.append(f"f{i}: {lark_str(tool.name + '(')} {_keywords(tool)} \")\"")
        more = ' (", " call)*' if parallel else ""
        return "\n".join([f'start: "[" call{more} "]"', *rules]) + "\n"


def parse(source: str, names: frozenset[str]) -> list[ToolCall] | None:
    """``[f(a=1), ...]`` as calls of offered functions, else None."""
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names
                and not node.args and all(k.arg is not None for k in node.keywords)):
            return None
        try:
            args = {k.arg: _literal(k.value) for k in node.keywords}
        except ValueError:
            return None
        calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
    return calls


def _literal(node: ast.AST) -> Any:
    """A JSON value from a Python literal; ValueError for anything else (a name, a call, a set, bytes)."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float, bool))):
        return node.value
    if isinstance(node, ast.Name) and node.id in NAMES:
        return NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}
    raise ValueError("not a literal")


def _keywords(tool: Tool) -> str:
    """The keyword arguments of a call of ``tool``: the required ones in order, then any of the optional ones,
    in order, each value JSON under its property's schema."""
    props = tool.parameters.get("properties") or {}
    required = [p for p in props if p in set(tool.parameters.get("required") or ())]
    optional = [p for p in props if p not in required]
    if not tool.name.isidentifier() or not all(p.isidentifier() for p in props):
        raise InvalidRequest(f"function {tool.name!r} cannot be written as a Python call (its name and parameter "
                             "names must be identifiers) in the pythonic tool-call format", param="tools")
    if len(optional) > MAX_OPTIONAL:
        raise InvalidRequest(f"function {tool.name!r} has {len(optional)} optional parameters; the pythonic format's "
                             f"grammar takes at most {MAX_OPTIONAL}", param="tools")

    def kw(p: str) -> str:
        schema = props[p] if isinstance(props[p], dict) else {}
        return f"{lark_str(p + '=')} {lark_json(with_defs(schema, [tool]))}"

    if required:
        return " \", \" ".join(kw(p) for p in required) + "".join(f' (", " {kw(p)})?' for p in optional)
    if not optional:
        return ""
    starts = [kw(p) + "".join(f' (", " {kw(q)})?' for q in optional[i + 1:]) for i, p in enumerate(optional)]
    return f"({' | '.join(starts)})?"
