"""Greedy output identical to HF transformers (fp32) on tiny random Llama (GQA, untied, llama3 RoPE) and Qwen2
(q/k/v bias, tied) checkpoints: radix cache on/off, tiny prefill chunks, a pool small enough to force eviction
and retraction; a second pass reports cached tokens and still matches. Pool accounting is checked after every
scheduler step (check_invariants)."""
from __future__ import annotations

import pytest
import torch

from radixserve import Engine
from radixserve.kernels.cpu_native import unavailable_reason

MAX_NEW = 16
SHARED = "You are a helpful assistant. Answer briefly and politely, and never make things up. "
QUESTIONS = ["What is the capital of France?", "Name three colors.", "How do bees make honey?",
             "What is the capital of France? Answer in French.", "Count to five."]

MODES = {
    "radix": {},
    "no-radix": {"disable_radix_cache": True},
    "chunked": {"chunked_prefill_size": 5},
    "tiny-pool": {"max_total_tokens": 70, "chunked_prefill_size": 16},  # eviction and retraction
}


@pytest.fixture(scope="module")
def prompts(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ids = [tok(SHARED + q).input_ids for q in QUESTIONS]
    ids.append(tok("Unrelated: the mitochondria is").input_ids)
    ids.append(ids[0][:3])  # a prefix of another prompt
    return ids


@pytest.fixture(scope="module")
def hf_reference(hf_models, prompts):
    out = {}
    for kind, model in hf_models.items():
        if kind == "mistral":
            continue
        rows = []
        for p in prompts:
            with torch.no_grad():
                gen = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False)
            rows.append(gen[0, len(p):].tolist())
        out[kind] = rows
    return out


@pytest.mark.parametrize("decode", ["eager", "compiled", "native"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_matches_hf(kind, mode, decode, tiny_models, prompts, hf_reference, monkeypatch):
    if decode == "native" and unavailable_reason("float32"):
        pytest.skip(f"no native decode step here: {unavailable_reason('float32')}")
    if decode != "eager":
        monkeypatch.delenv("RADIXSERVE_DISABLE_COMPILE", raising=False)
    engine = Engine(str(tiny_models[kind]), dtype="float32", check_invariants=True, decode_kernel=decode,
                    **MODES[mode])
    assert engine.runner.decode_kernel == decode
    params = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    if decode != "eager":  # one at a time, then as a batch: batch 1 and larger batches take their own paths
        alone = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts[-2:]]
        assert alone == hf_reference[kind][-2:]
        engine.flush_cache()
    first = engine.generate(input_ids=prompts, sampling_params=params)
    assert [r["output_ids"] for r in first] == hf_reference[kind]
    if decode == "compiled":
        assert engine.runner.compiled.steps >= MAX_NEW and not engine.runner.compiled.eager_sizes
    if decode == "native":  # decode steps, and these short prompts' prefill steps
        assert engine.runner.native.steps >= MAX_NEW and engine.runner.native.prefill_steps > 0
    second = engine.generate(input_ids=prompts, sampling_params=params)
    assert [r["output_ids"] for r in second] == hf_reference[kind]
    stats = engine.scheduler.stats
    cached = [r["meta_info"]["cached_tokens"] for r in second]
    if mode == "no-radix":
        assert sum(cached) == 0
    elif mode == "tiny-pool":
        assert stats.retractions > 0, "the pool was meant to be too small for the batch"
        assert engine.scheduler.cache.evicted_tokens > 0
    else:
        assert cached == [len(p) - 1 for p in prompts], "second pass reuses all but the last prompt token"
    for r in first + second:
        assert r["meta_info"]["completion_tokens"] == MAX_NEW
        assert r["meta_info"]["finish_reason"] == {"type": "length"}
    cache = engine.scheduler.cache
    assert cache.protected == 0 and cache.owned_by_requests == 0


def test_shared_prefix_batch_reuses_within_one_call(tiny_models, prompts, hf_reference):
    """Requests sharing a prefix in one batch: later admissions reuse what earlier ones computed."""
    engine = Engine(str(tiny_models["llama"]), dtype="float32", check_invariants=True, max_running_requests=1)
    res = engine.generate(input_ids=prompts[:3], sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW,
                                                                  "ignore_eos": True})
    assert [r["output_ids"] for r in res] == hf_reference["llama"][:3]
    assert res[0]["meta_info"]["cached_tokens"] == 0
    assert all(r["meta_info"]["cached_tokens"] >= 15 for r in res[1:]), [r["meta_info"] for r in res]


def test_sharded_mistral_checkpoint_matches_hf(tiny_models, hf_models, prompts):
    path = tiny_models["mistral"]
    assert len(list(path.glob("*.safetensors"))) > 1 and (path / "model.safetensors.index.json").exists()
    engine = Engine(str(path), dtype="float32", check_invariants=True, chunked_prefill_size=7)
    got = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW,
                                                              "ignore_eos": True})
    for p, r in zip(prompts, got):
        with torch.no_grad():
            ref = hf_models["mistral"].generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False)
        assert r["output_ids"] == ref[0, len(p):].tolist()
