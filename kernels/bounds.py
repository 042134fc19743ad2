"""Every index a C++ kernel reads, checked against its buffer before the call: the kernels index raw memory with
them, so a bad one would read or write outside a tensor (a crash at best). A violation raises IndexError, which
fails that step (the runner reports it and the scheduler fails the step's requests); the server goes on.

Vectorised min/max checks: a few microseconds a step, against a decode step's milliseconds.
"""
from __future__ import annotations

import torch


def check_indices(name: str, index: torch.Tensor, size: int) -> None:
    """Every entry of ``index`` in ``0 .. size - 1``."""
    if index.numel() and not (0 <= int(index.min()) and int(index.max()) < size):
        raise IndexError(f"{name}: an index in {int(index.min())}..{int(index.max())} is outside 0..{size - 1}")


def check_ranges(name: str, first: torch.Tensor, length: torch.Tensor, size: int, rows: int) -> None:
    """``rows`` ranges ``first[r] .. first[r] + length[r] - 1``, each non-empty and inside ``0 .. size - 1``."""
    if first.shape != (rows,) or length.shape != (rows,):
        raise IndexError(f"{name}: {tuple(first.shape)} starts and {tuple(length.shape)} lengths for {rows} rows")
    if rows and not (int(length.min()) >= 1 and int(first.min()) >= 0 and int((first + length).max()) <= size):
        raise IndexError(f"{name}: a range is empty or reaches outside 0..{size - 1}")
