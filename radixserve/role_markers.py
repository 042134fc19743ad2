"""ChatTemplate: how a chat model marks each role's turn, as plain (prefix, suffix) strings per role.

The frontend builds prompts by appending text, so it needs the template as markers it can append, not as a Jinja
program. ``from_tokenizer`` derives those markers from a tokenizer's own template; the server sends them to the
frontend through ``/get_model_info`` as ``to_dict()``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """``roles[role] = (prefix, suffix)``: a turn renders as ``prefix + content + suffix``.

    ``default_system_prompt`` is inserted as the first turn when a conversation does not start with a system
    message (None: nothing is inserted; "" still inserts the system markers, as some templates do).
    ``stop_str`` ends an assistant turn: a ``gen`` inside the assistant role stops at any of them.
    """

    roles: dict[str, tuple[str, str]]
    default_system_prompt: str | None = None
    stop_str: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        missing = [r for r in ROLES if r not in self.roles]
        if missing:
            raise ValueError(f"a ChatTemplate needs markers for the roles {ROLES}; missing {missing}")
        for role, pair in self.roles.items():
            if len(pair) != 2 or not all(isinstance(p, str) for p in pair):
                raise ValueError(f"roles[{role!r}] must be a (prefix, suffix) pair of strings, got {pair!r}")
        # frozen: normalise the containers once so equality and to_dict() do not depend on list/tuple choices
        object.__setattr__(self, "roles", {r: (p[0], p[1]) for r, p in self.roles.items()})
        object.__setattr__(self, "stop_str", tuple(self.stop_str))

    def prefix(self, role: str) -> str:
        return self._pair(role)[0]

    def suffix(self, role: str) -> str:
        return self._pair(role)[1]

    def _pair(self, role: str) -> tuple[str, str]:
        if role not in self.roles:
            raise ValueError(f"this chat template has no role {role!r}; it knows {sorted(self.roles)}")
        return self.roles[role]

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt for OpenAI-style messages, with the default system prompt inserted as the frontend does."""
        text = ""
        if messages and messages[0]["role"] != "system" and self.default_system_prompt is not None:
            text += self.prefix("system") + self.default_system_prompt + self.suffix("system")
        for m in messages:
            text += self.prefix(m["role"]) + m["content"] + self.suffix(m["role"])
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"roles": {r: [p, s] for r, (p, s) in self.roles.items()},
                "default_system_prompt": self.default_system_prompt, "stop_str": list(self.stop_str)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChatTemplate:
        if not isinstance(d, dict) or not isinstance(d.get("roles"), dict):
            raise TypeError(f"a chat template dict needs a 'roles' mapping of role -> [prefix, suffix]; got {d!r}")
        return cls(roles={r: tuple(v) for r, v in d["roles"].items()},
                   default_system_prompt=d.get("default_system_prompt"), stop_str=tuple(d.get("stop_str") or ()))

    @classmethod
    def by_name(cls, name: str) -> ChatTemplate:
        """A built-in template: "chatml", "llama-3-instruct" or "default" (plain ``USER: ...`` lines)."""
        builtins = _builtins()
        if name not in builtins:
            raise ValueError(f"unknown chat template {name!r}; the built-ins are {sorted(builtins)} "
                             "(or let the server describe its model's template)")
        return builtins[name]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ChatTemplate | None:
        """Derive the markers from a Hugging Face tokenizer's own chat template (not from the model's name).

        None when the tokenizer has no chat template, or its template cannot be written as per-role markers.
        """
        from radixserve.marker_probe import derive_template

        return derive_template(tokenizer)


def _builtins() -> dict[str, ChatTemplate]:
    # built fresh on each call: templates hold dicts, and a shared registry would be module-level mutable state
    chatml = {r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ROLES}
    llama3 = {r: (f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>") for r in ROLES}
    plain = {"system": ("SYSTEM: ", "\n"), "user": ("USER: ", "\n"), "assistant": ("ASSISTANT: ", "\n")}
    return {
        "chatml": ChatTemplate(chatml, None, ("<|im_end|>",)),
        "llama-3-instruct": ChatTemplate(llama3, None, ("<|eot_id|>",)),
        "default": ChatTemplate(plain, None, ()),
    }
