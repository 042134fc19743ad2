"""The functions a program is written with: gen, select, the roles, and ``@function``.

They only build expressions (see ir.py); nothing calls the model until a state runs them.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixserve.lang.choices import ChoicesMethod, token_length_normalized
from radixserve.lang.defaults import DEFAULT, resolve_backend
from radixserve.lang.function import Function
from radixserve.lang.ir import Expr, ExprList, Gen, RoleBegin, RoleEnd, Select, as_expr
from radixserve.lang.sampling import GenParams


def function(func: Callable[..., Any] | None = None, *, num_api_spec_tokens: int | None = None) -> Any:
    """``@function`` or ``@function(...)``. ``num_api_spec_tokens`` is accepted for SGLang compatibility and
    ignored: it only matters for API-only chat models, which this package does not target."""
    if func is not None:
        return Function(func)
    return Function


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None, n: int | None = None,
        stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
        temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
        min_p: float | None = None, frequency_penalty: float | None = None, presence_penalty: float | None = None,
        ignore_eos: bool | None = None, return_logprob: bool | None = None, logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None, return_text_in_logprobs: bool | None = None,
        dtype: type | str | None = None, choices: list[str] | None = None,
        choices_method: ChoicesMethod | None = None, regex: str | None = None,
        json_schema: str | dict[str, Any] | None = None) -> Expr:
    """Generate into variable ``name``. Unset arguments take the run's defaults. With ``choices`` this is a
    ``select``; ``dtype`` (int, float, str, bool) constrains the output with a regex; ``regex`` and
    ``json_schema`` are checked by the server, which answers 400 naming the bad one."""
    if choices:
        return select(name, choices, 0.0 if temperature is None else temperature,
                      choices_method or token_length_normalized)
    params = GenParams.build(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids,
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty, ignore_eos=ignore_eos, return_logprob=return_logprob,
        logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs, dtype=dtype, regex=regex, json_schema=json_schema)
    return Gen(name, params)


def gen_int(name: str | None = None, **kwargs: Any) -> Expr:
    """``gen`` constrained to an integer (it stops at the first space or newline after it)."""
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Expr:
    """``gen`` constrained to a double-quoted string."""
    return gen(name, dtype=str, **kwargs)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: ChoicesMethod = token_length_normalized) -> Expr:
    """Append the choice the model scores highest (see choices.py for how); the variable holds the string."""
    if choices is None:
        raise ValueError("select needs choices, e.g. select('answer', choices=['yes', 'no'])")
    if temperature > 1e-5:
        raise ValueError(f"select(temperature={temperature}) is not supported: choices are picked greedily by "
                         "their log-probabilities; leave temperature at 0")
    return Select(name, tuple(choices), choices_method)


def _role(role: str, expr: Expr | str | None) -> Expr:
    if expr is None:
        return ExprList((RoleBegin(role), RoleEnd(role)))
    return ExprList((RoleBegin(role), as_expr(expr), RoleEnd(role)))


def system(expr: Expr | str | None = None) -> Expr:
    return _role("system", expr)


def user(expr: Expr | str | None = None) -> Expr:
    return _role("user", expr)


def assistant(expr: Expr | str | None = None) -> Expr:
    return _role("assistant", expr)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")


def set_default_backend(backend: Any) -> None:
    """The backend ``run``/``run_batch`` use when none is passed."""
    DEFAULT.set(backend)


def flush_cache(backend: Any = None) -> bool:
    """Drop the server's unused cached prefixes; False when there is no backend to flush."""
    if backend is None and DEFAULT.backend is None:
        return False
    resolve_backend(backend).flush_cache()
    return True


def get_server_info(backend: Any = None) -> dict[str, Any] | None:
    if backend is None and DEFAULT.backend is None:
        return None
    return resolve_backend(backend).server_info()
