"""Layers packed for the native kernel's product alone (benchmarks/kernel_ab.py, benchmarks/gguf_layers.py):
random blocks of a GGUF format (tests/conftest.py's ``random_blocks``) in the kernel's layout, or a dense bf16 /
float32 layer, each as a ``cpu_native.Linear`` with the tensors it points into kept alive beside it."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import random_blocks  # noqa: E402

from radixserve.kernels import cpu_native  # noqa: E402
from radixserve.model.gguf_quant import _as_layer, decode_blocks  # noqa: E402
from radixserve.model.native_decode import pack_dense, pack_gguf  # noqa: E402

DENSE = {"BF16": torch.bfloat16, "F32": torch.float32}  # dense kinds beside GGUF's block formats


class Packed:
    """One layer in the kernel's layout: ``lin`` points into ``tensors``."""

    def __init__(self, form: int, tensors: tuple[torch.Tensor | None, ...], n: int, k: int) -> None:
        self.tensors = tensors
        ptrs = [None if t is None else t.data_ptr() for t in tensors]
        ptrs += [None] * (5 - len(ptrs))  # w, scale, zero, super_scale, super_zero
        self.lin = cpu_native.Linear(form, n, k, 0, *ptrs[:3], None, *ptrs[3:])
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors if t is not None)


def gguf_layer(kind: str, n: int, k: int):
    """Random blocks of GGUF format ``kind`` as the loader reads them (gguf_quant's layer: its q, scales and file
    blocks)."""
    return _as_layer([decode_blocks(random_blocks(kind, n, k, seed=1), kind)], torch.float32)


def codes(layer, n: int, k: int) -> torch.Tensor:
    """A GGUF layer's integer weights [n, k]: its 8-bit q, or its nibbles unpacked."""
    return layer.q if layer.bits == 8 else torch.stack([layer.nibbles & 15, layer.nibbles >> 4], -1).view(n, k)


def packed(kind: str, n: int, k: int, copies: int) -> list[Packed]:
    """``copies`` separate copies of one random layer of ``kind`` (a GGUF block format, or BF16 / F32), so that a
    product cycling through them reads its weights from memory, as a model's step does."""
    if kind in DENSE:
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)).to(DENSE[kind])
        return [Packed(cpu_native.DENSE, (pack_dense(w),), n, k) for _ in range(copies)]
    layer = gguf_layer(kind, n, k)
    q = codes(layer, n, k)
    return [Packed(*pack_gguf(q, layer.file_blocks[0]), n, k) for _ in range(copies)]
