"""--deterministic: a request's tokens do not depend on what else is batched with it (bf16 and fp32).

From the parts up, for both implementations of the invariant ops (C++ and row-by-row torch): a linear layer's,
a norm's, an activation's and an attention row are bitwise the same in any batch; the runner's start-up check
refuses kernels that are not; and through the Engine and the server, the same prompts alone and
inside batches of 1, 7, 32 and 64 mixed requests (other lengths, shared prefixes that the radix cache serves,
chunked prefill, a pool small enough to retract) give identical tokens, greedy and seeded.
"""
from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import torch
import torch.nn.functional as F

from conftest import ServerProcess
from radixserve import Engine
from radixserve.kernels.cpp_build import default_cache_dir
from radixserve.kernels.invariant import RowByRow, invariant_ops


@pytest.fixture(scope="module", params=["cpp", "torch-row-by-row"])
def ops(request):
    """Both implementations of the invariant ops: the C++ kernels (where this machine builds them) and the
    row-by-row torch fallback."""
    if request.param == "torch-row-by-row":
        return RowByRow()
    cpp = invariant_ops(default_cache_dir())
    if cpp.name != "cpp":
        pytest.skip("the C++ invariant kernels do not build here (RADIXSERVE_NATIVE=0 or no compiler)")
    return cpp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_do_not_depend_on_how_many_rows_are_computed(ops, dtype):
    torch.manual_seed(0)
    w = (torch.randn(576, 1544) * 0.05).to(dtype)  # K not a multiple of the 16 lanes: the tail is exercised
    bias = torch.randn(576)
    x = torch.randn(300, 1544).to(dtype)
    alone = torch.cat([ops.linear(x[i : i + 1], w, bias) for i in range(300)])
    for m in (2, 3, 7, 16, 17, 31, 64, 65, 150, 201, 300):
        assert torch.equal(ops.linear(x[:m], w, bias), alone[:m]), m
        assert torch.equal(ops.linear(x[300 - m :], w, bias), alone[300 - m :]), f"rows at another place, {m}"
    reference = x.double() @ w.double().T + bias.double()
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-4}  # bf16: its rounding
    assert torch.allclose(alone.double(), reference, **tolerance)


def test_rows_norms_and_activations_do_not_depend_on_the_batch(ops):
    torch.manual_seed(1)
    x, gate, up = torch.randn(70, 576), torch.randn(70, 1536) * 4, torch.randn(70, 1536)
    for fn, want in ((lambda a: ops.rms_normalize(a, 1e-5), F.rms_norm(x, (576,), eps=1e-5)),):
        alone = torch.cat([fn(x[i : i + 1]) for i in range(70)])
        assert torch.equal(fn(x), alone) and torch.equal(fn(x[5:40]), alone[5:40])
        assert torch.allclose(alone, want, atol=1e-5)
    for act, ref in (("silu", F.silu), ("gelu_pytorch_tanh", lambda a: F.gelu(a, approximate="tanh"))):
        alone = torch.cat([ops.act_mul(act, gate[i : i + 1], up[i : i + 1]) for i in range(70)])
        assert torch.equal(ops.act_mul(act, gate[3:50], up[3:50]), alone[3:50])
        assert torch.allclose(alone, ref(gate) * up, atol=1e-5)
    alone = torch.cat([ops.tanh(gate[i : i + 1]) for i in range(70)])
    assert torch.equal(ops.tanh(gate[:33]), alone[:33]) and torch.allclose(alone, torch.tanh(gate), atol=1e-6)


