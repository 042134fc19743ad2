"""radixserve: a readable LLM serving engine built around RadixAttention.

Heavy imports (torch, transformers) happen lazily, so ``import radixserve.cache`` stays light.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from radixserve.engine import Engine
    from radixserve.errors import InvalidRequest
    from radixserve.sampling_params import SamplingParams
    from radixserve.server_args import ServerArgs

_LAZY = {
    "Engine": "radixserve.engine",
    "InvalidRequest": "radixserve.errors",
    "SamplingParams": "radixserve.sampling_params",
    "ServerArgs": "radixserve.server_args",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")


__all__ = ["Engine", "InvalidRequest", "SamplingParams", "ServerArgs", "__version__"]
