"""Batch-invariant attention over the slot pool (``--deterministic``, CPU): every query row's output depends only on
its own query and its own keys, never on what else is in the batch, how long the other rows are, whether its
prefix came from the cache or was computed in this step, or where a chunked prefill was cut.

How: one function, ``attend``, serves extend and decode alike, in float32. A query at position i reads its keys
0..i in fixed chunks of CHUNK keys aligned to absolute positions (chunk c = keys [c*CHUNK, (c+1)*CHUNK)):

    scores  s = q . k            one [M, D] x [D, CHUNK] product per chunk (M >= 2: see below)
    row max m = max over every key of the row (exact: max does not round)
    chunk   p = exp(s - m), l_c = sum(p), o_c = p . v      (a [M, CHUNK] x [CHUNK, D] product)
    merge   o = tree_sum(o_c) / tree_sum(l_c)               pairwise, over a power-of-two count of chunks

Keys beyond i -- later tokens of the same extend, padding to the batch's longest row or to a whole chunk -- get a
score of -inf, so p = 0 and they add exact zeros; whole chunks of them leave the pairwise tree's grouping of the
real chunks unchanged. What remains is that one matrix product computes a row the same way whatever the number
of rows M: true of this CPU's float32 GEMM for M >= 2 (a single row takes a GEMV path that rounds differently),
so a lone row is computed as a pair. The runner checks all of this at start-up (``model.determinism``).

A sliding window is more of the same: the keys before a query's window get -inf too, so whole chunks of them add
exact zeros, and every key is still read in its absolute chunk (a window's bias covers all of a row's keys). A
soft-cap (c * tanh(s / c)) is applied to each score on its own, before the mask: nothing in it depends on the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.kernels.base import AttentionBatch

CHUNK = 128  # keys per chunk: fixed, so a key's chunk depends on its position only
QUERY_BLOCK = 128  # extend queries per product: rows are independent, so blocking changes nothing, and a block
# reads only the chunks up to its last query (causal): the chunks it skips would only have added exact zeros
NEG_INF = float("-inf")


def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` pairwise, first half + second half, after padding to a power of two with zeros: extra
    zero entries (a row's padding) fold away at the first level, so the grouping of the others never changes."""
    n = x.shape[dim]
    size = 1 << max(0, (n - 1).bit_length())
    if size > n:
        pad = list(x.shape)
        pad[dim] = size - n
        x = torch.cat([x, x.new_zeros(pad)], dim=dim)
    while x.shape[dim] > 1:
        half = x.shape[dim] // 2
        x = x.narrow(dim, 0, half) + x.narrow(dim, half, half)
    return x.squeeze(dim)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
           softcap: float | None = None) -> torch.Tensor:
    """``q``: float32 ``[B, KH, M, D]``, already scaled; ``k``/``v``: float32 ``[B, KH, L, D]`` with L a multiple of
    CHUNK; ``bias``: float32 ``[B, M, L']``, 0 where a key may be read and -inf where not, for the *last* L' keys
    (a multiple of CHUNK; the keys before them are read by every row -- adding 0 to them would change nothing).
    Every row reads at least one key. ``softcap``: scores become softcap * tanh(score / softcap) before the bias.
    Returns ``[B, KH, M, D]``."""
    b, kh, m, d = q.shape
    if m == 1:  # a lone row would take the GEMV path: compute it as a pair, keep one
        return attend(q.expand(b, kh, 2, d), k, v, bias.expand(b, 2, -1), softcap)[:, :, :1]
    nc, masked = k.shape[2] // CHUNK, bias.shape[-1] // CHUNK
    kc = k.view(b, kh, nc, CHUNK, d)
    s = torch.matmul(q[:, :, None], kc.transpose(-1, -2))  # [B, KH, C, M, CHUNK]
    if softcap is not None:
        s = s.div_(softcap).tanh_().mul_(softcap)
    s[:, :, nc - masked :] += bias.reshape(b, 1, m, masked, CHUNK).transpose(2, 3)
    p = s.sub_(s.amax(dim=(2, 4), keepdim=True)).exp_()  # in place: the same operations, no new buffers
    out = torch.matmul(p, v.view(b, kh, nc, CHUNK, d))  # [B, KH, C, M, D]
    return tree_sum(out, 2) / tree_sum(p.sum(-1), 2)[..., None]


