"""Sampling parameters: the run-wide defaults, one gen's overrides, and SGLang's /generate body they make.

A gen's non-None values override the defaults given to ``run(...)``; the result becomes SGLang's /generate payload.
Optional features (penalties, regex, logprobs) are sent only when used, so a server that does not know one of
them still serves every program that does not use it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

# dtype -> the regex the server constrains decoding with (int/float also stop at the first space or newline)
DTYPE_REGEX = {
    "int": r"[-+]?[0-9]+[ \n]*",
    "float": r"[-+]?[0-9]*\.?[0-9]+[ \n]*",
    "str": r"\"[\w\d\s]*\"",
    "bool": r"(True|False)",
}
DTYPE_STOPS = {"int": (" ", "\n"), "float": (" ", "\n")}
LOGPROB_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")


def _stops(stop: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...] | None:
    if stop is None:
        return None
    return (stop,) if isinstance(stop, str) else tuple(stop)


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """The sampling keywords of ``run``/``run_batch``; every gen starts from these."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> SamplingDefaults:
        """Build from keyword arguments; a name that is not a sampling parameter is a TypeError naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown sampling parameter(s) {unknown}; the known ones are {sorted(known)}")
        values = {k: v for k, v in kwargs.items() if v is not None}  # None: keep the default
        if "stop" in values:
            values["stop"] = _stops(values["stop"])
        if "stop_token_ids" in values:
            values["stop_token_ids"] = tuple(values["stop_token_ids"])
        return cls(**values)


@dataclass(frozen=True, slots=True)
class GenParams:
    """One gen's overrides (None: use the run's default). ``dtype`` is a name: "int", "float", "str", "bool"."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: str | None = None
    regex: str | None = None
    json_schema: str | None = None

    @classmethod
    def build(cls, *, stop: Any = None, stop_token_ids: Any = None, dtype: Any = None,
              json_schema: str | dict[str, Any] | None = None, **kwargs: Any) -> GenParams:
        """Normalise what users pass to ``gen``: a str stop, a dtype given as a type, a json_schema dict."""
        if isinstance(json_schema, dict):
            json_schema = json.dumps(json_schema)
        return cls(stop=_stops(stop), stop_token_ids=None if stop_token_ids is None else tuple(stop_token_ids),
                   dtype=dtype_name(dtype), json_schema=json_schema, **kwargs)


def dtype_name(dtype: type | str | None) -> str | None:
    if dtype is None:
        return None
    name = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", repr(dtype))
    if name not in DTYPE_REGEX:
        raise ValueError(f"gen(dtype={dtype!r}) is not supported; use one of int, float, str, bool")
    return name


def _dedupe(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def build_payload(text: str, defaults: SamplingDefaults, gen: GenParams, extra_stop: tuple[str, ...] = (),
                  stream: bool = False) -> dict[str, Any]:
    """The native /generate body for one gen at the end of ``text``; ``extra_stop`` is the chat turn's end."""
    def pick(name: str) -> Any:
        value = getattr(gen, name)
        return getattr(defaults, name) if value is None else value

    stop = list(pick("stop"))
    regex = gen.regex
    if gen.dtype is not None:  # like SGLang, the dtype's regex replaces an explicit one
        regex = DTYPE_REGEX[gen.dtype]
        stop += DTYPE_STOPS.get(gen.dtype, ())
    stop = _dedupe(stop + list(extra_stop))
    sp: dict[str, Any] = {name: pick(name) for name in ("max_new_tokens", "temperature", "top_p", "top_k", "min_p")}
    optional = {
        "min_new_tokens": gen.min_new_tokens,
        "stop": stop or None,
        "stop_token_ids": list(pick("stop_token_ids")) or None,
        "ignore_eos": pick("ignore_eos") or None,
        "frequency_penalty": pick("frequency_penalty") or None,
        "presence_penalty": pick("presence_penalty") or None,
        "regex": regex,
        "json_schema": gen.json_schema,
    }
    sp.update({k: v for k, v in optional.items() if v is not None})
    # n samples: the prompt n times in a list (every server takes that; not all take sampling_params.n)
    n = gen.n or 1
    payload: dict[str, Any] = {"text": [text] * n if n > 1 else text, "sampling_params": sp}
    for name in LOGPROB_FIELDS:
        if pick(name) is not None:
            payload[name] = pick(name)
    payload["stream"] = stream
    return payload


def prefill_payload(text: str | list[str]) -> dict[str, Any]:
    """Compute and cache the prompt's KV without generating: how a shared prefix gets into the radix cache."""
    return {"text": text, "sampling_params": {"max_new_tokens": 0}, "stream": False}
