"""Tool calling on the chat route: OpenAI's ``tools`` and ``tool_choice``, served as SGLang and vLLM serve them.

The tools go to the chat template, which shows them to the model (a template that ignores tools shows nothing);
the server's tool-call parser (``--tool-call-parser``) reads each choice's text into ``content`` and
``tool_calls``, whole or as a stream (radixserve/tool_parsers):

    tool_choice        what the model may write                              read as calls
    none               anything                                              no: all of it is content
    auto (default)     anything; a call it writes malformed stays content    yes
    required           only calls, one or more (parallel_tool_calls false:   yes: the grammar makes them parse
                       one), of any tool: the parser's grammar
    {"function": f}    only one call, of f: the parser's grammar             yes
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from radixserve.actors.api.errors import APIError
from radixserve.actors.api.protocol import ChatCompletionRequest, NamedToolChoice, ToolDef
from radixserve.errors import InvalidRequest
from radixserve.sampling_params import SamplingParams
from radixserve.tool_parsers import Tool, ToolCall, ToolParser
from radixserve.tool_parsers.reader import Reader


@dataclass(frozen=True, slots=True)
class ToolUse:
    """One chat request's tools, as the route needs them."""

    template_tools: list[dict[str, Any]]  # what the chat template gets (OpenAI's shape)
    parser: ToolParser | None  # None: tool_choice none, the text is content
    names: frozenset[str]  # the functions a call may name
    grammar: str | None = None  # required / a named function: only calls (a Lark grammar, as ``ebnf``)

    @classmethod
    def of(cls, body: ChatCompletionRequest, parser: ToolParser | None) -> ToolUse | None:
        """A chat request's tools (None without any); see ``build``."""
        formatted = body.response_format is not None and body.response_format.type != "text"
        constrained = formatted or any(v is not None for v in (body.regex, body.json_schema, body.ebnf))
        return cls.build(body.tools, body.tool_choice, body.parallel_tool_calls, constrained, parser)

    @classmethod
    def build(cls, tools: list[ToolDef] | None, choice: str | NamedToolChoice | None, parallel: bool | None,
              constrained: bool, parser: ToolParser | None) -> ToolUse | None:
        """None without tools. APIError (400) for a tool_choice this server cannot serve: no parser, a grammar
        that cannot be built, or calls required of an output already constrained (``constrained``: a response
        format, regex, json_schema or ebnf); the message names the field."""
        if not tools:
            return None
        template_tools = [msgspec.to_builtins(t) for t in tools]
        asked = choice
        choice = choice or "auto"
        if choice == "none":
            return cls(template_tools, None, frozenset())
        if parser is None:
            raise APIError(400, f"tool_choice {_label(choice)} needs a tool-call parser, and this server has none: "
                                "its chat template shows no tool-call format it knows; start it with "
                                "--tool-call-parser (hermes, llama3, mistral, pythonic, ...), or send tool_choice none",
                           param="tools" if asked is None else "tool_choice")
        offered = [Tool(t.function.name, t.function.parameters or {}) for t in tools]
        if isinstance(choice, NamedToolChoice):
            offered = [t for t in offered if t.name == choice.function.name]
        names = frozenset(t.name for t in offered)
        if choice == "auto":
            return cls(template_tools, parser, names)
        if constrained:
            raise APIError(400, f"tool_choice {_label(choice)} constrains the output to tool calls; it cannot be "
                                "combined with response_format, regex, json_schema or ebnf", param="tool_choice")
        grammar = parser.grammar(offered, parallel is not False and choice == "required")
        return cls(template_tools, parser, names, grammar)

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` for this request: under the calls' grammar (required, a named function), and keeping special
        tokens where the format's markers are special tokens (Mistral's ``[TOOL_CALLS]``)."""
        changes: dict[str, Any] = {}
        if self.grammar is not None:
            changes["ebnf"] = self.grammar
        if self.parser is not None and self.parser.special_markers:
            changes["skip_special_tokens"] = False
        if not changes:
            return params
        try:
            return msgspec.structs.replace(params, **changes)  # validated again: the grammar is compiled here
        except InvalidRequest as exc:
            if exc.param != "ebnf":
                raise
            # a parameters schema llguidance refuses, or one whose patterns outgrow its limits
            raise APIError(400, f"the grammar of the tools' calls: {exc}", param="tools") from None

    def reader(self) -> Reader | None:
        """A choice's reader of its text (None: tool_choice none, nothing to read)."""
        return Reader(self.parser, self.names) if self.parser is not None else None

    def calls(self, calls: list[ToolCall], first: int | None = None) -> list[dict[str, Any]]:
        """OpenAI's ``tool_calls`` items, each with a fresh id; ``first``: a stream's index of the first of them."""
        out = []
        for k, call in enumerate(calls):
            item = {"id": self.parser.call_id(), "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}}
            out.append(item if first is None else {"index": first + k, **item})
        return out


def _label(choice: object) -> str:
    return f"{{function: {choice.function.name}}}" if isinstance(choice, NamedToolChoice) else str(choice)
