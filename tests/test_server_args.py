"""Resolving "auto" server arguments: the KV pool's size on a GPU (as SGLang sizes it) and on the CPU."""
from __future__ import annotations

import pytest
import torch

from radixserve.server_args import DEFAULT_MAX_TOTAL_TOKENS, ServerArgs

GIB = 2**30


def fake_gpu(monkeypatch, free: int, total: int) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free, total))


def test_gpu_pool_is_sized_from_device_memory(monkeypatch):
    """An H200-sized device: the pool takes what the weights leave of 85% of it -- far past the CPU's 65,536 cap."""
    fake_gpu(monkeypatch, free=139 * GIB, total=140 * GIB)
    kv_values = 2 * 30 * 3 * 64  # SmolLM2: 2 * layers * kv heads * head dim
    args = ServerArgs(device="cuda").resolved(kv_values, 8192, num_parameters=135_000_000)
    budget = 139 * GIB - 0.15 * 140 * GIB - 135_000_000 * 2
    assert args.max_total_tokens == int(budget // (kv_values * 2)) > DEFAULT_MAX_TOTAL_TOKENS
    smaller = ServerArgs(device="cuda", mem_fraction_static=0.5).resolved(kv_values, 8192, 135_000_000)
    assert smaller.max_total_tokens < args.max_total_tokens
    given = ServerArgs(device="cuda", max_total_tokens=1000).resolved(kv_values, 8192, 135_000_000)
    assert given.max_total_tokens == 1000, "an explicit size is kept"


def test_a_gpu_too_full_is_a_clear_error(monkeypatch):
    fake_gpu(monkeypatch, free=1 * GIB, total=16 * GIB)
    with pytest.raises(ValueError, match="mem-fraction-static"):
        ServerArgs(device="cuda").resolved(11520, 8192, num_parameters=7_000_000_000)


def test_mem_fraction_range():
    with pytest.raises(ValueError, match="mem_fraction_static"):
        ServerArgs(mem_fraction_static=1.5)


def test_cpu_pool_keeps_its_cap():
    args = ServerArgs(device="cpu").resolved(11520, 8192, num_parameters=135_000_000)
    assert 256 <= args.max_total_tokens <= DEFAULT_MAX_TOTAL_TOKENS


def test_parameter_count_of_smollm2(smollm2_path):
    from radixserve.model.config import ModelConfig
    from radixserve.model.loader import load_configs

    cfg = ModelConfig.from_hf(*load_configs(smollm2_path))
    assert abs(cfg.num_parameters - 134_515_008) < 1_000_000  # SmolLM2-135M: 134.5M parameters (tied embeddings)


def test_with_tp_a_gpu_holds_one_ranks_share(monkeypatch):
    """--tp 3 on GPUs: each holds a third of the weights and its rank's KV heads (one of SmolLM2's three)."""
    fake_gpu(monkeypatch, free=139 * GIB, total=140 * GIB)
    per_rank = 2 * 30 * 1 * 64
    args = ServerArgs(device="cuda", tp=3, dist_backend="nccl").resolved(2 * 30 * 3 * 64, 8192, 135_000_000, per_rank)
    budget = 139 * GIB - 0.15 * 140 * GIB - 45_000_000 * 2
    assert args.max_total_tokens == int(budget // (per_rank * 2))


def test_with_tp_a_cpu_node_holds_all_its_ranks_pools(monkeypatch):
    """--tp 4 over 2 KV heads on one CPU machine: each rank holds a copy of one KV head, so the node's pools take
    twice the memory per token that one rank's whole pool would."""
    import os

    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_AVPHYS_PAGES": 2**20, "SC_PAGE_SIZE": 4096}[name])
    full, per_rank = 2 * 30 * 2 * 1024, 2 * 30 * 1 * 1024  # big heads, so neither pool reaches the cap
    one = ServerArgs(device="cpu").resolved(full, 8192).max_total_tokens
    four = ServerArgs(device="cpu", tp=4).resolved(full, 8192, 0, per_rank).max_total_tokens
    assert four == pytest.approx(one / 2, rel=0.01)


def test_served_model_names_are_a_tuple_of_aliases():
    assert ServerArgs(served_model_name="tiny").served_model_name == ("tiny",), "one name, as SGLang's string"
    assert ServerArgs(served_model_name=["a", "b", "a"]).served_model_name == ("a", "b")
    for bad in ([], ["a", ""], [" "]):
        with pytest.raises(ValueError, match="give one or more non-empty names"):
            ServerArgs(served_model_name=bad)


def test_kv_cache_dtype_is_the_models_or_8_bit_codes():
    kv = 2 * 30 * 3 * 64
    assert ServerArgs(device="cpu").resolved(kv, 8192).kv_cache_dtype == "bfloat16", "auto: the model's dtype"
    same = ServerArgs(device="cpu", dtype="fp32", kv_cache_dtype="float32").resolved(kv, 8192)
    assert same.kv_cache_dtype == same.dtype == "float32"
    with pytest.raises(ValueError, match="--kv-cache-dtype float16 is not implemented: the KV pool holds the "
                                         "model's dtype \\(bfloat16\\) or 8-bit codes"):
        ServerArgs(device="cpu", kv_cache_dtype="fp16").resolved(kv, 8192)
    plain = ServerArgs(device="cpu", max_total_tokens=1000).resolved(kv, 8192)
    for fmt in ("int8", "fp8_e4m3", "fp8_e5m2"):
        coded = ServerArgs(device="cpu", kv_cache_dtype=fmt).resolved(kv, 8192, head_dim=64)
        assert coded.kv_cache_dtype == fmt and coded.dtype == "bfloat16"
        assert ServerArgs(device="cpu", kv_cache_dtype=fmt, max_total_tokens=1000).resolved(kv, 8192).max_total_tokens \
            == plain.max_total_tokens, "an explicit pool size is kept"


def test_8_bit_kv_gets_the_same_bytes_as_more_tokens(monkeypatch):
    import os

    kv = 2 * 30 * 3 * 64
    real = os.sysconf

    def free_pages(pages: int) -> None:  # the free memory both pools are sized by (not whatever other processes left)
        monkeypatch.setattr(os, "sysconf", lambda name: pages if name == "SC_AVPHYS_PAGES" else real(name))

    free_pages(1 << 24)  # 64 GiB free: the cap binds
    plain = ServerArgs(device="cpu").resolved(kv, 8192)
    coded = ServerArgs(device="cpu", kv_cache_dtype="int8").resolved(kv, 8192, head_dim=64)
    bf16_bytes, code_bytes = kv * 2, kv + kv // 64 * 4  # a scale (float32) per token, layer, K/V and head
    assert code_bytes / bf16_bytes == 68 / 128
    assert plain.max_total_tokens == 65536
    assert coded.max_total_tokens == plain.max_total_tokens * bf16_bytes // code_bytes, \
        "the default cap is the bf16 pool's bytes"
    free_pages(1 << 17)  # 512 MiB free: memory binds
    small, small_coded = (ServerArgs(device="cpu", kv_cache_dtype=d).resolved(kv, 8192) for d in ("auto", "int8"))
    assert small_coded.max_total_tokens > 1.8 * small.max_total_tokens, "memory-bound: nearly twice the tokens"


def test_8_bit_kv_pages_move_below_the_pool_as_they_are():
    with pytest.raises(ValueError, match="the pool's pages are 8-bit already"):
        ServerArgs(kv_cache_dtype="int8", enable_hierarchical_cache=True, hicache_kv_format="int8")
    ServerArgs(kv_cache_dtype="fp8_e4m3", enable_hierarchical_cache=True)


def test_closed_sets_are_checked_for_engine_callers_too():
    with pytest.raises(ValueError, match="device='tpu' is not one of auto, cpu, cuda"):
        ServerArgs(device="tpu")
    with pytest.raises(ValueError, match="log_level='loud'"):
        ServerArgs(log_level="loud")
    assert ServerArgs(device="cuda:1").device == "cuda:1", "a rank's own GPU"
    with pytest.raises(ValueError, match="random_seed=-1"):
        ServerArgs(random_seed=-1)


def test_a_mistyped_keyword_names_the_close_one():
    with pytest.raises(ValueError, match="unknown server argument\\(s\\) max_totl_tokens; did you mean "
                                         "'max_total_tokens'\\?"):
        ServerArgs.from_kwargs(max_totl_tokens=5)
    with pytest.raises(ValueError, match="remote code is never executed"):
        ServerArgs(trust_remote_code=True)


def test_sequences_per_request_default_to_what_the_server_holds_in_flight():
    """A knob, not a wall: SGLang's radix-attention test sends 401 prompts in one request; the in-flight cap
    (queued + running) is what protects the server, and the per-request cap defaults to it."""
    args = ServerArgs(device="cpu").resolved(11520, 8192)
    assert args.max_sequences_per_request == 1024 + 128 > 401
    small = ServerArgs(device="cpu", max_queued_requests=10, max_running_requests=4).resolved(11520, 8192)
    assert small.max_sequences_per_request == 14
    assert ServerArgs(device="cpu", max_sequences_per_request=8).resolved(11520, 8192).max_sequences_per_request == 8
    with pytest.raises(ValueError, match="max_sequences_per_request"):
        ServerArgs(max_sequences_per_request=0)
