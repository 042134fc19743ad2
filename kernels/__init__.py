"""Attention backends by name. Heavy backends (Triton) are imported inside their factory."""
from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.kernels.base import AttentionBackend, AttentionBatch


def _torch() -> AttentionBackend:
    from radixserve.kernels.torch_backend import TorchAttention

    return TorchAttention()


BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"torch": _torch}


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto``: Triton on CUDA once it exists, torch otherwise."""
    if name == "auto":
        name = "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name]()


__all__ = ["AttentionBackend", "AttentionBatch", "get_backend"]