def reference(q, k, v, scale, softcap=None):
    s = (q.double() @ k.double().T) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    return (s.softmax(-1) @ v.double()).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_an_attention_row_is_the_same_in_every_batch_and_correct(ops, dtype, softcap):
    torch.manual_seed(0)
    slots, kv_heads, heads, d = 400, 2, 6, 64
    k_pool, v_pool = torch.randn(slots, kv_heads, d).to(dtype), torch.randn(slots, kv_heads, d).to(dtype)
    row = torch.randperm(slots)[:300]  # a request's slots, scattered over the pool
    q = torch.randn(6, heads, d).to(dtype)
    first, length = torch.tensor([0, 0, 10, 0, 299, 40]), torch.tensor([300, 1, 5, 130, 1, 200])

    def run(rows: list[int]) -> torch.Tensor:
        return ops.attention(q[rows], k_pool, v_pool, row, first[rows], length[rows], 0.125, softcap)

    together = run(list(range(6)))
    for r in range(6):
        assert torch.equal(run([r]), together[r : r + 1]), f"row {r} alone"
        keys = row[first[r] : first[r] + length[r]]
        for h in range(heads):
            kv = h // (heads // kv_heads)
            want = reference(q[r, h].float(), k_pool[keys, kv].float(), v_pool[keys, kv].float(), 0.125, softcap)
            assert torch.allclose(together[r, h].float(), want, atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    assert torch.equal(run([5, 3, 0]), together[[5, 3, 0]]), "in another order and company"


def test_without_cpp_the_row_by_row_kernels_serve(monkeypatch, caplog):
    monkeypatch.setenv("RADIXSERVE_NATIVE", "0")
    assert invariant_ops(default_cache_dir()).name == "torch-row-by-row"
    assert "RADIXSERVE_NATIVE=0" in caplog.text


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def det_engine(request, tiny_models):
    # a small pool and small prefill chunks: batches of 64 retract, long prompts are cut, prefixes are shared
    engine = Engine(str(tiny_models["llama"]), dtype=request.param, deterministic=True, max_total_tokens=600,
                    chunked_prefill_size=48, check_invariants=True)
    yield engine
    engine.shutdown()


def mixed_batch(rng: random.Random, size: int, probes: list[tuple[list[int], dict]]) -> list[tuple[list[int], dict]]:
    """``probes`` plus fillers: other lengths, some sharing a probe's prefix (the cache serves it), greedy and
    seeded sampling, in a shuffled order."""
    out = list(probes[:size])
    while len(out) < size:
        base = rng.choice(probes)[0]
        head = base[: rng.randrange(1, len(base))] if rng.random() < 0.5 else []
        tail = [rng.randrange(5, 40000) for _ in range(rng.randrange(1, 90))]
        params = {"max_new_tokens": rng.randrange(1, 24), "temperature": rng.choice([0, 0.7]), "seed": rng.randrange(99)}
        out.append((head + tail, params))
    rng.shuffle(out)
    return out


def test_tokens_are_the_same_alone_and_in_batches_of_1_7_32_64(det_engine):
    rng = random.Random(1)
    probes = [([rng.randrange(5, 40000) for _ in range(n)], {"max_new_tokens": 16, "temperature": t, "seed": s})
              for n, t, s in ((3, 0, None), (40, 0, None), (70, 0.8, 11), (130, 0, None), (9, 1.0, 5), (100, 0.5, 7),
                              (64, 0, None))]
    alone = [det_engine.generate(input_ids=p, sampling_params=sp)["output_ids"] for p, sp in probes]
    key = {tuple(p): i for i, (p, _) in enumerate(probes)}
    for size in (1, 7, 32, 64):
        batch = mixed_batch(rng, size, probes)
        outs = det_engine.generate(input_ids=[p for p, _ in batch], sampling_params=[sp for _, sp in batch])
        for (p, _), out in zip(batch, outs):
            if tuple(p) in key:
                assert out["output_ids"] == alone[key[tuple(p)]], (size, key[tuple(p)])
    stats = det_engine.cache_stats()["totals"]
    assert stats["cached_tokens"] > 0 and stats["retractions"] > 0, "the batches must share prefixes and retract"


@pytest.mark.parametrize("kind", ["gemma2", "phi3"])
def test_windows_and_softcaps_are_batch_invariant(kind, arch_models):
    """Sliding windows (keys before them masked, chunks still absolute) and soft-capped scores: the start-up check
    passes, a prompt longer than a chunk gives the same tokens alone and batched, and greedy tokens equal the
    default path's (which equal HF's: test_architectures.py)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 40000) for _ in range(n)] for n in (150, 20, 7, 133)]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with Engine(str(arch_models[kind]), dtype="float32", deterministic=True, chunked_prefill_size=64,
                check_invariants=True) as engine:
        assert engine.runner.attn.name == "batch-invariant"
        alone = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
        together = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)]
    assert together == alone
    with Engine(str(arch_models[kind]), dtype="float32") as engine:
        assert [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)] == alone


def test_the_start_up_check_passes_the_invariant_model_and_refuses_one_that_is_not(tiny_models):
    """The guard: the invariant model passes it (at start-up, and again here); the same model with the last bit of
    a logit depending on the batch's size (what a batch-dependent kernel does) is refused, on any machine."""
    from radixserve.model.config import ModelConfig
    from radixserve.model.determinism import check_batch_invariance
    from radixserve.model.loader import load_configs
    from radixserve.model.runner import ModelRunner

    path = tiny_models["llama"]
    cfg = ModelConfig.from_hf(*load_configs(path))
    runner = ModelRunner(cfg, path, dtype="float32", num_slots=600, deterministic=True)
    slots = 600
    check_batch_invariance(runner.logits, cfg.vocab_size, slots)

    def batch_dependent(plan):
        logits = runner.logits(plan)
        return torch.nextafter(logits, torch.full_like(logits, float("inf"))) if len(plan.extend_lens) > 1 else logits

    with pytest.raises(RuntimeError, match="not batch-invariant"):
        check_batch_invariance(batch_dependent, cfg.vocab_size, slots)


def test_seeded_openai_sampling_is_reproducible(tiny_models):
    """A seed makes an OpenAI request's sampled tokens reproducible -- promised under --deterministic, where the
    logits do not depend on the batch or on a cached prefix (the second request reads the first one's prompt from
    the cache), nor on sharing a step with the other choice of n=2."""
    import openai

    server = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32", "--deterministic",
                           "--served-model-name", "tiny")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        kw = dict(model="tiny", messages=[{"role": "user", "content": "Write a short poem about rain."}],
                  temperature=1.0, top_p=0.95, max_tokens=24, seed=1234)
        a = client.chat.completions.create(**kw).choices[0].message.content
        again = client.chat.completions.create(**kw)
        assert again.choices[0].message.content == a and again.usage.prompt_tokens_details.cached_tokens > 0
        two = client.chat.completions.create(**kw, n=2)
        assert two.choices[0].message.content == a, "choice 0 uses the seed itself"
        assert len(two.choices) == 2
    finally:
        server.stop()


