"""Torch attention path vs a plain softmax reference: ragged extend with and without prefixes, decode, GQA; sliding
windows and soft-capped scores (torch and batch-invariant backends)."""
from __future__ import annotations

import pytest
import torch

from radixserve.kernels import AttentionBatch, get_backend


def reference(q, k_rows, v_rows, prefix, window=None, softcap=None, scale=None):
    """q [e, H, D]; k_rows/v_rows [p+e, KH, D] (the whole row); bottom-right causal; ``window``: a query sees
    itself and the window - 1 keys before it; ``softcap``: scores c * tanh(s / c)."""
    e, h, d = q.shape
    rep = h // k_rows.shape[1]
    k = k_rows.repeat_interleave(rep, dim=1).double()
    v = v_rows.repeat_interleave(rep, dim=1).double()
    scores = torch.einsum("ehd,lhd->hel", q.double(), k) * (scale or d**-0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    pos, keys = prefix + torch.arange(e)[:, None], torch.arange(prefix + e)[None, :]
    mask = (keys <= pos) & ((keys > pos - window) if window else True)
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hel,lhd->ehd", scores.softmax(-1), v)


def make_batch(mode, prefix_lens, extend_lens, num_slots, backend, group=1, shared=0, windows=()):
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
    batch = AttentionBatch(mode, prefix_lens, extend_lens, slots, torch.cat(out), group=group, windows=windows)
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


@pytest.mark.parametrize("window,softcap", [(4, None), (None, 1.5), (3, 2.0), (1, None)],
                         ids=["window", "softcap", "both", "window of one"])
@pytest.mark.parametrize("name", ["torch", "batch-invariant"])
def test_window_and_softcap_match_reference(name, window, softcap):
    """Extend over cached prefixes longer and shorter than the window (and none), then decode with distinct rows
    and with a shared prefix: every output equals the reference's."""
    torch.manual_seed(2)
    d, heads, kv_heads, num_slots, scale = 16, 6, 2, 512, 0.3
    backend = get_backend(name, torch.device("cpu"))
    windows = (window, 7) if window else (7,)  # a second window in the model: each layer takes its own masks
    k_pool, v_pool = torch.randn(num_slots, kv_heads, d), torch.randn(num_slots, kv_heads, d)
    prefix_lens, extend_lens = [0, 2, 12, 30, 40], [9, 5, 4, 1, 300]  # 300: soft-capped scores in row blocks
    batch = make_batch("extend", prefix_lens, extend_lens, num_slots, backend, heads // kv_heads, windows=windows)
    n = sum(extend_lens)
    q, k, v = torch.randn(n, heads, d) * 3, torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
    backend.store_kv(k_pool, v_pool, batch, k, v)
    out = backend.extend(q, k, v, k_pool, v_pool, batch, scale, window=window, softcap=softcap)
    t = s = 0
    for p, e in zip(prefix_lens, extend_lens):
        row = batch.slots[s : s + p + e]
        ref = reference(q[t : t + e], k_pool[row], v_pool[row], p, window, softcap, scale)
        torch.testing.assert_close(out[t : t + e].double(), ref, atol=1e-5, rtol=1e-5)
        t, s = t + e, s + p + e
    for shared, prefix_lens in ((0, [0, 3, 40, 17]), (30, [40, 33, 31, 35])):
        batch = make_batch("decode", prefix_lens, [1] * 4, num_slots, backend, heads // kv_heads, shared, windows)
        q = torch.randn(4, heads, d) * 3
        out = backend.decode(q, k_pool, v_pool, batch, scale, window=window, softcap=softcap)
        s = 0
        for i, p in enumerate(prefix_lens):
            row = batch.slots[s : s + p + 1]
            ref = reference(q[i : i + 1], k_pool[row], v_pool[row], p, window, softcap, scale)
            torch.testing.assert_close(out[i : i + 1].double(), ref, atol=1e-5, rtol=1e-5)
            s += p + 1


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown attention backend .nope.; available: batch-invariant, torch, triton"):
        get_backend("nope", torch.device("cpu"))


def test_a_flash_kernel_refusing_the_cpu_falls_back_to_math(monkeypatch):
    """torch's bf16 flash kernel raises "pack_vnni2 is only supported when avx512 is supported" where its dispatch
    is held at AVX2 on an AMX CPU: extend then runs on the math kernel (same attention), other errors still raise."""
    import torch.nn.functional as F
    from radixserve.kernels import torch_backend

    torch.manual_seed(0)
    backend = get_backend("torch", torch.device("cpu"))
    batch = make_batch("extend", [0, 5], [7, 3], 64, backend)
    k_pool, v_pool = torch.randn(64, 2, 16), torch.randn(64, 2, 16)
    q, k, v = torch.randn(10, 4, 16), torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    backend.store_kv(k_pool, v_pool, batch, k, v)
    want = backend.extend(q, k, v, k_pool, v_pool, batch, 0.25)

    sdpa, kernels = F.scaled_dot_product_attention, []

    def flash_refuses(*args, **kw):
        math = not torch.backends.cuda.flash_sdp_enabled()  # the global switch sdpa_kernel(MATH) turns off
        kernels.append("math" if math else "flash")
        if not math:
            raise RuntimeError("pack_vnni2 is only supported when avx512 is supported")
        return sdpa(*args, **kw)

    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention", flash_refuses)
    got = backend.extend(q, k, v, k_pool, v_pool, batch, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert kernels == ["flash", "math", "math"] and backend.flash_refused  # tried once, then math for good

    backend = get_backend("torch", torch.device("cpu"))
    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention",
                        lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("out of memory")))
    with pytest.raises(RuntimeError, match="out of memory"):
        backend.extend(q, k, v, k_pool, v_pool, batch, 0.25)
