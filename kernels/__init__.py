"""Attention backends by name. Heavy backends (Triton) are imported inside their factory."""
from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.kernels.base import AttentionBackend, AttentionBatch


def _torch() -> AttentionBackend:
    from radixserve.kernels.torch_backend import TorchAttention

    return TorchAttention()


def _triton() -> AttentionBackend:
    from radixserve.kernels.triton_backend import TritonAttention  # imports triton: only when asked for

    return TritonAttention()


def _batch_invariant() -> AttentionBackend:
    from radixserve.kernels.batch_invariant import BatchInvariantAttention
    from radixserve.kernels.cpp_build import default_cache_dir
    from radixserve.kernels.invariant import invariant_ops

    return BatchInvariantAttention(invariant_ops(default_cache_dir()))


BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"torch": _torch, "triton": _triton,
                                                       "batch-invariant": _batch_invariant}


def get_backend(name: str, device: torch.device, deterministic: bool = False) -> AttentionBackend:
    """``auto``: Triton on CUDA, torch on CPU; batch-invariant when ``deterministic`` (the only one that is)."""
    if deterministic:
        if name not in ("auto", "batch-invariant"):
            raise ValueError(f"--deterministic needs the batch-invariant attention backend, not {name!r}; "
                             "leave --attention-backend at auto")
        name = "batch-invariant"
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name]()


__all__ = ["AttentionBackend", "AttentionBatch", "get_backend"]
