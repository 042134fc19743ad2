"""Attention over the slot pool with torch's scaled_dot_product_attention (the CPU path).

extend: one SDPA call per request over its true length (no padding to the longest); a request with no cached
prefix attends to its fresh K/V directly, skipping the gather. decode: one batched SDPA call over the rows
gathered into a ``[batch, max_len]`` index matrix, padded with the dummy slot and masked.

decode with shared prefixes (requests of one system prompt, a chat's turns): when the rows hold at most half as
many distinct slots as slots, each distinct K/V row is gathered once and every query scores all of them, with
a mask keeping each query to its own row -- softmax does not care about the order of keys. Gathering is what
long-row decode pays for on a CPU; 32 requests sharing a 1k-token prompt gather it once, not 32 times.

On CPU (torch 2.13) ``index_select`` gathers rows several times faster than ``pool[index]``, and
``enable_gqa=True`` and 3-D inputs both send SDPA to its slow "math" fallback, so inputs are
4-D and grouped-query heads are handled by hand: extend repeats K/V heads; decode folds each group's query
heads into the query-length axis (one query token, so no causal order).

Sliding windows (kernels/base.py): extend gathers only the keys a request's window can reach (its last W - 1
prefix positions and the new tokens), under a mask of causal and window; decode masks the positions before the
window. Soft-capped scores (Gemma 2) are out of SDPA's reach: those layers run the reference's own ops
(``capped_attention``), scores in the queries' dtype and the softmax in float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from radixserve.kernels.base import AttentionBatch


@dataclass
class _Extend:
    tok_starts: list[int]
    slot_starts: list[int]
    masks: list[torch.Tensor | None]  # None: plain causal (no prefix)
    # window -> per request: (its first key inside the window, the mask over its keys from there)
    windowed: dict[int, list[tuple[int, torch.Tensor]]]


@dataclass
class _Decode:
    index: torch.Tensor  # [B, max_len] slot of each position, dummy slot 0 where padded
    mask: torch.Tensor  # [B, 1, 1, max_len] additive: 0 where the position is real, -inf where padded
    windowed: dict[int, torch.Tensor]  # window -> the mask, also -inf before each row's window


@dataclass
class _SharedDecode:
    slots: torch.Tensor  # [U] the distinct slots of the batch's rows
    bias: torch.Tensor  # [1, B * group, U] float32: 0 where the slot is in the query's row, -inf elsewhere
    windowed: dict[int, torch.Tensor]  # window -> the bias, 0 only where the slot is in the row's window


CAPPED_ROWS = 256  # soft-capped extend: queries per score matrix
SHARED_MAX_SCORES = 1 << 23  # B * U bound for the shared-key path (its score matrix is this big per kv head)


def _starts(lengths: list[int]) -> list[int]:
    out, acc = [], 0
    for n in lengths:
        out.append(acc)
        acc += n
    return out


def _extend_mask(p: int, e: int, first: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[e, p + e - first] bool: new token i (at position p + i) sees key position j (from ``first``) when j <= p + i
    and, with a window, j > p + i - window."""
    i = p + torch.arange(e, device=device)[:, None]
    j = first + torch.arange(p + e - first, device=device)[None, :]
    return (j <= i) if window is None else (j <= i) & (j > i - window)


