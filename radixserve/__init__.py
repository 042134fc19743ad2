"""radixserve: a readable LLM serving engine built around RadixAttention.

Heavy imports (torch, transformers) happen lazily, so ``import radixserve.cache`` stays light.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"


def _leave_the_checkout_root_off_sys_path() -> None:
    """A checkout keeps its packages at the top (kernels/, model/, cache/, ...), installed as radixserve.kernels and
    so on. ``python -m radixserve`` or ``python -m pytest`` run there put the checkout on sys.path, where kernels/
    would stand in for Hugging Face's ``kernels`` package, which transformers 5.25 and later imports. Nothing is
    imported from the checkout's root by its bare name, so it leaves sys.path (a wheel's site-packages has no
    pyproject.toml and stays)."""
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file():
        sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != root]


_leave_the_checkout_root_off_sys_path()

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
