"""Structured output: a request's ``regex`` or ``json_schema`` as an llguidance grammar, checked where the request
arrives (no tokenizer needed, so the HTTP process answers a bad one with a 400 naming it) and compiled against the
tokenizer in the runner (``radixserve.model.grammar``).

Why llguidance (measured here, SmolLM2's 49k vocabulary, 2 cores; see README): a 7.7 MB wheel with no Python
dependencies that imports in 41 ms without torch; it validates a grammar without a tokenizer and says what is
wrong in a readable line; compiles in about 1 ms; fill + apply + advance about 160 us per constrained row.

JSON is compact by default (no free whitespace between tokens): a small model given free whitespace can spend
its whole budget on spaces. A schema may allow it with ``"x-guidance": {"whitespace_flexible": true}``.
"""
from __future__ import annotations

import json
from typing import Literal

from radixserve.errors import InvalidRequest

Kind = Literal["regex", "json_schema"]


def grammar(kind: Kind, source: str) -> str:
    """The llguidance grammar (its JSON) for a regex or a JSON schema. InvalidRequest naming the field if the
    source is not a valid one."""
    from llguidance import LLMatcher  # lazily: only requests that ask for structure pay the import

    if kind == "regex":
        compiled = LLMatcher.grammar_from_regex(source)
    else:
        try:
            schema = json.loads(source)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise InvalidRequest(f"json_schema is not valid JSON: {exc}", param="json_schema") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest("json_schema must be a JSON object (a schema)", param="json_schema")
        if isinstance(schema, dict):
            guidance = schema.setdefault("x-guidance", {})
            if isinstance(guidance, dict):
                guidance.setdefault("whitespace_flexible", False)
        compiled = LLMatcher.grammar_from_json_schema(schema)
    error = LLMatcher.validate_grammar(compiled)
    if error:
        raise InvalidRequest(f"invalid {kind}: {_first_reason(error)}", param=kind)
    return compiled


def _first_reason(error: str) -> str:
    """llguidance's message spans several lines (a caret drawing); keep the lines that say what is wrong."""
    lines = [ln.strip() for ln in error.splitlines() if ln.strip()]
    reasons = [ln for ln in lines if ln.startswith("error:")]
    head = lines[0] if lines else error
    text = f"{head} ({reasons[0]})" if reasons and reasons[0] not in head else head
    return text if len(text) <= 300 else text[:297] + "..."