def _tree_mask(batch: AttentionBatch, i: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Request i's [e, p + e] bool mask under a draft tree (AttentionBatch.tree), within ``window`` positions."""
    p = batch.prefix_lens[i]
    seen = np.concatenate([np.ones((batch.extend_lens[i], p), dtype=bool), batch.seen(i)], axis=1)
    if window is not None:
        new = p - 1 + seen[:, p:].sum(axis=1)  # a new token's position: its ancestors and itself after the prefix
        keys = np.concatenate([np.arange(p), new])
        seen &= new[:, None] - keys[None, :] < window
    return torch.from_numpy(seen).to(device)


def _additive(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, L] bool -> [B, 1, 1, L] additive, in the model's dtype: SDPA would otherwise convert a boolean mask in
    every layer."""
    bias = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, float("-inf"))
    return bias[:, None, None, :]


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                     softcap: float) -> torch.Tensor:
    """softmax(c * tanh(scale * q k^T / c) + mask) v, in the reference's order (HF's eager attention).
    ``q`` [.., M, D], ``k``/``v`` [.., L, D]; ``mask``: bool [M, L] (True: seen), additive (broadcast over M), or
    None (causal, M == L). CAPPED_ROWS queries at a time: the score matrix of a long prompt stays small."""
    m = q.shape[-2]
    if mask is None:
        mask = torch.ones(m, k.shape[-2], dtype=torch.bool, device=q.device).tril_()
    if m > CAPPED_ROWS:
        return torch.cat([capped_attention(q[..., i : i + CAPPED_ROWS, :], k, v, mask[i : i + CAPPED_ROWS], scale,
                                           softcap) for i in range(0, m, CAPPED_ROWS)], dim=-2)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return torch.matmul(s.softmax(-1, dtype=torch.float32).to(q.dtype), v)


class TorchAttention:
    name = "torch"

    def __init__(self) -> None:
        self.flash_refused = False  # torch's flash kernel raised on this CPU: its math kernel from then on

    def _sdpa(self, q, k, v, **kw) -> torch.Tensor:
        """``F.scaled_dot_product_attention``, falling back to torch's math kernel for good where its flash kernel
        refuses the CPU: torch 2.13's bf16 flash kernel packs VNNI pairs with AVX-512 instructions and raises when
        torch's dispatch was held below AVX-512 (``ATEN_CPU_CAPABILITY=avx2``) on a CPU that has AMX."""
        if not self.flash_refused:
            try:
                return F.scaled_dot_product_attention(q, k, v, **kw)
            except RuntimeError as e:
                if "pack_vnni" not in str(e):
                    raise
                self.flash_refused = True
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, **kw)

    def prepare(self, batch: AttentionBatch):
        device = batch.slots.device
        if batch.mode == "decode":
            shared = self._shared_decode(batch)
            if shared is not None:
                return shared
            lens = torch.tensor(batch.seq_lens, device=device)
            real = torch.arange(int(lens.max()), device=device)[None, :] < lens[:, None]
            index = torch.zeros(real.shape, dtype=torch.int64, device=device)
            index[real] = batch.slots  # row-major fill = the rows back to back
            pos = torch.arange(real.shape[1], device=device)[None, :]
            return _Decode(index, _additive(real, batch.dtype), {w: _additive(real & (pos >= lens[:, None] - w),
                                                                              batch.dtype) for w in batch.windows})
        # causal, aligned to the bottom right: new token i sees the prefix and new tokens <= i
        masks = [None if p == 0 else _extend_mask(p, e, 0, None, device)
                 for p, e in zip(batch.prefix_lens, batch.extend_lens)]
        windowed = {w: [(max(0, p - w + 1), _extend_mask(p, e, max(0, p - w + 1), w, device))
                        for p, e in zip(batch.prefix_lens, batch.extend_lens)] for w in batch.windows}
        for i, parents in enumerate(batch.tree or ()):
            if parents is not None:  # a draft tree: new token i sees the prefix, its ancestors and itself
                masks[i] = _tree_mask(batch, i, None, device)
                for w in batch.windows:
                    windowed[w][i] = (0, _tree_mask(batch, i, w, device))
        return _Extend(_starts(batch.extend_lens), _starts(batch.seq_lens), masks, windowed)

    @staticmethod
    def compilable(batch: AttentionBatch) -> bool:
        """Whether this step's attention can run inside a compiled graph (model.compiled): the plain decode
        path (fixed ops over an index matrix), not the shared-key one (shapes that depend on the data)."""
        return isinstance(batch.backend_data, _Decode)

    def _shared_decode(self, batch: AttentionBatch) -> _SharedDecode | None:
        if len(batch.prefix_lens) < 2:
            return None
        uniq, inverse = torch.unique(batch.slots, return_inverse=True)
        b, u = len(batch.prefix_lens), len(uniq)
        if 2 * u > len(batch.slots) or b * u > SHARED_MAX_SCORES:
            return None
        rows = torch.repeat_interleave(torch.arange(b, device=uniq.device),
                                       torch.tensor(batch.seq_lens, device=uniq.device))
        lens = torch.tensor(batch.seq_lens, device=uniq.device)
        pos = torch.arange(len(rows), device=uniq.device) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)

        def bias(keep: torch.Tensor | None) -> torch.Tensor:  # of the row positions in ``keep`` (all: None)
            member = torch.zeros(b, u, dtype=torch.bool, device=uniq.device)
            member[rows, inverse] = True if keep is None else keep
            out = torch.zeros(b, u, dtype=torch.float32, device=uniq.device).masked_fill_(~member, float("-inf"))
            return out.repeat_interleave(batch.group, dim=0)[None]

        # a slot that two rows share sits at different row positions: membership is per row, so each row's window
        return _SharedDecode(uniq, bias(None), {w: bias(pos >= lens[rows] - w) for w in batch.windows})

    def store_kv(self, k_pool, v_pool, batch, k, v) -> None:
        k_pool.index_copy_(0, batch.out_slots, k)
        v_pool.index_copy_(0, batch.out_slots, v)

    def extend(self, q, k, v, k_pool, v_pool, batch, scale, window=None, softcap=None):
        meta: _Extend = batch.backend_data
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        for i, (t0, s0, p, e) in enumerate(zip(meta.tok_starts, meta.slot_starts, batch.prefix_lens,
                                               batch.extend_lens)):
            first, mask = (0, meta.masks[i]) if window is None else meta.windowed[window][i]
            if p == 0 and isinstance(k_pool, torch.Tensor):  # the fresh K/V are the whole row: no gather (an
                # 8-bit pool's are read back: every read sees the codes, so caching never changes a token)
                ki, vi = k[t0 : t0 + e], v[t0 : t0 + e]
            else:
                row = batch.slots[s0 + first : s0 + p + e]
                ki, vi = k_pool.index_select(0, row), v_pool.index_select(0, row)
            ki, vi = (x.transpose(0, 1).repeat_interleave(group, dim=0)[None] for x in (ki, vi))  # [1, H, L, D]
            qi = q[t0 : t0 + e].transpose(0, 1)[None]
            if softcap is not None:
                o = capped_attention(qi, ki, vi, mask, scale, softcap)
            else:
                o = self._sdpa(qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=scale)
            out[t0 : t0 + e] = o[0].transpose(0, 1)
        return out

    def decode(self, q, k_pool, v_pool, batch, scale, window=None, softcap=None):
        meta = batch.backend_data
        if isinstance(meta, _SharedDecode):
            return self._decode_shared(q, k_pool, v_pool, meta, scale, window, softcap)
        b, h, d = q.shape
        shape = (*meta.index.shape, *k_pool.shape[1:])  # [B, L, kv_heads, D]
        k = k_pool.index_select(0, meta.index.flatten()).view(shape).transpose(1, 2)  # [B, kv_heads, L, D]
        v = v_pool.index_select(0, meta.index.flatten()).view(shape).transpose(1, 2)
        q = q.view(b, k.shape[1], h // k.shape[1], d)  # a group's query heads act as its query "tokens"
        mask = meta.mask if window is None else meta.windowed[window]
        if softcap is not None:
            o = capped_attention(q, k, v, mask, scale, softcap)
        else:
            o = self._sdpa(q, k, v, attn_mask=mask, scale=scale)
        return o.reshape(b, h, d)

    @staticmethod
    def _decode_shared(q, k_pool, v_pool, meta: _SharedDecode, scale, window, softcap):
        b, h, d = q.shape
        kvh = k_pool.shape[1]
        k = k_pool.index_select(0, meta.slots).permute(1, 2, 0).float()  # [KH, D, U]: every distinct key once
        v = v_pool.index_select(0, meta.slots).transpose(0, 1).float()  # [KH, U, D]
        qh = q.view(b, kvh, h // kvh, d).transpose(0, 1).reshape(kvh, -1, d).float()  # [KH, B*G, D]
        bias = meta.bias if window is None else meta.windowed[window]  # keeps each query to its row (window)
        if softcap is None:
            probs = torch.baddbmm(bias, qh, k, alpha=scale).softmax(-1)
        else:
            scores = torch.bmm(qh, k) * scale
            probs = (torch.tanh(scores / softcap) * softcap + bias).softmax(-1)
        out = torch.bmm(probs, v)  # [KH, B*G, D]
        return out.view(kvh, b, h // kvh, d).transpose(0, 1).reshape(b, h, d).to(q.dtype)
