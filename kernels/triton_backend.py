"""The Triton attention backend: the same interface as the torch one (kernels/base.py), for CUDA tensors -- and
for CPU tensors under ``TRITON_INTERPRET=1`` (set before this module is imported), which is how it is tested."""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import triton

from radixserve.kernels.base import AttentionBatch
from radixserve.kernels.triton_kernels import decode_merge_kernel, decode_split_kernel, extend_kernel, store_kv_kernel

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SPLIT_TOKENS = 256  # decode: one split per this many tokens of the longest row, up to MAX_SPLITS
MAX_SPLITS = 16


@dataclass
class _Meta:
    seq_start: torch.Tensor  # int32 [B]: where each request's row starts in batch.slots
    qo_start: torch.Tensor  # int32 [B]: where its new tokens start in q
    prefix_len: torch.Tensor  # int32 [B]
    extend_len: torch.Tensor  # int32 [B]
    seq_len: torch.Tensor  # int32 [B]
    max_extend: int
    num_splits: int  # decode only
    # a draft tree (extend only): (uint8 e x e masks back to back, int32 [B] where each request's starts or -1,
    # int32 [new tokens] each one's position after its prefix)
    tree: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def _starts(lengths: torch.Tensor) -> torch.Tensor:
    return (torch.cumsum(lengths, 0) - lengths).to(torch.int32)


def _tree_inputs(batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The extend kernel's TREE inputs: each tree request's mask (AttentionBatch.seen), where it starts (-1: a
    causal request), and every new token's position after its prefix (a tree's: its depth - 1)."""
    masks, starts, positions, at = [], [], [], 0
    for i, e in enumerate(batch.extend_lens):
        if batch.tree[i] is None:
            starts.append(-1)
            positions.append(np.arange(e))
            continue
        seen = batch.seen(i)
        masks.append(seen.astype(np.uint8).ravel())
        starts.append(at)
        positions.append(seen.sum(axis=1) - 1)
        at += e * e
    device = batch.slots.device
    return (torch.from_numpy(np.concatenate(masks)).to(device), torch.tensor(starts, dtype=torch.int32, device=device),
            torch.from_numpy(np.concatenate(positions).astype(np.int32)).to(device))


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class TritonAttention:
    name = "triton"

    def __init__(self) -> None:
        # the interpreter is slow: small tiles keep interpreted tests quick; on a GPU, tiles that fill it
        self.block_m, self.block_n = (16, 16) if INTERPRET else (64, 64)

    def prepare(self, batch: AttentionBatch) -> _Meta:
        device = batch.slots.device
        prefix = torch.tensor(batch.prefix_lens, dtype=torch.int32, device=device)
        extend = torch.tensor(batch.extend_lens, dtype=torch.int32, device=device)
        seq = prefix + extend
        longest = max(p + e for p, e in zip(batch.prefix_lens, batch.extend_lens))
        splits = min(MAX_SPLITS, _pow2(triton.cdiv(longest, SPLIT_TOKENS))) if batch.mode == "decode" else 1
        meta = _Meta(_starts(seq), _starts(extend), prefix, extend, seq, max(batch.extend_lens), splits)
        if batch.tree is not None and any(t is not None for t in batch.tree):
            meta.tree = _tree_inputs(batch)
        return meta

    def _f32(self, t: torch.Tensor) -> bool:
        return INTERPRET or t.dtype == torch.float32

    def store_kv(self, k_pool, v_pool, batch, k, v) -> None:
        n, kv_heads, head_dim = k.shape
        store_kv_kernel[(n,)](k, v, k_pool, v_pool, batch.out_slots, k.stride(0), k.stride(1), v.stride(0),
                              v.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
                              KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=_pow2(kv_heads),
                              BLOCK_D=max(16, _pow2(head_dim)))

    def extend(self, q, k, v, k_pool, v_pool, batch, scale, window=None, softcap=None):
        meta: _Meta = batch.backend_data
        n, heads, head_dim = q.shape
        out = torch.empty_like(q)
        grid = (len(batch.extend_lens), heads, triton.cdiv(meta.max_extend, self.block_m))
        tree, tree_start, new_pos = meta.tree or (meta.extend_len,) * 3  # (unread without a tree)
        extend_kernel[grid](
            q, k, v, k_pool, v_pool, out, batch.slots, meta.seq_start, meta.qo_start, meta.prefix_len,
            meta.extend_len, scale, window or 0, softcap or 0.0, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), out.stride(0), out.stride(1),
            tree, tree_start, new_pos,
            GROUP=heads // k.shape[1], HEAD_DIM=head_dim, BLOCK_D=max(16, _pow2(head_dim)), BLOCK_M=self.block_m,
            BLOCK_N=self.block_n, F32=self._f32(q), SOFTCAP=softcap is not None, TREE=meta.tree is not None,
        )
        return out

    def decode(self, q, k_pool, v_pool, batch, scale, window=None, softcap=None):
        meta: _Meta = batch.backend_data
        b, heads, head_dim = q.shape
        splits, block_d = meta.num_splits, max(16, _pow2(head_dim))
        mid_o = torch.empty((b, heads, splits, head_dim), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((b, heads, splits), dtype=torch.float32, device=q.device)
        decode_split_kernel[(b, heads, splits)](
            q, k_pool, v_pool, batch.slots, meta.seq_start, meta.seq_len, mid_o, mid_lse, scale, window or 0,
            softcap or 0.0, q.stride(0),
            q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), mid_o.stride(0),
            mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
            GROUP=heads // k_pool.shape[1], HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=self.block_n,
            NUM_SPLITS=splits, SOFTCAP=softcap is not None,
        )
        out = torch.empty_like(q)
        decode_merge_kernel[(b, heads)](
            mid_o, mid_lse, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
            mid_lse.stride(1), out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits,
        )
        return out
