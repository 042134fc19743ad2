"""Per-request sampling parameters (SGLang's names). Validated on construction; bad values raise ValueError."""
from __future__ import annotations

import math
from typing import Any

import msgspec


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    max_new_tokens: int | None = None  # None: 128, clipped to what the context leaves
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = no limit
    min_p: float = 0.0
    seed: int | None = None  # per-request: the same seed gives the same tokens, whatever the batch
    stop: str | list[str] | None = None  # stop strings; the match is not part of the output text
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> None:
            raise ValueError(f"sampling parameter {field}={getattr(self, field)!r} {why}")

        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            bad("max_new_tokens", "must be >= 0")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not (0 < self.top_p <= 1):
            bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            bad("top_k", "must be -1 (no limit) or >= 1")
        if not (0 <= self.min_p <= 1):
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            bad("seed", "must be in [0, 2**63)")
        if isinstance(self.stop, list) and not all(self.stop):
            bad("stop", "must not contain empty strings")
        if self.stop == "":
            bad("stop", "must not be an empty string")
        if self.stop_token_ids and min(self.stop_token_ids) < 0:
            bad("stop_token_ids", "must be token ids >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @classmethod
    def coerce(cls, value: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        """Accept a SamplingParams, a dict of its fields, or None (defaults); ValueError says what is wrong."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"sampling_params must be a dict or SamplingParams, got {type(value).__name__}")
        try:
            return msgspec.convert(value, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid sampling_params: {exc}") from None
