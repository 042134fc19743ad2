"""Derive a ChatTemplate's markers from a Hugging Face tokenizer by rendering sentinel conversations.

Each role's markers are what a render gains around that role's sentinel content:

    render([sys])            = bos? + sys_prefix + SYS + sys_suffix
    render([sys, user])      = render([sys])       + user_prefix + USER + user_suffix
    render([sys, user, asst])= render([sys, user]) + asst_prefix + ASST + asst_suffix
    render([user])           = bos? + (default system turn)? + user_prefix + USER + user_suffix

Templates that refuse a system role get the user role's markers for it (system text becomes a user turn).
"""
from __future__ import annotations

import re
from typing import Any

from radixserve.role_markers import ChatTemplate

SYS, USER, ASST = "SENTINELSYSTEM7d1c", "SENTINELUSER7d1c", "SENTINELASSISTANT7d1c"
# fallback for templates whose markers are not registered as special tokens
_SPECIAL_LOOKING = re.compile(r"<\|[^|<>\s]+\|>|</s>|<end_of_turn>|<eos>")


class _Unsupported(Exception):
    """The template cannot be expressed as per-role (prefix, suffix) markers."""


def derive_template(tok: Any) -> ChatTemplate | None:
    if not getattr(tok, "chat_template", None):
        return None
    for derive in (_with_system, _without_system):
        for bos in _bos_candidates(tok):
            try:
                return derive(tok, bos)
            except _Unsupported:
                continue
    return None


def _render(tok: Any, messages: list[dict[str, str]]) -> str:
    try:
        out = tok.apply_chat_template(messages, tokenize=False)
    except Exception as exc:  # jinja raise_exception(...) surfaces as TemplateError; any refusal means "unsupported"
        raise _Unsupported(str(exc)) from exc
    if not isinstance(out, str):
        raise _Unsupported(f"apply_chat_template returned {type(out).__name__}, not text")
    return out


def _bos_candidates(tok: Any) -> list[str]:
    """Which leading BOS text to leave out of the markers ("" = none), in the order to try.

    A tokenizer that adds BOS when it encodes gets it back on the server, so its template's BOS is dropped. Else
    the BOS may be a real marker (SmolLM2's bos_token is <|im_start|>), so it is kept unless that fails; a BOS
    dropped then is lost, as the frontend's markers cannot say "only at the very start".
    """
    bos, bos_id = getattr(tok, "bos_token", None), getattr(tok, "bos_token_id", None)
    if not isinstance(bos, str) or not bos:
        return [""]
    ids = tok("a").input_ids if bos_id is not None else []
    return [bos] if ids and ids[0] == bos_id else ["", bos]


def _split(text: str, sentinel: str) -> tuple[str, str]:
    if text.count(sentinel) != 1:
        raise _Unsupported(f"the sentinel appears {text.count(sentinel)} times in the render")
    head, tail = text.split(sentinel)
    return head, tail


def _after(longer: str, shorter: str) -> str:
    if not longer.startswith(shorter):
        raise _Unsupported("adding a turn rewrote the earlier turns")
    return longer[len(shorter):]


def _strip_bos(text: str, bos: str) -> str:
    return text[len(bos):] if bos and text.startswith(bos) else text


def _msgs(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": r, "content": c} for r, c in pairs]


def _with_system(tok: Any, bos: str) -> ChatTemplate:
    r1 = _render(tok, _msgs(("system", SYS)))
    r2 = _render(tok, _msgs(("system", SYS), ("user", USER)))
    r3 = _render(tok, _msgs(("system", SYS), ("user", USER), ("assistant", ASST)))
    system = _split(_strip_bos(r1, bos), SYS)
    user = _split(_after(r2, r1), USER)
    assistant = _split(_after(r3, r2), ASST)
    default = _default_system(tok, bos, system, user)
    return ChatTemplate({"system": system, "user": user, "assistant": assistant}, default,
                        _stop_str(tok, assistant[1]))


def _default_system(tok: Any, bos: str, system: tuple[str, str], user: tuple[str, str]) -> str | None:
    """The system text a template injects when the conversation starts with a user turn (None: it injects none)."""
    head, _ = _split(_strip_bos(_render(tok, _msgs(("user", USER))), bos), USER)
    if head == user[0]:
        return None
    sys_prefix, tail = system[0], system[1] + user[0]
    if head.startswith(sys_prefix) and head.endswith(tail) and len(head) >= len(sys_prefix) + len(tail):
        return head[len(sys_prefix): len(head) - len(tail)]
    raise _Unsupported("a conversation that starts with a user turn renders something other than a system turn")


def _without_system(tok: Any, bos: str) -> ChatTemplate:
    r1 = _render(tok, _msgs(("user", USER)))
    r2 = _render(tok, _msgs(("user", USER), ("assistant", ASST)))
    user = _split(_strip_bos(r1, bos), USER)
    assistant = _split(_after(r2, r1), ASST)
    return ChatTemplate({"system": user, "user": user, "assistant": assistant}, None, _stop_str(tok, assistant[1]))


def _stop_str(tok: Any, assistant_suffix: str) -> tuple[str, ...]:
    """The first special-looking marker in the assistant suffix: where the model ends its turn."""
    specials = {t for t in getattr(tok, "all_special_tokens", []) or [] if t}
    for added in (getattr(tok, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False) and added.content:
            specials.add(added.content)
    hits = [(assistant_suffix.find(t), -len(t), t) for t in specials if t in assistant_suffix]
    hits += [(m.start(), -len(m.group()), m.group()) for m in _SPECIAL_LOOKING.finditer(assistant_suffix)]
    if not hits:
        return ()
    return (min(hits)[2],)
