"""``--dp N``: N scheduler + runner replicas behind one api and tokenizer, requests routed by the same policies as
``radixserve router`` (tiny model, float32): greedy tokens identical to one replica, prefix groups kept together
by the cache-aware policy (as many cached tokens as one replica, more than round-robin), policies switched on one
replica or all, per-replica and total numbers in /cache/stats, /get_server_info and /metrics."""
from __future__ import annotations

import json
import urllib.error

import pytest

from conftest import get_body, post_json
from radixserve import Engine
from radixserve.server_process import ServerProcess

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
PROMPTS = [f"Group {g}: you are assistant {g}, follow rule {g} and answer briefly. " + "context " * 25 +
           f"Question {q}?" for q in range(4) for g in range(3)]  # 3 groups interleaved: round-robin splits them




def _serve(path, *flags: str):
    """A server's greedy tokens for PROMPTS (one at a time), its /cache/stats, and the server (still up)."""
    server = ServerProcess("--model-path", str(path), "--dtype", "float32", "--max-total-tokens", "4096", *flags)
    outs = [post_json(server.url + "/generate", {"text": p, "sampling_params": GREEDY})["output_ids"] for p in PROMPTS]
    return outs, get_body(server.url + "/cache/stats"), server


def test_replicas_serve_one_replicas_tokens_and_cache_aware_keeps_groups_together(tiny_models):
    path = tiny_models["llama"]
    one, one_stats, server = _serve(path)
    server.stop()
    rr, rr_stats, server = _serve(path, "--dp", "2", "--routing-policy", "round-robin")
    server.stop()
    two, stats, server = _serve(path, "--dp", "2")
    try:
        assert two == one and rr == one
        per = [r["totals"]["requests_received"] for r in stats["replicas"].values()]
        assert sum(per) == len(PROMPTS) and min(per) > 0, "both replicas serve"
        assert stats["total"]["totals"]["requests_received"] == len(PROMPTS)
        cached = stats["total"]["totals"]["cached_tokens"]
        # each group stayed on one replica: all one replica's hits but the few tokens the groups share ("Group")
        assert one_stats["totals"]["cached_tokens"] - 8 <= cached <= one_stats["totals"]["cached_tokens"]
        assert cached > rr_stats["total"]["totals"]["cached_tokens"], "round-robin splits the groups"

        switched = post_json(server.url + "/policies", {"eviction": "lfu", "replica": 1})
        assert switched["replicas"]["1"]["eviction"]["current"] == "lfu"
        now = get_body(server.url + "/policies")
        assert {i: r["eviction"]["current"] for i, r in now["replicas"].items()} == {"0": "lru", "1": "lfu"}
        post_json(server.url + "/policies", {"schedule": "lpm"})  # no replica: all of them
        replicas = get_body(server.url + "/policies")["replicas"].values()
        assert [r["schedule"]["current"] for r in replicas] == ["lpm"] * 2
        flushed = post_json(server.url + "/flush_cache", {})
        assert flushed["tokens_freed"] == sum(r["tokens_freed"] for r in flushed["replicas"].values()) > 0
        assert get_body(server.url + "/get_server_info")["status"]["eviction"] == "mixed"
        with pytest.raises(urllib.error.HTTPError) as bad:
            post_json(server.url + "/policies", {"eviction": "lfu", "replica": 2})
        assert bad.value.code == 400 and json.load(bad.value)["error"]["param"] == "replica"

        info = get_body(server.url + "/get_server_info")
        assert [s["replica"] for s in info["replica_status"]] == [0, 1]
        assert {"scheduler.0", "scheduler.1", "runner.0", "runner.1"} <= set(info["actors"])
        metrics = get_body(server.url + "/metrics")
        assert 'radixserve_replica_kv_pool_usage{replica="1"}' in metrics
    finally:
        server.stop()


def test_what_dp_does_not_do_is_refused(tiny_models):
    with pytest.raises(ValueError, match="Engine runs one replica"):
        Engine(str(tiny_models["llama"]), dp=2)
    with pytest.raises(ValueError, match="--dp > 1 runs its replicas on one machine"):
        Engine(str(tiny_models["llama"]), dp=2, nnodes=2, tp=2, dist_init_addr="127.0.0.1:5000")
    with pytest.raises(ValueError, match="unknown routing policy 'nope'"):
        from radixserve.prepare import prepare
        from radixserve.server_args import ServerArgs

        prepare(ServerArgs(model_path=str(tiny_models["llama"]), dp=2, routing_policy="nope"))