@pytest.mark.slow
def test_64_concurrent_clients_get_the_same_greedy_answers_on_smollm2():
    """The report that started it: 64 clients asking the same questions at temperature 0 got different answers."""
    server = ServerProcess("--deterministic", "--max-total-tokens", "8192")
    questions = ["What is the capital of France?", "Name three primary colors.", "What is 12 times 12?",
                 "Write a haiku about the sea.", "Who wrote Hamlet?", "What is photosynthesis?",
                 "Give me a synonym for happy.", "How many legs does a spider have?"]

    def body(q: str) -> dict:
        return {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": q}], "temperature": 0,
                "max_tokens": 24}

    async def ask_all() -> list[str]:
        async with httpx.AsyncClient(timeout=300) as client:
            rs = await asyncio.gather(*(client.post(server.url + "/v1/chat/completions", json=body(questions[i % 8]))
                                        for i in range(64)))
        return [r.json()["choices"][0]["message"]["content"] for r in rs]

    try:
        alone = [httpx.post(server.url + "/v1/chat/completions", json=body(q), timeout=120).json()["choices"][0]
                 ["message"]["content"] for q in questions]
        together = asyncio.run(ask_all())
    finally:
        server.stop()
    assert together == [alone[i % 8] for i in range(64)]
    assert "Paris" in alone[0]
