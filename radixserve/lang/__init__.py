"""radixserve.lang: SGLang's frontend language (``@function``, ``gen``, ``select``, roles, fork, run_batch).

Standard library only, so a client machine needs nothing else: ``import radixserve.lang as sgl``.
Programs share prompt prefixes through the server's radix cache: ``fork`` and ``run_batch`` prefill the shared
text once (max_new_tokens=0) and ``select`` scores every choice on top of one cached prompt.
"""
from __future__ import annotations

from radixserve.lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from radixserve.lang.backend import Backend, BackendError
from radixserve.lang.choices import greedy_token_selection, token_length_normalized
from radixserve.lang.engine_backend import EngineBackend
from radixserve.lang.function import Function
from radixserve.lang.runtime_endpoint import RuntimeEndpoint
from radixserve.lang.state import ProgramState, StateGroup
from radixserve.role_markers import ChatTemplate

__all__ = [
    "Backend", "BackendError", "ChatTemplate", "EngineBackend", "Function", "ProgramState", "RuntimeEndpoint",
    "StateGroup", "assistant", "assistant_begin", "assistant_end", "flush_cache", "function", "gen", "gen_int",
    "gen_string", "get_server_info", "greedy_token_selection", "select", "set_default_backend", "system",
    "system_begin", "system_end", "token_length_normalized", "user", "user_begin", "user_end",
]
