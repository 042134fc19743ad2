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
