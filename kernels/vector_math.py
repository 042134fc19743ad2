"""torch's element-wise math on the CPU (exp, cos, sin, log, tanh, ...) goes through MKL's vector math library
(VML), which ATen asks for its high-accuracy mode (HA). Seen with torch 2.13 on a Xeon (2 threads): in about one
engine start in six (18 of 110), the process's first VML call -- made at once by the threads of a parallel loop --
ran one thread's share in VML's enhanced-performance mode (EP, about 11 correct bits; the values match ``vmsCos``
with VML_EP exactly). That first call was the RoPE table's cos, which a runner computes once and keeps: 1 bf16 unit
wrong in ~2% of one thread's half of the positions, so two starts of the same server answered a near-tie prompt
differently at temperature 0. One VML call made first by a single thread sets VML up for all (0 wrong tables in 80
starts; tests/test_vector_math.py).
"""
from __future__ import annotations

import torch


def settle_vector_math() -> None:
    """Make this process's first VML call on this thread alone: 4 values, under torch's grain for a parallel loop.
    Call before any other torch math in the process (ModelRunner does, first thing)."""
    torch.ones(4).exp()
