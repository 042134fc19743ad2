"""Per-request sampling parameters (SGLang's names). Validated on construction against the ranges that hold for
every model (``InvalidRequest`` naming the field); ``check_model`` adds the ones that depend on the vocabulary.
The API and the offline Engine build the same struct, and the scheduler checks it again, so no path skips it."""
from __future__ import annotations

import json
import math
import re
from typing import Any

import msgspec

from radixserve.errors import InvalidRequest

INT32_MAX = 2**31 - 1
SEED_MODULUS = 2**63  # any integer seed is reduced into [0, 2**63): seeds are not refused
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
GREEDY_BELOW = 1e-5  # a temperature this small is greedy: dividing logits by it would overflow float32


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    max_new_tokens: int | None = None  # None: 128, clipped to what the context leaves
    temperature: float = 1.0  # 0 (or below 1e-5) = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = no limit; at most the vocabulary size
    min_p: float = 0.0
    seed: int | None = None  # the same seed, the same noise (the same tokens whatever the batch: --deterministic)
    stop: str | list[str] | None = None  # stop strings; the match is not part of the output text
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_regex: str | list[str] | None = None  # the output ends where one of these matches (cut before it)
    regex: str | None = None  # structured output: the whole output matches this regular expression
    json_schema: str | dict[str, Any] | None = None  # structured output: JSON valid under this schema
    # Sent by SGLang's clients with these defaults; other values are refused until they are implemented.
    min_new_tokens: int = 0
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    spaces_between_special_tokens: bool = True  # a slow-tokenizer option: the fast tokenizers used here ignore it
    ebnf: str | None = None

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> None:
            value = repr(getattr(self, field))
            value = value if len(value) <= 60 else value[:57] + "..."
            raise InvalidRequest(f"sampling parameter {field}={value} {why}", param=field)

        if self.max_new_tokens is not None and not 0 <= self.max_new_tokens <= INT32_MAX:
            bad("max_new_tokens", "must be >= 0 (and within the context length)")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not (0 < self.top_p <= 1):
            bad("top_p", "must be in (0, 1]")
        if not -1 <= self.top_k <= INT32_MAX:
            bad("top_k", "must be -1 or 0 (no limit), or between 1 and the vocabulary size")
        if not (0 <= self.min_p <= 1):
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None:
            self.seed %= SEED_MODULUS
        stops = self.stop_strings
        if len(stops) > MAX_STOP_STRINGS:
            bad("stop", f"has {len(stops)} stop strings; at most {MAX_STOP_STRINGS} are allowed")
        if not all(stops) or self.stop == "":
            bad("stop", "must not contain empty strings")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
            bad("stop", f"has a stop string longer than {MAX_STOP_STRING_CHARS} characters")
        ids = self.stop_token_ids or []
        if len(ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
        if ids and not 0 <= min(ids) <= max(ids) <= INT32_MAX:
            bad("stop_token_ids", "must be token ids in the vocabulary")
        patterns = self.stop_patterns_source
        if len(patterns) > MAX_STOP_STRINGS or any(len(p) > MAX_STOP_STRING_CHARS for p in patterns):
            bad("stop_regex", f"allows at most {MAX_STOP_STRINGS} patterns of at most {MAX_STOP_STRING_CHARS} "
                              "characters")
        for p in patterns:
            try:
                re.compile(p)
            except re.error as exc:
                bad("stop_regex", f"is not a valid regular expression: {exc}")
        if isinstance(self.json_schema, dict):
            self.json_schema = json.dumps(self.json_schema)
        if self.regex is not None and self.json_schema is not None:
            bad("regex", "and json_schema cannot both be given; choose one constraint")
        if (spec := self.constraint) is not None:
            from radixserve.structured import grammar

            grammar(spec[0], spec[1])  # InvalidRequest naming the field if the regex / schema is not valid
        if self.ebnf is not None:
            bad("ebnf", "grammars are not supported; constrain the output with regex or json_schema")
        if self.min_new_tokens != 0:
            bad("min_new_tokens", "is not supported yet; send 0")
        if self.n != 1:
            bad("n", "other than 1 is not supported in sampling_params yet; send the prompt n times in a list")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) != 0:
                bad(name, "is not supported yet; send 0")

    def check_model(self, vocab_size: int) -> None:
        """The ranges that depend on the model: InvalidRequest naming the field if one is out of them."""
        if self.top_k > vocab_size:
            raise InvalidRequest(f"sampling parameter top_k={self.top_k} is larger than the vocabulary "
                                 f"({vocab_size} tokens); use -1 for no limit", param="top_k")
        bad = [t for t in self.stop_token_ids or () if t >= vocab_size]
        if bad:
            raise InvalidRequest(f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                                 param="stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def stop_patterns_source(self) -> list[str]:
        if self.stop_regex is None:
            return []
        return [self.stop_regex] if isinstance(self.stop_regex, str) else list(self.stop_regex)

    @property
    def constraint(self) -> tuple[str, str] | None:
        """("regex" | "json_schema", source) when the output is constrained."""
        if self.regex is not None:
            return "regex", self.regex
        if self.json_schema is not None:
            return "json_schema", self.json_schema
        return None

    @classmethod
    def coerce(cls, value: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        """Accept a SamplingParams, a dict of its fields, or None (defaults); InvalidRequest says what is wrong."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequest(f"sampling_params must be a dict or SamplingParams, got {type(value).__name__}",
                                 param="sampling_params")
        try:
            return msgspec.convert(value, cls)
        except msgspec.ValidationError as exc:
            if isinstance(exc.__cause__, InvalidRequest):  # a range check of __post_init__: keep its field name
                raise exc.__cause__ from None
            raise InvalidRequest(f"invalid sampling_params: {exc}", param="sampling_params") from None
        except RecursionError:
            raise InvalidRequest("sampling_params is nested too deeply", param="sampling_params") from None
