"""Penalties, min_new_tokens, logit_bias and n: against a naive reference that recomputes every adjustment from the
whole output history at every step (HF's forward in fp32), batched with unpenalized requests, under retraction."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.errors import InvalidRequest
from radixserve.model.penalties import Penalties
from radixserve.wire.plans import PenaltySpec

PROMPTS = ["The quick brown fox", "Once upon a time there", "1 2 3 4 5 6", "hello hello hello"]


def reference_adjust(logits: torch.Tensor, output: list[int], p: SamplingParams, stop_ids: set[int]) -> torch.Tensor:
    """The adjustments, written from their definitions, from the whole history."""
    x = logits.clone()
    for t in set(output):
        c = output.count(t)
        if p.repetition_penalty != 1:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    for key, value in (p.logit_bias or {}).items():
        x[int(key)] += value
    if len(output) < p.min_new_tokens:
        for t in stop_ids:
            x[t] = float("-inf")
    return x


def reference_greedy(model, ids: list[int], p: SamplingParams, stop_ids: set[int]) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        while len(out) < p.max_new_tokens:
            logits = model(torch.tensor([ids + out])).logits[0, -1].float()
            t = int(reference_adjust(logits, out, p, stop_ids).argmax())
            out.append(t)
            if t in stop_ids and len(out) >= p.min_new_tokens:
                break
    return out


CASES = [
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.6),
    dict(frequency_penalty=1.5),
    dict(presence_penalty=2.0),
    dict(frequency_penalty=-0.7, presence_penalty=0.4, repetition_penalty=1.3),
    dict(logit_bias={"42": 8.0, "7": -100.0}),
    dict(),  # unpenalized, in the same batch
]


@pytest.fixture(scope="module")
def engine(tiny_models):
    return Engine(str(tiny_models["llama"]), dtype="float32", check_invariants=True, max_total_tokens=400)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=kw.pop("max_new_tokens", 12), temperature=0, **kw)


def test_penalties_in_one_batch_equal_the_naive_reference(engine, hf_models):
    model = hf_models["llama"]
    ids = [engine.tokenizer.encode(t) for t in PROMPTS]
    jobs = [(ids[i % len(ids)], greedy(**case)) for i, case in enumerate(CASES)]
    results = engine.generate(input_ids=[j[0] for j in jobs], sampling_params=[j[1] for j in jobs])
    for (prompt, params), got, case in zip(jobs, results, CASES):
        want = reference_greedy(model, prompt, params, set())
        assert got["output_ids"] == want, case
    plain = engine.generate(input_ids=jobs[0][0], sampling_params=greedy())
    assert plain["output_ids"] != results[0]["output_ids"]  # the penalty changed something


def test_a_frequency_penalty_wears_a_repeat_down(engine):
    """A bias makes greedy repeat one token; a frequency penalty takes 2 per repeat off it until others win."""
    bias = {"123": 12.0}
    repeat = engine.generate("hello", greedy(max_new_tokens=16, logit_bias=bias))["output_ids"]
    assert repeat == [123] * 16
    worn = engine.generate("hello", greedy(max_new_tokens=16, logit_bias=bias, frequency_penalty=2.0))["output_ids"]
    assert 0 < worn.count(123) < 16 and worn[0] == 123


def test_logit_bias_forces_and_bans(engine):
    forced = engine.generate("hi", greedy(max_new_tokens=5, logit_bias={"123": 100.0}))["output_ids"]
    assert forced == [123] * 5
    plain = engine.generate("hi", greedy(max_new_tokens=5))["output_ids"]
    banned = engine.generate("hi", greedy(max_new_tokens=5, logit_bias={str(plain[0]): -100.0}))["output_ids"]
    assert banned[0] != plain[0]


def test_min_new_tokens_holds_back_stop_tokens_and_strings(engine):
    plain = engine.generate("Once upon", greedy(max_new_tokens=10))["output_ids"]
    stop = plain[2]  # greedy would stop at the third token
    ended = engine.generate("Once upon", greedy(max_new_tokens=10, stop_token_ids=[stop]))
    assert ended["output_ids"] == plain[:3] and ended["meta_info"]["finish_reason"]["type"] == "stop"
    held = engine.generate("Once upon", greedy(max_new_tokens=10, stop_token_ids=[stop], min_new_tokens=6))
    assert len(held["output_ids"]) >= 6 and stop not in held["output_ids"][:6]
    # a stop string that appears in the first tokens does not end the output before min_new_tokens
    text = engine.tokenizer.decode(plain[:2])
    word = text.strip()[:3]
    assert word
    early = engine.generate("Once upon", greedy(max_new_tokens=10, stop=word))
    late = engine.generate("Once upon", greedy(max_new_tokens=10, stop=word, min_new_tokens=8))
    assert len(early["output_ids"]) <= 2
    assert len(late["output_ids"]) >= 8


def test_min_new_tokens_equals_hf(engine, hf_models):
    """HF's own min_new_tokens: the EOS it would sample is held back."""
    model = hf_models["llama"]
    prompt = engine.tokenizer.encode("The quick brown fox")
    plain = engine.generate(input_ids=prompt, sampling_params=greedy(max_new_tokens=8))["output_ids"]
    eos = plain[1]
    got = engine.generate(input_ids=prompt, sampling_params=greedy(max_new_tokens=8, stop_token_ids=[eos],
                                                                   min_new_tokens=5))["output_ids"]
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=5, do_sample=False,
                            eos_token_id=eos, pad_token_id=eos)[0, len(prompt):].tolist()
    assert got == hf


