"""Triton kernels for attention over the slot pool (RadixAttention's third layer).

    extend     each request's new tokens attend to (a) its cached prefix, gathered from the pool through its slot
               row, then (b) causally to themselves (a draft tree's: to their ancestors, TREE); one online
               softmax across both parts; ragged, no padding
    decode     one query per request over its whole row, split into chunks (split-KV) computed in parallel and
               merged by a second kernel with their log-sum-exps
    store_kv   new K/V rows into the pool at their slots

Per layer: ``window`` (0: none) masks the keys before each query's sliding window, and the key blocks wholly
before it are not visited; ``SOFTCAP`` (constexpr) caps the scaled scores at ``softcap * tanh(s / softcap)``
before the mask (Gemma 2).

Pool layout: ``[num_slots, kv_heads, head_dim]`` per layer (page size 1). GQA: query head h reads kv head
h // GROUP. ``F32`` (constexpr): compute tiles in float32 -- used for float32 inputs and under the CPU
interpreter, which gets bf16 arithmetic wrong; otherwise dot products run in the input dtype with float32
accumulation.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _capped(qk, softcap, SOFTCAP: tl.constexpr):
    """softcap * tanh(qk / softcap), tanh as 1 - 2 / (exp(2x) + 1) (exact at both ends: exp overflows to inf)."""
    if SOFTCAP:
        qk = softcap * (1.0 - 2.0 / (tl.exp(2.0 * qk / softcap) + 1.0))
    return qk


@triton.jit
def _online_update(m_i, l_i, acc, qk, v, F32: tl.constexpr):
    """One block of the online softmax: fold scores ``qk`` [M, N] and values ``v`` [N, D] into (m, l, acc)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet stay all-zero
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if F32:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def extend_kernel(Q, K_new, V_new, K_pool, V_pool, Out, Slots, SeqStart, QoStart, PrefixLen, ExtendLen, sm_scale,
                  window, softcap, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ks,
                  stride_kph, stride_vs, stride_vph, stride_ot, stride_oh, Tree, TreeStart, NewPos,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, F32: tl.constexpr, SOFTCAP: tl.constexpr, TREE: tl.constexpr):
    req, head, mblock = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ext = tl.load(ExtendLen + req)
    if mblock * BLOCK_M >= ext:
        return
    prefix = tl.load(PrefixLen + req)
    qo = tl.load(QoStart + req)
    row = tl.load(SeqStart + req)  # where this request's slot row starts in Slots
    kvh = head // GROUP
    offs_m = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m, mask_d = offs_m < ext, offs_d < HEAD_DIM
    q = tl.load(Q + (qo + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if F32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # a draft tree (TREE, where TreeStart[req] >= 0): query i is at position prefix + NewPos[i] (its depth - 1)
    # and sees the new tokens Tree[i, :] marks (its ancestors and itself); otherwise at prefix + i, causally
    if TREE:
        tree = tl.load(TreeStart + req)
        pos_m = tl.load(NewPos + qo + offs_m, mask=mask_m, other=0)
    else:
        tree = -1
        pos_m = offs_m
    # (a) the cached prefix, read from the pool through the slot row; with a window, from the block holding the
    # first key the block's first query sees (query i, at position prefix + i, sees keys > prefix + i - window)
    first = tl.where((window > 0) & (tree < 0), tl.maximum(prefix + mblock * BLOCK_M - window + 1, 0), 0)
    for start in range(first // BLOCK_N * BLOCK_N, prefix, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < prefix
        slot = tl.load(Slots + row + offs_n, mask=mask_n, other=0)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K_pool + slot[:, None] * stride_ks + kvh * stride_kph + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V_pool + slot[:, None] * stride_vs + kvh * stride_vph + offs_d[None, :], mask=kv_mask, other=0.0)
        if F32:
            k, v = k.to(tl.float32), v.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
        else:
            qk = tl.dot(q, tl.trans(k)) * sm_scale
        seen = mask_n[None, :] & ((window == 0) | (offs_n[None, :] > prefix + pos_m[:, None] - window))
        qk = tl.where(seen, _capped(qk, softcap, SOFTCAP), float("-inf"))
        m_i, l_i, acc = _online_update(m_i, l_i, acc, qk, v, F32)
    # (b) the new tokens, causally: query i sees new tokens 0..i
    end = tl.minimum(ext, (mblock + 1) * BLOCK_M)
    for start in range(0, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < ext
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K_new + (qo + offs_n)[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=kv_mask,
                    other=0.0)
        v = tl.load(V_new + (qo + offs_n)[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=kv_mask,
                    other=0.0)
        if F32:
            k, v = k.to(tl.float32), v.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
        else:
            qk = tl.dot(q, tl.trans(k)) * sm_scale
        causal = (offs_m[:, None] >= offs_n[None, :]) & mask_n[None, :]
        pos_n = offs_n
        if TREE:
            in_tree = mask_m[:, None] & mask_n[None, :] & (offs_m[:, None] * 0 + tree >= 0)
            marked = tl.load(Tree + tl.maximum(tree, 0) + offs_m[:, None] * ext + offs_n[None, :], mask=in_tree,
                             other=0)
            causal = tl.where(tree >= 0, (marked != 0) & mask_n[None, :], causal)
            pos_n = tl.load(NewPos + qo + offs_n, mask=mask_n, other=0)
        causal = causal & ((window == 0) | (pos_n[None, :] > pos_m[:, None] - window))
        qk = tl.where(causal, _capped(qk, softcap, SOFTCAP), float("-inf"))
        m_i, l_i, acc = _online_update(m_i, l_i, acc, qk, v, F32)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(Out + (qo + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def decode_split_kernel(Q, K_pool, V_pool, Slots, SeqStart, SeqLen, MidO, MidLse, sm_scale, window, softcap,
                        stride_qb, stride_qh, stride_ks, stride_kph, stride_vs, stride_vph,
                        stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                        NUM_SPLITS: tl.constexpr, SOFTCAP: tl.constexpr):
    """Stage 1: query (b, h) over chunk s of its row (of its window: the last ``window`` positions); writes the
    chunk's normalised output and log-sum-exp."""
    b, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(SeqLen + b)
    row = tl.load(SeqStart + b)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    chunk = tl.cdiv(seq_len - first, NUM_SPLITS)
    start, end = first + split * chunk, tl.minimum(first + (split + 1) * chunk, seq_len)
    kvh = head // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + head * stride_qh + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slot = tl.load(Slots + row + offs_n, mask=mask_n, other=0)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K_pool + slot[:, None] * stride_ks + kvh * stride_kph + offs_d[None, :], mask=kv_mask,
                    other=0.0).to(tl.float32)
        v = tl.load(V_pool + slot[:, None] * stride_vs + kvh * stride_vph + offs_d[None, :], mask=kv_mask,
                    other=0.0).to(tl.float32)
        qk = tl.where(mask_n, _capped(tl.sum(q[None, :] * k, 1) * sm_scale, softcap, SOFTCAP), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    has = end > start
    out = tl.where(has, acc / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(MidO + b * stride_mb + head * stride_mh + split * stride_ms + offs_d, out, mask=mask_d)
    tl.store(MidLse + b * stride_lb + head * stride_lh + split, lse)


@triton.jit
def decode_merge_kernel(MidO, MidLse, Out, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob,
                        stride_oh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Stage 2: merge the chunks of query (b, h), weighting each by exp(its log-sum-exp)."""
    b, head = tl.program_id(0), tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_s = tl.arange(0, NUM_SPLITS)
    lse = tl.load(MidLse + b * stride_lb + head * stride_lh + offs_s)
    m = tl.max(lse, 0)
    w = tl.exp(lse - m)  # empty chunks have lse -inf: weight 0
    o = tl.load(MidO + b * stride_mb + head * stride_mh + offs_s[:, None] * stride_ms + offs_d[None, :],
                mask=mask_d[None, :], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(Out + b * stride_ob + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


@triton.jit
def store_kv_kernel(K, V, K_pool, V_pool, OutSlots, stride_kt, stride_kh, stride_vt, stride_vh, stride_ks,
                    stride_kph, stride_vs, stride_vph, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token t's K/V (all kv heads) into the pool row of its slot."""
    t = tl.program_id(0)
    slot = tl.load(OutSlots + t)
    offs_h, offs_d = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
    mask = (offs_h < KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(K_pool + slot * stride_ks + offs_h[:, None] * stride_kph + offs_d[None, :], k, mask=mask)
    tl.store(V_pool + slot * stride_vs + offs_h[:, None] * stride_vph + offs_d[None, :], v, mask=mask)
