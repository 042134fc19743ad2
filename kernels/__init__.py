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


BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"torch": _torch, "triton": _triton}


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto``: Triton on CUDA, torch on CPU."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name]()


__all__ = ["AttentionBackend", "AttentionBatch", "get_backend"]
