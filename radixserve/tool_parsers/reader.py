"""One output read through a tool-call parser as it grows: content to show and calls, each handed out once.

Whole or streamed, the same text gives the same content and the same calls: ``read`` is ``feed`` of everything
with ``final``. Content that is only whitespace next to calls (the newline between two ``<tool_call>`` blocks) is
not content: a stream holds trailing whitespace back until more content follows, and drops it at the end if the
output made calls; read whole, such an output's content is right-stripped (None if nothing is left).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.tool_parsers.base import ToolCall, ToolParser


@dataclass(slots=True)
class Reader:
    parser: ToolParser
    names: frozenset[str]  # the functions the request offers
    text: str = ""
    at: int = 0  # text[:at] is settled (handed out, or held whitespace)
    spaces: str = ""  # settled content that is only whitespace so far, not handed out yet
    calls: list[ToolCall] = field(default_factory=list)  # every call handed out

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """Add ``delta`` (``final``: the output ended) and return the content and the calls that became final."""
        self.text += delta
        scan = self.parser.scan(self.text, self.at, self.names, final)
        if not (self.at <= scan.consumed <= len(self.text)) or (final and scan.consumed != len(self.text)):
            raise ValueError(f"tool-call parser {self.parser.name!r} settled text up to {scan.consumed} of "
                             f"{len(self.text)} (from {self.at}, final={final})")
        self.at = scan.consumed
        content, calls = "", []
        for piece in scan.pieces:
            if isinstance(piece, ToolCall):
                calls.append(piece)
            else:
                content += piece
        self.calls.extend(calls)
        content = self.spaces + content
        kept = content.rstrip()
        self.spaces = content[len(kept):]
        if final and not self.calls:
            kept, self.spaces = kept + self.spaces, ""
        return kept, calls

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output: its content (None when it made calls and has no other text) and its calls."""
        content, calls = self.feed(text, final=True)
        return (content or None) if calls else content, calls
