"""The numerics of ``--deterministic``: every reduction a request's row goes through (linear layers, RMSNorm,
attention) and every elementwise function torch computes two ways (SiLU / GELU / tanh: a vector body and a scalar
tail whose place moves with the tensor's size), computed so that a row's result cannot depend on the batch.

Two implementations of one contract, ``InvariantOps``, and neither probes a vendor library:

- ``CppInvariant`` (``invariant/invariant.cpp``, built here for this CPU): every output element is a reduction
  written out in a fixed order that depends only on the reduced length -- the same on AVX2, AVX-512 and NEON.
- ``RowByRow`` (pure torch, where no C++ can be built): every op is called once per row on that row alone, so a
  row's call is the very call it gets when it is alone in the batch. Correct by the same argument, and slow (each
  row streams every weight): the fallback, not the path.

``invariant_ops()`` takes the C++ kernels where they build and says why it falls back when they do not.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels.bounds import check_indices, check_ranges
from radixserve.kernels.cpp_build import NativeUnavailable, build_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("invariant") / "invariant.cpp"
FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-std=c++17")
ABI_VERSION = 2
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # what the C++ kernel computes (act_mul)
TORCH_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class InvariantOps(Protocol):
    """Row-wise ops whose result for a row is bitwise the same whatever other rows are computed with it. Inputs are
    CPU tensors; nothing is mutated; a row's result depends only on the row (and, for attention, its own keys)."""

    name: str

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [M, K] @ weight [N, K]^T + bias``, float32 ``[M, N]`` (bias float32 or None)."""
        ...

    def rms_normalize(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """float32 ``x [..., K]`` divided by the root of its mean square (+ eps) over the last dim."""
        ...

    def act_mul(self, act: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` (``act`` a key of ACTIVATIONS), computed in float32, returned in gate's dtype."""
        ...

    def tanh(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise tanh of float32 ``x``."""
        ...

    def attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                  first: torch.Tensor, length: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
        """Row r's queries ``q[r]`` (``[rows, heads, D]``) attend to the pool slots ``slots[first[r] : first[r] +
        length[r]]`` (int64; every row reads at least one key); scores ``scale * q.k``, soft-capped if asked.
        Returns ``[rows, heads, D]`` in q's dtype."""
        ...


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class CppInvariant:
    name = "cpp"

    def __init__(self, cache_dir: Path) -> None:  # after torch (imported above): its OpenMP threads are torch's
        self.lib = ctypes.CDLL(str(build_library(SOURCE, FLAGS, cache_dir, "cpu_invariant")))
        self.lib.rsi_abi_version.restype = ctypes.c_int32
        if self.lib.rsi_abi_version() != ABI_VERSION:
            raise NativeUnavailable(f"{SOURCE.name}: ABI {self.lib.rsi_abi_version()}, expected {ABI_VERSION}")
        i32, i64, f32, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
        self.lib.rsi_linear.argtypes = [i32, i64, i64, i64, ptr, ptr, ptr, ptr]
        self.lib.rsi_inv_rms.argtypes = [i64, i64, ptr, f32, ptr]
        self.lib.rsi_act_mul.argtypes = [i32, i64, ptr, ptr, ptr]
        self.lib.rsi_tanh.argtypes = [i64, ptr, ptr]
        self.lib.rsi_attention.argtypes = [i32, i64, i32, i32, i32, ptr, ptr, ptr, ptr, ptr, ptr, f32, f32, ptr]

    def linear(self, x, weight, bias):
        x = x.float().contiguous()  # exact: the kernel reads float32 activations
        m, k = x.shape
        n = weight.shape[0]
        if weight.shape[1] != k or not weight.is_contiguous() or weight.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"invariant linear: weight {tuple(weight.shape)} {weight.dtype} for input width {k}")
        y = torch.empty(m, n, dtype=torch.float32)
        self.lib.rsi_linear(weight.dtype == torch.bfloat16, m, k, n, x.data_ptr(), weight.data_ptr(), _ptr(bias),
                            y.data_ptr())
        return y

    def rms_normalize(self, x, eps):
        rows = x.reshape(-1, x.shape[-1]).float().contiguous()
        inv = torch.empty(rows.shape[0], dtype=torch.float32)
        self.lib.rsi_inv_rms(rows.shape[0], rows.shape[1], rows.data_ptr(), eps, inv.data_ptr())
        return (rows * inv[:, None]).view(x.shape)

    def act_mul(self, act, gate, up):
        g, u = gate.float().contiguous(), up.float().contiguous()
        out = torch.empty_like(g)
        self.lib.rsi_act_mul(ACTIVATIONS[act], g.numel(), g.data_ptr(), u.data_ptr(), out.data_ptr())
        return out.to(gate.dtype)

    def tanh(self, x):
        x = x.float().contiguous()
        out = torch.empty_like(x)
        self.lib.rsi_tanh(x.numel(), x.data_ptr(), out.data_ptr())
        return out

    def attention(self, q, k_pool, v_pool, slots, first, length, scale, softcap):
        rows, heads, d = q.shape
        check_indices("context slots", slots, k_pool.shape[0])
        check_ranges("row contexts", first, length, len(slots), rows)
        if heads % k_pool.shape[1] or k_pool.shape[2] != d or v_pool.shape != k_pool.shape:
            raise ValueError(f"invariant attention: {heads} heads of {d} over pools {tuple(k_pool.shape)}, "
                             f"{tuple(v_pool.shape)}")
        q = q.to(k_pool.dtype).contiguous()
        out = torch.empty(rows, heads, d, dtype=torch.float32)
        self.lib.rsi_attention(k_pool.dtype == torch.bfloat16, rows, heads, k_pool.shape[1], d, q.data_ptr(),
                               k_pool.data_ptr(), v_pool.data_ptr(), slots.data_ptr(), first.data_ptr(),
                               length.data_ptr(), scale, softcap or 0.0, out.data_ptr())
        return out.to(q.dtype)