def _padded(n: int) -> int:
    return -(-n // CHUNK) * CHUNK


def _bias(seen: torch.Tensor) -> torch.Tensor:
    return torch.zeros(seen.shape, device=seen.device).masked_fill_(~seen, NEG_INF)


@dataclass
class _Rows:
    """One product's worth of work: R requests read their L keys through ``index`` (dummy slot 0 where padded)
    under ``bias``; their queries are tokens [tok_start, tok_start + R * tokens) of the batch."""

    index: torch.Tensor  # [R, L] slots
    bias: torch.Tensor  # [R, tokens, L'] float32 over the last L' keys (the ones some query may not read)
    tok_start: int
    tokens: int  # query tokens per row (1 when decoding)
    windowed: dict[int, torch.Tensor]  # window -> [R, tokens, L] float32 over every key: also -inf before it
    rows: torch.Tensor | None = None  # [R * KH * L]: rows of the pool seen as [slots * KH, D], in [R, KH, L] order

    def gather(self, pool: torch.Tensor) -> torch.Tensor:
        """float32 ``[R, KH, L, D]`` from one layer's ``[slots, KH, D]`` pool: one gather, one conversion."""
        r, width = self.index.shape
        kh, d = pool.shape[1:]
        if self.rows is None:  # the same for every layer of the step: built once
            heads = torch.arange(kh, device=pool.device)
            self.rows = (self.index[:, None, :] * kh + heads[None, :, None]).flatten()
        return pool.view(-1, d).index_select(0, self.rows).view(r, kh, width, d).float()


class BatchInvariantAttention:
    name = "batch-invariant"

    def prepare(self, batch: AttentionBatch) -> list[_Rows]:
        device = batch.slots.device
        out, slot_at, tok_at = [], 0, 0
        if batch.mode == "decode":  # every request one query: all in one product, keys padded to the longest row
            lens = torch.tensor(batch.seq_lens, device=device)
            width = _padded(int(lens.max()))
            real = torch.arange(width, device=device)[None, :] < lens[:, None]
            index = torch.zeros(real.shape, dtype=torch.int64, device=device)
            index[real] = batch.slots
            pos = torch.arange(width, device=device)[None, :]
            bias = {w: _bias(real & (pos >= lens[:, None] - w))[:, None, :] for w in batch.windows}
            return [_Rows(index, _bias(real)[:, None, :], 0, 1, bias)]
        for p, e in zip(batch.prefix_lens, batch.extend_lens):  # a request at a time, its queries in blocks
            row = batch.slots[slot_at : slot_at + p + e]
            index = torch.zeros(_padded(p + e), dtype=torch.int64, device=device)
            index[: p + e] = row
            for t0 in range(0, e, QUERY_BLOCK):
                t1 = min(e, t0 + QUERY_BLOCK)
                width = _padded(p + t1)  # the block's last query reads keys 0 .. p + t1 - 1
                seen = (p + t0 + 1) // CHUNK * CHUNK  # keys 0 .. seen - 1: every query of the block reads them
                keys = torch.arange(width, device=device)[None, :]
                pos = p + torch.arange(t0, t1, device=device)[:, None]  # query token t sits at position p + t
                windowed = {w: _bias((keys <= pos) & (keys > pos - w))[None] for w in batch.windows}
                out.append(_Rows(index[None, :width], _bias(keys[:, seen:] <= pos)[None], tok_at + t0, t1 - t0,
                                 windowed))
            slot_at += p + e
            tok_at += e
        return out

    def store_kv(self, k_pool, v_pool, batch, k, v) -> None:
        k_pool.index_copy_(0, batch.out_slots, k)
        v_pool.index_copy_(0, batch.out_slots, v)

    def extend(self, q, k, v, k_pool, v_pool, batch, scale, window=None, softcap=None):
        # the new K/V are in the pool already: read them there
        return self._run(q, k_pool, v_pool, batch, scale, window, softcap)

    def decode(self, q, k_pool, v_pool, batch, scale, window=None, softcap=None):
        return self._run(q, k_pool, v_pool, batch, scale, window, softcap)

    @staticmethod
    def _run(q, k_pool, v_pool, batch: AttentionBatch, scale: float, window: int | None,
             softcap: float | None) -> torch.Tensor:
        _, h, d = q.shape
        kh = k_pool.shape[1]
        g = h // kh
        out = torch.empty_like(q)
        for w in batch.backend_data:
            r = w.index.shape[0]
            rows = q[w.tok_start : w.tok_start + r * w.tokens].float() * scale  # [R * T, H, D]
            # queries grouped under their kv head: [R, KH, T * G, D], the T * G rows of one product
            qg = rows.view(r, w.tokens, kh, g, d).permute(0, 2, 1, 3, 4).reshape(r, kh, w.tokens * g, d)
            bias = w.bias if window is None else w.windowed[window]
            bias = bias.repeat_interleave(g, dim=1)  # each token's mask, once per query head of the group
            o = attend(qg, w.gather(k_pool), w.gather(v_pool), bias, softcap)  # [R, KH, T * G, D]
            o = o.view(r, kh, w.tokens, g, d).permute(0, 2, 1, 3, 4).reshape(r * w.tokens, h, d)
            out[w.tok_start : w.tok_start + r * w.tokens] = o.to(q.dtype)
        return out
