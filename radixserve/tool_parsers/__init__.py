"""Tool-call parsers by name, through the entry-point group a third-party package can add to (the built-ins are
registered the same way, in pyproject.toml)::

    [project.entry-points."radixserve.tool_call_parsers"]
    my-format = "my_package.module:MyParser"      # a ToolParser class (or factory) called with no arguments

``--tool-call-parser auto`` (the default) takes the parser whose ``template_markers`` the chat template holds.
"""
from __future__ import annotations

from radixserve.plugins import load_plugin, registered
from radixserve.tool_parsers.base import Scan, Tool, ToolCall, ToolParser

GROUP = "radixserve.tool_call_parsers"
__all__ = ["Scan", "Tool", "ToolCall", "ToolParser", "available", "infer_tool_parser", "load_tool_parser",
           "resolve_tool_parser"]


def available() -> list[str]:
    """The registered names, sorted (aliases included: ``qwen25`` is ``hermes``)."""
    return registered(GROUP)


def load_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name``; ValueError naming the registered ones if there is none, or if it fails
    to load (a plugin's own bug)."""
    return load_plugin(GROUP, name, "tool-call parser", needs=("scan", "grammar", "call_id", "special_markers"),
                       see="radixserve.tool_parsers.base.ToolParser")


def resolve_tool_parser(setting: str, template: str | dict[str, str] | None) -> str | None:
    """``--tool-call-parser`` made concrete: ``auto`` the parser the chat template shows (None if it shows none),
    ``none`` None, a name itself. ``template``: the tokenizer's (a dict of named templates is read whole)."""
    if setting == "none":
        return None
    if setting != "auto":
        return setting
    return infer_tool_parser(" ".join(template.values()) if isinstance(template, dict) else template)


def infer_tool_parser(template: str | None) -> str | None:
    """The name of the parser whose every template marker ``template`` holds (the most marker text wins a tie),
    None when none does (or there is no template). Plugins take part with their own markers."""
    if not template:
        return None
    found: dict[str, int] = {}
    names = available()
    for name in names:
        try:
            parser = load_tool_parser(name)
        except ValueError:
            continue  # a broken plugin is named when someone asks for it by name
        markers = tuple(getattr(parser, "template_markers", ()))
        if markers and all(m in template for m in markers):
            canonical = getattr(parser, "name", name)  # an alias (qwen25) is named by its parser's own name
            found[canonical if canonical in names else name] = sum(map(len, markers))
    return max(sorted(found), key=found.__getitem__, default=None)