def test_penalties_survive_retraction(tiny_models, hf_models):
    """A pool too small for all of them at once: requests are retracted and recomputed; their counts stay."""
    eng = Engine(str(tiny_models["llama"]), dtype="float32", check_invariants=True, max_total_tokens=96,
                 chunked_prefill_size=16)
    try:
        ids = [eng.tokenizer.encode(t) for t in PROMPTS]
        params = [greedy(max_new_tokens=24, frequency_penalty=1.0, repetition_penalty=1.5) for _ in ids]
        results = eng.generate(input_ids=ids, sampling_params=params)
        assert eng.scheduler.stats.retractions > 0
        for prompt, p, got in zip(ids, params, results):
            assert got["output_ids"] == reference_greedy(hf_models["llama"], prompt, p, set())
    finally:
        eng.shutdown()


def test_n_choices_on_generate(engine):
    one = engine.generate("tell me", {"max_new_tokens": 6, "temperature": 1.0, "seed": 11, "n": 3})
    assert isinstance(one, list) and len(one) == 3
    for j, r in enumerate(one):  # choice j is the request with seed + j
        alone = engine.generate("tell me", {"max_new_tokens": 6, "temperature": 1.0, "seed": 11 + j})
        assert r["output_ids"] == alone["output_ids"]
    assert len({tuple(r["output_ids"]) for r in one}) > 1
    two = engine.generate(["a", "b"], [{"max_new_tokens": 2, "n": 2}, {"max_new_tokens": 2, "n": 1}])
    assert len(two) == 3  # prompt-major: a, a, b
    native = engine.sglang_generate({"text": "x", "sampling_params": {"max_new_tokens": 2, "n": 2}})
    assert isinstance(native, list) and len(native) == 2


@pytest.mark.parametrize("kw, param", [
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=3.0), "repetition_penalty"),
    (dict(min_new_tokens=-1), "min_new_tokens"),
    (dict(min_new_tokens=9, max_new_tokens=4), "min_new_tokens"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(logit_bias={"3": 101.0}), "logit_bias"),
    (dict(n=0), "n"),
])
def test_bad_values_name_their_field(kw, param):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**kw)
    assert err.value.param == param


def test_logit_bias_outside_the_vocabulary(engine):
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        engine.generate("x", {"max_new_tokens": 1, "logit_bias": {"999999": 1.0}})


def test_incremental_counts_equal_the_history():
    """Penalties.apply after many steps of count(): the same as adjustments recomputed from the history."""
    rng = np.random.default_rng(0)
    vocab = 50
    pen = Penalties(vocab, torch.device("cpu"))
    specs = {f"r{i}": PenaltySpec(float(rng.uniform(-2, 2)), float(rng.uniform(-2, 2)), float(rng.uniform(0.5, 2)),
                                  3, [1, 2], [5, 9], [1.5, -2.0]) for i in range(12)}
    pen.update(dict(list(specs.items())[:4]), [])
    history: dict[str, list[int]] = {rid: [] for rid in specs}
    live = list(specs)[:4]
    for step in range(30):
        if step == 10:  # some end, others start: rows are reused and zeroed, the table grows
            pen.update(dict(list(specs.items())[4:]), live[:2])
            live = live[2:] + list(specs)[4:]
        logits = torch.from_numpy(rng.normal(size=(len(live), vocab)).astype(np.float32))
        got = logits.clone()
        assert pen.apply(got, live, [len(history[r]) for r in live]) == {}
        for j, rid in enumerate(live):
            s = specs[rid]
            params = SamplingParams(frequency_penalty=s.frequency, presence_penalty=s.presence,
                                    repetition_penalty=s.repetition, min_new_tokens=s.min_new_tokens,
                                    logit_bias={"5": 1.5, "9": -2.0})
            want = reference_adjust(logits[j], history[rid], params, {1, 2})
            torch.testing.assert_close(got[j], want)
        tokens = [int(t) for t in rng.integers(0, vocab, len(live))]
        pen.count(live, tokens)
        for rid, t in zip(live, tokens):
            history[rid].append(t)
    assert pen.apply(torch.zeros(1, vocab), [live[0]], [0]) == {0: f"penalties counted {len(history[live[0]])} "
                                                                  "tokens, the request has 0"}
    assert "lost" in pen.apply(torch.zeros(1, vocab), ["gone"], [0])[0]
