"""/get_server_info in SGLang's names too, beside radixserve's own: SGLang lists its server arguments at the top
level and adds the scheduler's figures (``max_total_num_tokens``, ``max_req_input_len``) and each data-parallel
rank's ``internal_states``; its benchmarks and test kits read them from there."""
from __future__ import annotations

from typing import Any

# radixserve's argument -> SGLang's name for the same setting
RENAMED = {"tp": "tp_size", "dp": "dp_size", "eviction_policy": "radix_eviction_policy",
           "deterministic": "enable_deterministic_inference"}


def sglang_names(info: dict[str, Any], replica_status: list[dict[str, Any] | None]) -> dict[str, Any]:
    """SGLang's fields for ``info`` (the api's /get_server_info body without them); ``replica_status``: each
    replica's latest status (None before its first)."""
    args = dict(info.get("server_args", {}))
    out: dict[str, Any] = {**args, **{sglang: args[ours] for ours, sglang in RENAMED.items() if ours in args}}
    pool, context = info.get("max_total_tokens"), info.get("context_length")
    out.update({
        "served_model_name": info.get("model"),  # SGLang's is one name: the primary
        "page_size": 1,  # the radix tree and the KV pool work token by token
        "max_total_num_tokens": pool,
        # the longest prompt that leaves room for one generated token
        "max_req_input_len": min(pool, context) - 1 if pool and context else None,
        "internal_states": [s or {} for s in replica_status],
    })
    return out
