"""--deterministic: a request's tokens do not depend on what else is batched with it (bf16 and fp32).

From the parts up: a linear layer's row and an attention row are bitwise the same in any batch; the runner's
start-up check refuses kernels that are not; and through the Engine and the server, the same prompts alone and
inside batches of 1, 7, 32 and 64 mixed requests (other lengths, shared prefixes that the radix cache serves,
chunked prefill, a pool small enough to retract) give identical tokens, greedy and seeded.
"""
from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import torch

from conftest import ServerProcess
from radixserve import Engine
from radixserve.kernels.batch_invariant import CHUNK, attend
from radixserve.kernels.cpu_linear import PackedLinear, RowBlocks, invariant_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_do_not_depend_on_how_many_rows_are_computed(dtype):
    torch.manual_seed(0)
    w = (torch.randn(576, 1536) * 0.05).to(dtype)  # 1536 -> 576: a shape whose kernels change with the row count
    layer = PackedLinear(w, None, False, min_rows=2)
    layer.blocks = invariant_blocks(layer)
    x = torch.randn(600, 1536).to(dtype)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(600)])
    for m in (2, 7, 16, 17, 31, 64, 65, 150, 201, 300, 599):
        assert torch.equal(layer(x[:m]), alone[:m]), m


def test_rows_are_cut_into_the_probed_sizes():
    blocks = RowBlocks(16, 128)
    assert blocks.sizes(200) == [128, 64, 8] and blocks.sizes(16) == [16] and blocks.sizes(5) == [5]
    assert blocks.sizes(300) == [128, 128, 32, 12] and sum(blocks.sizes(12345)) == 12345


def reference(q, k, v, n_keys):
    s = (q.double() @ k[:n_keys].double().T)
    return (s.softmax(-1) @ v[:n_keys].double()).float()


def test_an_attention_row_is_the_same_in_every_batch_and_correct():
    torch.manual_seed(0)
    d, g = 64, 3
    keys, values = torch.randn(300, d), torch.randn(300, d)

    def run(rows: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
        """rows: (queries [M, D], number of keys it reads); all in one call, keys padded to the longest."""
        width = -(-max(n for _, n in rows) // CHUNK) * CHUNK
        m = max(q.shape[0] for q, _ in rows)
        q = torch.zeros(len(rows), 1, m, d)
        k = torch.zeros(len(rows), 1, width, d)
        v = torch.zeros(len(rows), 1, width, d)
        bias = torch.full((len(rows), m, width), float("-inf"))
        for i, (qi, n) in enumerate(rows):
            q[i, 0, : qi.shape[0]], k[i, 0, :n], v[i, 0, :n] = qi, keys[:n], values[:n]
            bias[i, :, :n] = 0
        return attend(q, k, v, bias)[:, 0]

    query = torch.randn(g, d)  # one token's query heads of one kv head
    alone = run([(query, 130)])[0]
    assert torch.allclose(alone, reference(query, keys, values, 130), atol=1e-5)
    others = [(torch.randn(g, d), n) for n in (5, 64, 299)]
    assert torch.equal(run([*others, (query, 130)])[3], alone), "in a batch with longer and shorter rows"
    assert torch.equal(run([(query, 130), (torch.randn(1, d), 7)])[0], alone), "beside a single-row query"


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


def test_the_start_up_check_refuses_kernels_that_are_not_invariant(tiny_models):
    from radixserve.model.config import ModelConfig
    from radixserve.model.determinism import check_batch_invariance
    from radixserve.model.loader import load_configs
    from radixserve.model.runner import ModelRunner

    path = tiny_models["llama"]
    cfg = ModelConfig.from_hf(*load_configs(path))
    default = ModelRunner(cfg, path, dtype="bfloat16", num_slots=600)  # the fast path: SDPA, shared-prefix decode
    with pytest.raises(RuntimeError, match="not batch-invariant"):
        check_batch_invariance(default.logits, cfg.vocab_size, 600)


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
