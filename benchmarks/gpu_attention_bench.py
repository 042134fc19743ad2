"""GPU microbenchmark: the Triton extend/decode kernels vs torch SDPA over the same K/V gathered from the pool
(timed with and without the gather), and vs FlashAttention's varlen kernel if it is importable. bf16, GQA 3:1
(SmolLM2-like) and 4:1 at head dim 128. Run by benchmarks/gpu_check.sh."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.kernels import AttentionBatch, get_backend


def timed(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters  # ms


def batch_of(mode, prefix, extend, slots_total, be):
    total = sum(prefix) + sum(extend)
    slots = torch.randperm(slots_total - 1, device="cuda")[:total] + 1
    out, s = [], 0
    for p, e in zip(prefix, extend):
        out.append(slots[s + p : s + p + e])
        s += p + e
    b = AttentionBatch(mode, prefix, extend, slots, torch.cat(out), dtype=torch.bfloat16)
    b.backend_data = be.prepare(b)
    return b


def padded_kv(pool, batch, lens):
    L = max(lens)
    idx = torch.zeros(len(lens), L, dtype=torch.long, device="cuda")
    s = 0
    for i, n in enumerate(lens):
        idx[i, :n] = batch.slots[s : s + n]
        s += n
    return pool[idx].transpose(1, 2)  # [B, KH, L, D]


def main() -> None:
    be = get_backend("auto", torch.device("cuda"))
    print(f"backend: {be.name}; {torch.cuda.get_device_name()}")
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
        print("flash_attn not importable: FlashAttention column skipped")
    print(f"{'case':44} {'triton ms':>10} {'SDPA ms':>8} {'gather+SDPA ms':>15} {'flash ms':>9}")
    for h, kvh, d in ((9, 3, 64), (32, 8, 128)):
        slots_total = 1 << 20
        k_pool = torch.randn(slots_total, kvh, d, device="cuda", dtype=torch.bfloat16)
        v_pool = torch.randn_like(k_pool)
        for bsz, prefix, ext in ((8, 1024, 256), (32, 2048, 64), (4, 0, 2048)):
            pre, ex = [prefix] * bsz, [ext] * bsz
            batch = batch_of("extend", pre, ex, slots_total, be)
            q = torch.randn(sum(ex), h, d, device="cuda", dtype=torch.bfloat16)
            k, v = torch.randn(sum(ex), kvh, d, device="cuda", dtype=torch.bfloat16), None
            v = torch.randn_like(k)
            be.store_kv(k_pool, v_pool, batch, k, v)
            t_tri = timed(lambda: be.extend(q, k, v, k_pool, v_pool, batch, d**-0.5))
            lens = [p + e for p, e in zip(pre, ex)]
            kp, vp = padded_kv(k_pool, batch, lens), padded_kv(v_pool, batch, lens)
            qp = q.view(bsz, ext, h, d).transpose(1, 2)
            L = max(lens)
            mask = torch.arange(L, device="cuda")[None, :] <= (prefix + torch.arange(ext, device="cuda"))[:, None]
            sdpa = lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=True)  # noqa: E731
            t_sdpa = timed(sdpa)
            t_gather = timed(lambda: F.scaled_dot_product_attention(
                qp, padded_kv(k_pool, batch, lens), padded_kv(v_pool, batch, lens), attn_mask=mask, enable_gqa=True),
                iters=5)
            t_flash = float("nan")
            if flash_attn_varlen_func is not None:
                kc, vc = kp.transpose(1, 2).reshape(-1, kvh, d), vp.transpose(1, 2).reshape(-1, kvh, d)
                cq = torch.arange(0, (bsz + 1) * ext, ext, device="cuda", dtype=torch.int32)
                ck = torch.arange(0, (bsz + 1) * L, L, device="cuda", dtype=torch.int32)
                t_flash = timed(lambda: flash_attn_varlen_func(q, kc, vc, cq, ck, ext, L, causal=True))
            print(f"{f'extend h{h}/{kvh} d{d} B{bsz} prefix{prefix}+{ext}':44} {t_tri:>10.3f} {t_sdpa:>8.3f} "
                  f"{t_gather:>15.3f} {t_flash:>9.3f}")
        for bsz, seq in ((1, 8192), (32, 2048), (64, 4096)):
            batch = batch_of("decode", [seq - 1] * bsz, [1] * bsz, slots_total, be)
            q = torch.randn(bsz, h, d, device="cuda", dtype=torch.bfloat16)
            t_tri = timed(lambda: be.decode(q, k_pool, v_pool, batch, d**-0.5))
            kp, vp = padded_kv(k_pool, batch, [seq] * bsz), padded_kv(v_pool, batch, [seq] * bsz)
            t_sdpa = timed(lambda: F.scaled_dot_product_attention(q[:, :, None], kp, vp, enable_gqa=True))
            t_gather = timed(lambda: F.scaled_dot_product_attention(
                q[:, :, None], padded_kv(k_pool, batch, [seq] * bsz), padded_kv(v_pool, batch, [seq] * bsz),
                enable_gqa=True), iters=5)
            print(f"{f'decode h{h}/{kvh} d{d} B{bsz} seq{seq}':44} {t_tri:>10.3f} {t_sdpa:>8.3f} {t_gather:>15.3f} "
                  f"{'-':>9}")


if __name__ == "__main__":
    main()
