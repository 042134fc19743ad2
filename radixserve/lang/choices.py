"""select: score each choice by the model's log-probabilities of its tokens after the prompt, and pick one.

Two calls, both prefill only (nothing is generated):

    1. the prompt alone         -> prompt_tokens P, and the prompt's KV lands in the radix cache
    2. [prompt + c for c in choices], logprobs from position P-1
                                -> every choice re-uses the cached prompt; only its own tokens are computed

Scores start at P-1, not P, because the prompt's last token may merge with a choice's first characters when they
are tokenized together ("token healing"). When it did not merge, that first token is still the prompt's tail and
is dropped from the scores.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from radixserve.lang.backend import Backend, BackendError
from radixserve.lang.sampling import prefill_payload


class ChoicesMethod(Protocol):
    def __call__(self, logprobs: list[list[float]]) -> int:
        """Given each choice's token logprobs (in order), return the index of the chosen one."""
        ...


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else -math.inf


@dataclass(frozen=True, slots=True)
class TokenLengthNormalized:
    """The highest mean logprob per token: long choices are not penalised for having more tokens."""

    def __call__(self, logprobs: list[list[float]]) -> int:
        scores = [_mean(lp) for lp in logprobs]
        return scores.index(max(scores))


@dataclass(frozen=True, slots=True)
class GreedyTokenSelection:
    """Compare choices token by token, keeping those with the best logprob at each position until one is left.

    A choice that has run out of tokens competes with its own mean, so a prefix of a longer choice can still win.
    """

    def __call__(self, logprobs: list[list[float]]) -> int:
        width = max(len(lp) for lp in logprobs)
        padded = [lp + [_mean(lp)] * (width - len(lp)) for lp in logprobs]
        remaining = list(range(len(logprobs)))
        for pos in range(width):
            best = max(padded[i][pos] for i in remaining)
            remaining = [i for i in remaining if padded[i][pos] == best]
            if len(remaining) == 1:
                break
        return remaining[0]


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()


def select_choice(backend: Backend, text: str, choices: tuple[str, ...],
                  method: ChoicesMethod) -> tuple[str, dict[str, Any]]:
    """Run the two calls above; return the chosen string and its meta_info."""
    prompt = backend.generate(prefill_payload(text))
    if not isinstance(prompt, dict):
        raise BackendError(f"a prefill for one text returned {type(prompt).__name__}, expected one result")
    prompt_tokens = int(prompt["meta_info"]["prompt_tokens"])
    scored = backend.generate({
        "text": [text + c for c in choices],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "logprob_start_len": max(prompt_tokens - 1, 0),
        "stream": False,
    })
    if not isinstance(scored, list) or len(scored) != len(choices):
        raise BackendError(f"scoring {len(choices)} choices returned {type(scored).__name__} "
                           f"of {len(scored) if isinstance(scored, list) else 1}, expected one result per choice")
    kept = [_choice_tokens(text, r["meta_info"]["input_token_logprobs"]) for r in scored]
    values = [[t[0] for t in tokens if t[0] is not None] for tokens in kept]
    index = method(values)
    meta = {"normalized_prompt_logprobs": [_mean(v) for v in values], "input_token_logprobs": kept,
            "prompt_tokens": prompt_tokens}
    return choices[index], meta


def _choice_tokens(text: str, triples: list[list[Any]]) -> list[list[Any]]:
    """The triples that belong to the choice: drop the first one if it is still the prompt's own last token."""
    if triples and text:
        first_text = triples[0][2] if len(triples[0]) > 2 else None
        if first_text is not None and text.endswith(first_text):
            return list(triples[1:])
    return list(triples)
