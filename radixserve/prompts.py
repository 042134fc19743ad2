"""The shapes a prompt may take, checked in one place for every caller (the OpenAI routes, SGLang's /generate
and the offline Engine): a string, a list of strings, a list of token ids, or a list of token-id lists."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from radixserve.errors import InvalidRequest

Prompt = str | list[int]
Kind = Literal["text", "ids", "any"]
TOKEN_ID_LIMIT = 2**31  # without a vocabulary at hand: what fits the int32 arrays the actors exchange

_SHAPES = {"text": "a non-empty string or a non-empty list of non-empty strings",
           "ids": "a non-empty list of token ids or a non-empty list of such lists",
           "any": "a non-empty string, list of strings, list of token ids, or list of token-id lists"}


@dataclass(frozen=True)
class Prompts:
    items: list[Prompt]
    single: bool  # the caller sent one prompt, not a list: it gets one result back, not a list


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_prompts(value: Any, param: str, kind: Kind = "any", vocab_size: int | None = None) -> Prompts:
    """``value`` as a batch of prompts; InvalidRequest naming ``param`` if it has another shape, an empty prompt,
    or a token id outside the vocabulary (``vocab_size``; without one, outside int32)."""
    if isinstance(value, str) and kind != "ids":
        items, single = [value], True
    elif isinstance(value, list) and value and kind != "text" and all(map(_is_id, value)):
        items, single = [value], True
    elif isinstance(value, list) and value and kind != "ids" and all(isinstance(x, str) for x in value):
        items, single = list(value), False
    elif (isinstance(value, list) and value and kind != "text"
          and all(isinstance(x, list) and x and all(map(_is_id, x)) for x in value)):
        items, single = list(value), False
    else:
        raise InvalidRequest(f"{param} must be {_SHAPES[kind]}", param=param)
    if any(isinstance(p, str) and not p for p in items):
        raise InvalidRequest(f"{param} must not contain an empty prompt", param=param)
    limit = TOKEN_ID_LIMIT if vocab_size is None else vocab_size
    for p in items:
        if isinstance(p, list) and not 0 <= min(p) <= max(p) < limit:
            bad = next(t for t in p if not 0 <= t < limit)
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {limit})", param=param)
    return Prompts(items, single)


def text_or_ids(text: Any, input_ids: Any, vocab_size: int | None = None, text_param: str = "text",
                ids_param: str = "input_ids") -> Prompts:
    """SGLang's pair of fields: exactly one of ``text`` and ``input_ids``."""
    if (text is None) == (input_ids is None):
        raise InvalidRequest(f"give exactly one of {text_param} or {ids_param}", param=text_param)
    if text is not None:
        return parse_prompts(text, text_param, "text", vocab_size)
    return parse_prompts(input_ids, ids_param, "ids", vocab_size)
