"""Torch attention path vs a plain softmax reference: ragged extend with and without prefixes, decode, GQA."""
from __future__ import annotations

import pytest
import torch

from radixserve.kernels import AttentionBatch, get_backend


def reference(q, k_rows, v_rows, prefix):
    """q [e, H, D]; k_rows/v_rows [p+e, KH, D] (the whole row); bottom-right causal."""
    e, h, d = q.shape
    rep = h // k_rows.shape[1]
    k = k_rows.repeat_interleave(rep, dim=1).double()
    v = v_rows.repeat_interleave(rep, dim=1).double()
    scores = torch.einsum("ehd,lhd->hel", q.double(), k) / d**0.5
    mask = torch.arange(prefix + e)[None, :] <= prefix + torch.arange(e)[:, None]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hel,lhd->ehd", scores.softmax(-1), v)


def make_batch(mode, prefix_lens, extend_lens, num_slots, backend, group=1, shared=0):
    """Rows of random distinct slots; with ``shared`` > 0 every row starts with the same ``shared`` slots."""
    total = sum(prefix_lens) + sum(extend_lens)
    slots = torch.randperm(num_slots - 1)[:total] + 1  # any slots, never the dummy 0
    if shared:
        rows, s = [], 0
        for p, e in zip(prefix_lens, extend_lens):
            row = slots[s : s + p + e].clone()
            row[:shared] = slots[:shared]
            rows.append(row)
            s += p + e
        slots = torch.cat(rows)
    out, s = [], 0
    for p, e in zip(prefix_lens, extend_lens):
        out.append(slots[s + p : s + p + e])
        s += p + e
    batch = AttentionBatch(mode, prefix_lens, extend_lens, slots, torch.cat(out), group=group)
    batch.backend_data = backend.prepare(batch)
    return batch


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("prefix_lens,extend_lens", [([0, 5, 1, 12], [7, 1, 3, 4]), ([0], [1]), ([9], [1])])
def test_extend_matches_reference(heads, kv_heads, prefix_lens, extend_lens):
    torch.manual_seed(0)
    d, num_slots = 16, 128
    backend = get_backend("torch", torch.device("cpu"))
    batch = make_batch("extend", prefix_lens, extend_lens, num_slots, backend)
    k_pool, v_pool = torch.randn(num_slots, kv_heads, d), torch.randn(num_slots, kv_heads, d)
    n = sum(extend_lens)
    q, k, v = torch.randn(n, heads, d), torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
    backend.store_kv(k_pool, v_pool, batch, k, v)
    out = backend.extend(q, k, v, k_pool, v_pool, batch, d**-0.5)
    t = s = 0
    for p, e in zip(prefix_lens, extend_lens):
        row = batch.slots[s : s + p + e]
        ref = reference(q[t : t + e], k_pool[row], v_pool[row], p)
        torch.testing.assert_close(out[t : t + e].double(), ref, atol=1e-5, rtol=1e-5)
        t, s = t + e, s + p + e


@pytest.mark.parametrize("shared", [0, 30], ids=["distinct rows", "shared prefix"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (9, 3)])
def test_decode_matches_reference(heads, kv_heads, shared):
    torch.manual_seed(1)
    d, num_slots = 16, 256
    prefix_lens = [0, 3, 40, 17] if not shared else [40, 33, 31, 35]
    backend = get_backend("torch", torch.device("cpu"))
    batch = make_batch("decode", prefix_lens, [1] * 4, num_slots, backend, heads // kv_heads, shared)
    assert (type(batch.backend_data).__name__ == "_SharedDecode") == bool(shared)
    k_pool, v_pool = torch.randn(num_slots, kv_heads, d), torch.randn(num_slots, kv_heads, d)
    q = torch.randn(4, heads, d)
    out = backend.decode(q, k_pool, v_pool, batch, d**-0.5)
    s = 0
    for i, p in enumerate(prefix_lens):
        row = batch.slots[s : s + p + 1]
        ref = reference(q[i : i + 1], k_pool[row], v_pool[row], p)
        torch.testing.assert_close(out[i : i + 1].double(), ref, atol=1e-5, rtol=1e-5)
        s += p + 1


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown attention backend .nope.; available: batch-invariant, torch, triton"):
        get_backend("nope", torch.device("cpu"))
