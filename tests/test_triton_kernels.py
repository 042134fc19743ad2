"""Triton attention kernels vs the torch path and a plain softmax reference. On a CPU they run under the Triton
interpreter (conftest sets TRITON_INTERPRET=1 before anything imports triton); on a GPU, on the GPU.
`pytest -k triton` selects them."""
from __future__ import annotations

import pytest
import torch

from radixserve.kernels import AttentionBatch, get_backend

from test_kernels_torch import reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CASES = {  # name: (prefix_lens, extend_lens)
    "empty prefixes, ragged": ([0, 0, 0], [5, 17, 1]),
    "one-token prefix": ([1, 1], [3, 20]),
    "long prefix": ([70, 3], [4, 2]),
    "single new token": ([9, 0, 33], [1, 1, 1]),
    "mixed": ([0, 1, 40, 16], [19, 1, 7, 16]),
}
HEADS = {"mha": (4, 4), "gqa-3": (6, 2), "gqa-4": (8, 2)}


def make_batch(mode, prefix_lens, extend_lens, num_slots, backend, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(prefix_lens) + sum(extend_lens)
    slots = (torch.randperm(num_slots - 1, generator=g)[:total] + 1).to(DEVICE)
    out, s = [], 0
    for p, e in zip(prefix_lens, extend_lens):
        out.append(slots[s + p : s + p + e])
        s += p + e
    batch = AttentionBatch(mode, list(prefix_lens), list(extend_lens), slots, torch.cat(out), dtype=dtype)
    batch.backend_data = backend.prepare(batch)
    return batch


def tensors(n, heads, kv_heads, d, num_slots, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(DEVICE)  # noqa: E731
    return (mk(n, heads, d), mk(n, kv_heads, d), mk(n, kv_heads, d), mk(num_slots, kv_heads, d),
            mk(num_slots, kv_heads, d))


TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_triton_extend_matches_torch_and_reference(case, heads, dtype):
    prefix_lens, extend_lens = CASES[case]
    h, kvh = HEADS[heads]
    d, num_slots = 64, 256
    triton_be, torch_be = get_backend("triton", DEVICE), get_backend("torch", DEVICE)
    q, k, v, k_pool, v_pool = tensors(sum(extend_lens), h, kvh, d, num_slots, dtype)
    got_pool = (k_pool.clone(), v_pool.clone())
    batch = make_batch("extend", prefix_lens, extend_lens, num_slots, triton_be, dtype)
    triton_be.store_kv(*got_pool, batch, k, v)
    torch_be.store_kv(k_pool, v_pool, batch, k, v)
    assert torch.equal(got_pool[0], k_pool) and torch.equal(got_pool[1], v_pool), "store_kv writes the same rows"
    out = triton_be.extend(q, k, v, *got_pool, batch, d**-0.5)
    batch.backend_data = torch_be.prepare(batch)
    if dtype != torch.bfloat16 or DEVICE.type == "cuda":  # the torch path on CPU in bf16 is its own rounding story
        want = torch_be.extend(q, k, v, k_pool, v_pool, batch, d**-0.5)
        torch.testing.assert_close(out.float(), want.float(), atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)
    t = s = 0
    for p, e in zip(prefix_lens, extend_lens):
        row = batch.slots[s : s + p + e]
        ref = reference(q[t : t + e].cpu().float(), k_pool[row].cpu().float(), v_pool[row].cpu().float(), p)
        torch.testing.assert_close(out[t : t + e].cpu().double(), ref, atol=TOL[dtype] * 5, rtol=TOL[dtype] * 5)
        t, s = t + e, s + p + e


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("seq_lens", [[1, 2, 17], [300, 5], [600]], ids=["short", "one split of two", "splits"])
def test_triton_decode_split_kv_matches_reference(seq_lens, heads, dtype):
    h, kvh = HEADS[heads]
    d, num_slots = 64, 1024
    be = get_backend("triton", DEVICE)
    prefix_lens = [n - 1 for n in seq_lens]
    q, _, _, k_pool, v_pool = tensors(len(seq_lens), h, kvh, d, num_slots, dtype, seed=2)
    batch = make_batch("decode", prefix_lens, [1] * len(seq_lens), num_slots, be, dtype, seed=3)
    if max(seq_lens) > 256:
        assert batch.backend_data.num_splits > 1, "long rows are split across programs"
    out = be.decode(q, k_pool, v_pool, batch, d**-0.5)
    s = 0
    for i, n in enumerate(seq_lens):
        row = batch.slots[s : s + n]
        ref = reference(q[i : i + 1].cpu().float(), k_pool[row].cpu().float(), v_pool[row].cpu().float(), n - 1)
        torch.testing.assert_close(out[i : i + 1].cpu().double(), ref, atol=TOL[dtype] * 5, rtol=TOL[dtype] * 5)
        s += n


@pytest.mark.parametrize("window,softcap", [(5, None), (None, 1.5), (20, 2.0)], ids=["window", "softcap", "both"])
def test_triton_window_and_softcap_match_reference(window, softcap):
    """Extend: prefixes longer than the window (whole key blocks skipped), shorter, none; decode: rows shorter than
    the window and one whose window spans several splits. float32."""
    h, kvh, d, num_slots, scale = 4, 2, 32, 1024, 0.3
    be = get_backend("triton", DEVICE)
    prefix_lens, extend_lens = [40, 3, 0], [20, 6, 17]
    q, k, v, k_pool, v_pool = tensors(sum(extend_lens), h, kvh, d, num_slots, torch.float32)
    q = q * 3
    batch = make_batch("extend", prefix_lens, extend_lens, num_slots, be, torch.float32)
    be.store_kv(k_pool, v_pool, batch, k, v)
    out = be.extend(q, k, v, k_pool, v_pool, batch, scale, window=window, softcap=softcap)
    t = s = 0
    for p, e in zip(prefix_lens, extend_lens):
        row = batch.slots[s : s + p + e]
        ref = reference(q[t : t + e].cpu(), k_pool[row].cpu(), v_pool[row].cpu(), p, window, softcap, scale)
        torch.testing.assert_close(out[t : t + e].cpu().double(), ref, atol=1e-4, rtol=1e-4)
        t, s = t + e, s + p + e
    seq_lens = [3, 30, 600]
    q, *_ = tensors(len(seq_lens), h, kvh, d, num_slots, torch.float32, seed=4)
    batch = make_batch("decode", [n - 1 for n in seq_lens], [1] * 3, num_slots, be, torch.float32, seed=5)
    out = be.decode(q, k_pool, v_pool, batch, scale, window=window, softcap=softcap)
    s = 0
    for i, n in enumerate(seq_lens):
        row = batch.slots[s : s + n]
        ref = reference(q[i : i + 1].cpu(), k_pool[row].cpu(), v_pool[row].cpu(), n - 1, window, softcap, scale)
        torch.testing.assert_close(out[i : i + 1].cpu().double(), ref, atol=1e-4, rtol=1e-4)
        s += n


def test_triton_backend_runs_gemma2_like_hf(arch_models):
    """A whole Gemma 2 (a window of 5 on layer 0, soft-capped scores, its own scale) on the Triton backend: greedy
    tokens equal HF's, again through cached prefixes."""
    from transformers import AutoModelForCausalLM

    from radixserve import Engine

    path = arch_models["gemma2"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = [list(range(500, 512)), list(range(500, 509)) + [40]]
    engine = Engine(str(path), dtype="float32", attention_backend="triton", check_invariants=True)
    params = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    first = engine.generate(input_ids=prompts, sampling_params=params)
    second = engine.generate(input_ids=prompts, sampling_params=params)
    for p, a, b in zip(prompts, first, second):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False)[0, len(p):]
        assert a["output_ids"] == b["output_ids"] == ref.tolist()
    assert second[0]["meta_info"]["cached_tokens"] == len(prompts[0]) - 1


def test_triton_head_dim_128():
    be = get_backend("triton", DEVICE)
    q, k, v, k_pool, v_pool = tensors(6, 4, 2, 128, 64, torch.float32)
    batch = make_batch("extend", [5, 0], [2, 4], 64, be, torch.float32)
    be.store_kv(k_pool, v_pool, batch, k, v)
    out = be.extend(q, k, v, k_pool, v_pool, batch, 128**-0.5)
    row = batch.slots[:7]
    ref = reference(q[:2].cpu(), k_pool[row].cpu(), v_pool[row].cpu(), 5)
    torch.testing.assert_close(out[:2].cpu().double(), ref, atol=1e-4, rtol=1e-4)


def test_triton_is_chosen_automatically_on_cuda():
    """The code path: 'auto' gives Triton for a CUDA device and torch for the CPU (no GPU needed to check)."""
    assert get_backend("auto", torch.device("cuda")).name == "triton"
    assert get_backend("auto", torch.device("cpu")).name == "torch"


def test_triton_backend_in_the_engine_matches_hf(tiny_models, hf_models):
    """The whole model on the Triton backend (interpreted on a CPU): greedy tokens equal HF's, with prefix reuse."""
    from radixserve import Engine

    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 9, 10, 30], [40, 41]]
    engine = Engine(str(tiny_models["llama"]), dtype="float32", attention_backend="triton", check_invariants=True)
    assert engine.runner.attn.name == "triton"
    params = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    first = engine.generate(input_ids=prompts, sampling_params=params)
    second = engine.generate(input_ids=prompts, sampling_params=params)  # now through cached prefixes
    for p, a, b in zip(prompts, first, second):
        with torch.no_grad():
            ref = hf_models["llama"].generate(torch.tensor([p]), max_new_tokens=5, do_sample=False)[0, len(p):]
        assert a["output_ids"] == b["output_ids"] == ref.tolist()
    assert second[0]["meta_info"]["cached_tokens"] == len(prompts[0]) - 1
