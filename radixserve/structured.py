"""Structured output: a request's ``regex``, ``json_schema`` or ``ebnf`` as an llguidance grammar, checked where
the request arrives (no tokenizer needed, so the HTTP process answers a bad one with a 400 naming it) and compiled
against the tokenizer in the runner (``radixserve.model.grammar``).

Why llguidance (benchmarks/grammar_libraries.py compares it with the alternatives): a small wheel with no Python
dependencies that imports quickly without torch; it validates a grammar without a tokenizer and says what is
wrong in a readable line; it compiles a grammar and masks a constrained row in a small part of a decode step.

JSON is compact by default (no free whitespace between tokens): a small model given free whitespace can spend
its whole budget on spaces. A schema may allow it with ``"x-guidance": {"whitespace_flexible": true}``.

llguidance's regex engine is derivative-based (a lazily built automaton: no backtracking), but a pattern's
automaton can still blow up: nested counted repetitions such as ``(a{500}){500}`` took 1-2 s per mask under its
default limits before failing, or 0.2 s per step without failing. Here the lexer gets less fuel (``limits``), and
each pattern is run a few bytes at validation (``_probe``), so such a pattern is a 400 naming its field.

``ebnf`` is SGLang's GBNF-style grammar (``root ::= ...``, llama.cpp's syntax), converted to llguidance's Lark by
llguidance's own converter; a grammar already in Lark (a ``start:`` rule, or ``%llguidance``) is taken as it is.
In every case tried, llguidance built the automata of all of a grammar's terminals on its first byte, so running the
whole grammar a few bytes finds an outgrown terminal wherever it sits.
"""
from __future__ import annotations

import json
from typing import Literal

from radixserve.errors import InvalidRequest

Kind = Literal["regex", "json_schema", "ebnf"]
# llguidance's default is 1,000,000. At 100,000 a nested counted repetition fails far sooner, and a large schema
# (200 patterns, formats and enums) still runs.
INITIAL_LEXER_FUEL = 100_000
PROBE_BYTES = 4  # bytes a pattern is run at validation: the blow-ups seen happen on the first one or two


def limits():
    """The llguidance limits every matcher here runs under (validation's, and the runner's)."""
    from llguidance import LLParserLimits

    return LLParserLimits(initial_lexer_fuel=INITIAL_LEXER_FUEL)


def grammar(kind: Kind, source: str) -> str:
    """The llguidance grammar (its JSON) for a regex, a JSON schema or an EBNF grammar. InvalidRequest naming the
    field if the source is not a valid one."""
    from llguidance import LLMatcher  # lazily: only requests that ask for structure pay the import

    schema = None
    if kind == "regex":
        compiled = LLMatcher.grammar_from_regex(source)
    elif kind == "ebnf":
        compiled = LLMatcher.grammar_from_lark(_lark(source))
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
    error = LLMatcher.validate_grammar(compiled, limits=limits())
    if error:
        raise InvalidRequest(f"invalid {kind}: {_first_reason(error)}", param=kind)
    # what runs a few bytes: a regex or an EBNF grammar whole, each pattern of a schema alone (the schema's own
    # structure is bounded; a pattern in it is where an automaton can blow up)
    probes = {None: compiled} if kind != "json_schema" else \
        {p: LLMatcher.grammar_from_regex(p) for p in _schema_patterns(schema)}
    for pattern, probe in probes.items():
        if (error := _probe(probe)) is not None:
            where = f" (its pattern {pattern[:60]!r})" if pattern is not None else ""
            raise InvalidRequest(f"{kind}{where} is too complex to match: {_first_reason(error)}; use fewer or "
                                 "smaller nested repetitions", param=kind)
    return compiled


def _lark(source: str) -> str:
    """An ``ebnf`` grammar in llguidance's Lark: GBNF converted (``root`` becomes ``start``), Lark as it is."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(source)
    except Exception as exc:  # the converter raises plain Exceptions naming the rule and the position
        raise InvalidRequest(f"invalid ebnf: {str(exc)[:300]}", param="ebnf") from None


def _schema_patterns(schema: object) -> list[str]:
    """Every distinct regex in a JSON schema: ``pattern`` values and ``patternProperties`` keys."""
    found: dict[str, None] = {}
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found[node["pattern"]] = None
            if isinstance(node.get("patternProperties"), dict):
                found.update(dict.fromkeys(node["patternProperties"]))
            stack.extend(node.values())
    return list(found)


def _probe(compiled: str) -> str | None:
    """llguidance's lexer error if a grammar's automaton outgrows ``limits`` on its first bytes (taking the first
    byte allowed each time, on a vocabulary of single bytes), else None."""
    from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

    matcher = LLMatcher(LLTokenizer(TokenizerWrapper(_Bytes()), slices=[]), compiled, log_level=0, limits=limits())
    for _ in range(PROBE_BYTES):
        mask = matcher.compute_bitmask()
        allowed = next((b for b in range(256) if mask[b >> 3] >> (b & 7) & 1), None)
        if matcher.is_error() or allowed is None or not matcher.consume_token(allowed):
            break
    error = matcher.get_error()
    # only the lexer's limits count here: any other error (a construct only JSON schema's compiler takes) is not ours
    return error if "lexer error" in error else None


class _Bytes:
    """A vocabulary of the 256 bytes and an end, as llguidance's TokenizerWrapper reads one."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<end>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def _first_reason(error: str) -> str:
    """llguidance's message spans several lines (a caret drawing); keep the lines that say what is wrong."""
    lines = [ln.strip() for ln in error.splitlines() if ln.strip()]
    reasons = [ln for ln in lines if ln.startswith("error:")]
    head = lines[0] if lines else error
    text = f"{head} ({reasons[0]})" if reasons and reasons[0] not in head else head
    return text if len(text) <= 300 else text[:297] + "..."
