"""Transcript: the text a program has built so far and the chat turns in it.

The one place the chat rules live (role markers, the default system turn, which role is open), shared by the real
executor and by run_batch's prefix probe, so both produce exactly the same text.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.role_markers import ChatTemplate


@dataclass(slots=True)
class Transcript:
    """``text[role_start:]`` is the open turn's content so far (only meaningful while ``role`` is not None)."""

    template: ChatTemplate
    text: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)
    role: str | None = None
    role_start: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.role_start <= len(self.text):
            raise ValueError(f"role_start {self.role_start} is outside the text ({len(self.text)} characters)")

    def copy(self) -> Transcript:
        return Transcript(self.template, self.text, list(self.messages), self.role, self.role_start)

    def fill(self, value: str) -> None:
        self.text += value

    def begin(self, role: str) -> None:
        if self.role is not None:
            raise ValueError(f"cannot open a {role!r} turn inside the open {self.role!r} turn; roles do not nest "
                             f"(close it first, e.g. with sgl.{self.role}_end())")
        # like SGLang: a conversation that does not start with a system turn gets the template's default one
        default = self.template.default_system_prompt
        if not self.messages and role != "system" and default is not None:
            self.begin("system")
            self.fill(default)
            self.end("system")
        self.fill(self.template.prefix(role))
        self.role, self.role_start = role, len(self.text)

    def end(self, role: str) -> None:
        if self.role != role:
            raise ValueError(f"sgl.{role}_end() but the open turn is {self.role!r}; every *_begin needs its own *_end")
        content = self.text[self.role_start:].lstrip()
        self.fill(self.template.suffix(role))
        self.messages.append({"role": role, "content": content})
        self.role = None

    @property
    def in_assistant(self) -> bool:
        return self.role == "assistant"
