"""Per-request sampling parameters (SGLang's names). Validated on construction against the ranges that hold for
every model (``InvalidRequest`` naming the field); ``check_model`` adds the ones that depend on the vocabulary.
The API and the offline Engine build the same struct, and the scheduler checks it again, so no path skips it."""
from __future__ import annotations

import json
import math
from typing import Any

import msgspec

from radixserve.errors import InvalidRequest

INT32_MAX = 2**31 - 1
SEED_MODULUS = 2**63  # any integer seed is reduced into [0, 2**63): seeds are not refused
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries of logit_bias (OpenAI allows 300)
PENALTY_RANGE = 2.0  # frequency / presence penalties lie in [-2, 2] (OpenAI's range)
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
    # Penalties count the request's own output tokens (not the prompt's), as SGLang's do.
    frequency_penalty: float = 0.0  # subtracted once per time the token appeared: [-2, 2]
    presence_penalty: float = 0.0  # subtracted once if the token appeared: [-2, 2]
    repetition_penalty: float = 1.0  # a token that appeared: logit / p if positive, logit * p if not: (0, 2]
    min_new_tokens: int = 0  # EOS, stop_token_ids and stop strings cannot end the output before this many tokens
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> added to its logit
    # a named logit processor the server enables (--logit-processors) and its parameters (logit_processors.py)
    custom_logit_processor: str | None = None
    custom_params: dict[str, Any] | None = None
    n: int = 1  # choices per prompt (prompt-major in the results); a seeded request's choice j gets seed + j
    spaces_between_special_tokens: bool = True  # a slow-tokenizer option: the fast tokenizers used here ignore it
    ebnf: str | None = None  # structured output: the whole output is a sentence of this GBNF (or Lark) grammar

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
        if patterns:
            from radixserve.stop_regex import check

            check(patterns)  # InvalidRequest naming stop_regex if RE2 refuses a pattern (a backreference, lookaround)
        if isinstance(self.json_schema, dict):
            self.json_schema = json.dumps(self.json_schema)
        given = [name for name in ("regex", "json_schema", "ebnf") if getattr(self, name) is not None]
        if len(given) > 1:
            bad(given[0], f"and {' and '.join(given[1:])} cannot both be given; choose one constraint")
        if (spec := self.constraint) is not None:
            from radixserve.structured import grammar

            grammar(spec[0], spec[1])  # InvalidRequest naming the field if the regex / schema / grammar is not valid
        for name in ("frequency_penalty", "presence_penalty"):
            if not (math.isfinite(getattr(self, name)) and abs(getattr(self, name)) <= PENALTY_RANGE):
                bad(name, f"must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}]")
        if not 0 < self.repetition_penalty <= 2:
            bad("repetition_penalty", "must be in (0, 2] (1 means none)")
        if not 0 <= self.min_new_tokens <= INT32_MAX:
            bad("min_new_tokens", "must be >= 0")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            bad("min_new_tokens", f"must not exceed max_new_tokens={self.max_new_tokens}")
        if not 1 <= self.n <= INT32_MAX:
            bad("n", "must be >= 1")
        if self.logit_bias is not None:
            self._check_logit_bias(bad)
        self._check_processor(bad)

    def _check_logit_bias(self, bad) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad("logit_bias", f"has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
        for key, value in self.logit_bias.items():
            if not key.strip().isdigit():
                bad("logit_bias", f"has the key {key!r}; keys are token ids (\"1234\")")
            if not (math.isfinite(value) and -100 <= value <= 100):
                bad("logit_bias", f"gives token {key} the bias {value}; biases lie in [-100, 100]")

    def _check_processor(self, bad) -> None:
        from radixserve.logit_processors import MAX_PARAMS_BYTES, check_name

        if self.custom_logit_processor is not None:
            check_name(self.custom_logit_processor)  # InvalidRequest: not a name (SGLang's serialized code, say)
        if self.custom_params is not None:
            try:
                size = len(msgspec.json.encode(self.custom_params))
            except (TypeError, msgspec.EncodeError):
                bad("custom_params", "must hold JSON values only (numbers, strings, booleans, null, lists, objects)")
            if size > MAX_PARAMS_BYTES:
                bad("custom_params", f"takes {size} bytes as JSON; at most {MAX_PARAMS_BYTES} are allowed")

    def check_model(self, vocab_size: int) -> None:
        """The ranges that depend on the model: InvalidRequest naming the field if one is out of them."""
        if self.top_k > vocab_size:
            raise InvalidRequest(f"sampling parameter top_k={self.top_k} is larger than the vocabulary "
                                 f"({vocab_size} tokens); use -1 for no limit", param="top_k")
        bad = [t for t in self.stop_token_ids or () if t >= vocab_size]
        if bad:
            raise InvalidRequest(f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                                 param="stop_token_ids")
        bad = [t for t in self.bias_ids if t >= vocab_size]
        if bad:
            raise InvalidRequest(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                                 param="logit_bias")

    def choice(self, j: int) -> SamplingParams:
        """Choice ``j`` of the ``n`` this asks for, as one sequence: n 1, and seed + j if seeded (reproducible,
        yet the choices differ)."""
        if self.n == 1 and j == 0:
            return self
        seed = None if self.seed is None else (self.seed + j) % SEED_MODULUS
        return msgspec.structs.replace(self, n=1, seed=seed)

    @property
    def penalized(self) -> bool:
        """Do the logits need adjusting before this request samples (penalties, min_new_tokens, logit_bias)?"""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1
                    or self.min_new_tokens or self.logit_bias)

    @property
    def bias_ids(self) -> list[int]:
        return [int(k) for k in self.logit_bias or ()]

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
        """("regex" | "json_schema" | "ebnf", source) when the output is constrained."""
        if self.regex is not None:
            return "regex", self.regex
        if self.json_schema is not None:
            return "json_schema", self.json_schema
        if self.ebnf is not None:
            return "ebnf", self.ebnf
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