class RowByRow:
    """Each op called on one row at a time: a row's call never sees the batch (nor its size)."""

    name = "torch-row-by-row"

    def linear(self, x, weight, bias):
        y = torch.cat([F.linear(r, weight).float() for r in x.split(1)])
        return y if bias is None else y + bias

    def rms_normalize(self, x, eps):
        rows = x.reshape(-1, x.shape[-1]).float()
        return torch.cat([F.rms_norm(r, (r.shape[-1],), eps=eps) for r in rows.split(1)]).view(x.shape)

    def act_mul(self, act, gate, up):
        fn = TORCH_ACTIVATIONS[act]
        return torch.cat([(fn(g.float()) * u.float()).to(gate.dtype) for g, u in zip(gate.split(1), up.split(1))])

    def tanh(self, x):
        rows = x.reshape(-1, x.shape[-1])
        return torch.cat([torch.tanh(r) for r in rows.split(1)]).view(x.shape)

    def attention(self, q, k_pool, v_pool, slots, first, length, scale, softcap):
        rows, heads, d = q.shape
        kv = k_pool.shape[1]
        out = []
        for r in range(rows):
            ctx = slots[int(first[r]) : int(first[r]) + int(length[r])]
            k = k_pool[ctx].float().permute(1, 2, 0)  # [KH, D, L]
            v = v_pool[ctx].float().transpose(0, 1)  # [KH, L, D]
            s = torch.bmm(q[r].float().view(kv, heads // kv, d), k) * scale  # [KH, G, L]
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            out.append(torch.bmm(torch.softmax(s, dim=-1), v).reshape(1, heads, d))
        return torch.cat(out).to(q.dtype)


def invariant_ops(cache_dir: Path) -> InvariantOps:
    """The C++ kernels where they build here, else the row-by-row torch ones (logged with the reason)."""
    try:
        return CppInvariant(cache_dir)
    except NativeUnavailable as exc:
        log.warning("--deterministic: the C++ batch-invariant kernels cannot run here (%s); computing one row at a "
                    "time with torch instead (the same promise, much slower)", exc)
        return RowByRow()


class InvariantLinear(nn.Module):
    """A linear layer computed by ``ops`` (its weight as loaded, its bias in float32)."""

    def __init__(self, layer: nn.Linear, ops: InvariantOps) -> None:
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight = layer.weight.detach().contiguous()
        self.bias = None if layer.bias is None else layer.bias.detach().float().contiguous()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.ops.linear(x.reshape(-1, self.in_features), self.weight, self.bias)
        return y.to(x.dtype).view(*lead, self.out_features)
