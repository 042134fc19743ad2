"""Constrained decoding in the engine core: outputs stay in their grammar under chunking, eviction and retraction
(invariants checked after every step), constrained and free rows share batches, the runner's matchers follow the
scheduler exactly (a disagreement fails that request alone), and bad grammars are refused naming the field."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from radixserve import Engine, InvalidRequest, SamplingParams

EMAIL = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
          "maximum": 9}, "tag": {"type": "string", "maxLength": 5}}, "required": ["ok", "n", "tag"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(tiny_models):
    return Engine(str(tiny_models["llama"]), dtype="float32", check_invariants=True, max_total_tokens=400,
                  chunked_prefill_size=16)


LETTERS = r"[a-z]{30}"  # long outputs: the pool runs out while they decode
DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 12, "maxItems": 12}


def test_grammar_holds_under_chunking_and_retraction(tiny_models):
    """Twelve requests with 12-token prompts and long outputs in a 90-slot pool: chunked prefills, evictions and
    retractions happen (invariants checked after every step), and every constrained output matches its grammar."""
    engine = Engine(str(tiny_models["llama"]), dtype="float32", check_invariants=True, max_total_tokens=90,
                    chunked_prefill_size=8)
    retractions = engine.scheduler.stats.retractions
    prompts = [[(i * 7 + j) % 500 + 10 for j in range(12)] for i in range(12)]
    params = [{"max_new_tokens": 40, "temperature": 1.0, "seed": i,
               **({"regex": LETTERS} if i % 3 == 0 else {"json_schema": DIGITS} if i % 3 == 1 else
                  {"ignore_eos": True})}
              for i in range(12)]
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert engine.scheduler.stats.retractions > retractions, "the test needs the pool to run out"
    for i, out in enumerate(outs):
        assert "error" not in out["meta_info"], out["meta_info"]
        if i % 3 == 0:
            assert re.fullmatch(LETTERS, out["text"]) or (out["meta_info"]["finish_reason"]["type"] == "length"
                                                          and re.fullmatch(r"[a-z]*", out["text"])), out["text"]
        elif i % 3 == 1:
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
            jsonschema.validate(json.loads(out["text"]), DIGITS)
    assert not engine.runner.constraints.live, "every finished request's matcher was released"


def test_free_rows_are_untouched_by_constrained_neighbours(engine):
    free = {"max_new_tokens": 10, "temperature": 0}
    alone = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=free)["output_ids"]
    mixed = engine.generate(input_ids=[[5, 6, 7, 8], [9, 10, 11]],
                            sampling_params=[free, {"max_new_tokens": 20, "temperature": 0, "regex": EMAIL}])
    assert mixed[0]["output_ids"] == alone and re.fullmatch(EMAIL, mixed[1]["text"])


def test_the_grammar_ends_the_request(engine):
    out = engine.generate("answer:", {"max_new_tokens": 20, "temperature": 0, "regex": "(yes|no)"})
    assert out["text"] in ("yes", "no") and out["meta_info"]["finish_reason"]["type"] == "stop"
    assert out["meta_info"]["completion_tokens"] <= 2


def test_a_matcher_out_of_step_fails_only_its_request(engine):
    """If the runner's matcher ever disagreed with the scheduler about a request's output, that request fails
    (500-style error in meta_info) and the others in the batch finish normally."""
    real_fill = engine.runner.constraints.fill

    def corrupt(rows, output_index):
        for rid in rows:
            if rid is not None and rid in engine.runner.constraints.live:
                engine.runner.constraints.live[rid].consumed += 1  # out of step from now on
        return real_fill(rows, output_index)

    engine.runner.constraints.fill = corrupt
    try:
        outs = engine.generate(input_ids=[[5, 6, 7], [8, 9, 10]], sampling_params=[
            {"max_new_tokens": 6, "temperature": 0, "regex": EMAIL}, {"max_new_tokens": 6, "temperature": 0}])
    finally:
        del engine.runner.constraints.fill
    assert "grammar" in outs[0]["meta_info"]["error"]["message"] or outs[0]["meta_info"]["error"]["status"] == 500
    assert "error" not in outs[1]["meta_info"] and outs[1]["meta_info"]["completion_tokens"] == 6
    engine.scheduler.check()
    assert engine.generate("again", {"max_new_tokens": 8, "regex": EMAIL, "temperature": 0})["text"]


@pytest.mark.parametrize("params,field,message", [
    ({"regex": "(ab"}, "regex", "unclosed group"),
    ({"regex": "[z-a]"}, "regex", "invalid regex"),
    ({"json_schema": '{"type": "objekt"}'}, "json_schema", "Invalid type: objekt"),
    ({"json_schema": "{not json"}, "json_schema", "not valid JSON"),
    ({"json_schema": "[1, 2]"}, "json_schema", "must be a JSON object"),
    ({"json_schema": {"type": "string", "minLength": 3, "maxLength": 1}}, "json_schema", "Unsatisfiable"),
    ({"regex": "a", "json_schema": "{}"}, "regex", "cannot both"),
    ({"ebnf": "root ::= x"}, "ebnf", "Rule 'x' not found"),
    ({"ebnf": "root ::= \"a\"", "regex": "a"}, "regex", "cannot both"),
    ({"stop_regex": ["("]}, "stop_regex", "regular expression"),
    ({"stop_regex": [r"(a)\1"]}, "stop_regex", "no backreferences"),
    ({"regex": "(a{500}){500}"}, "regex", "too complex"),  # llguidance's automaton outgrows its limits at once
    ({"json_schema": {"type": "object", "properties": {"s": {"type": "string", "pattern": "^((a{100}){100}){100}$"}}}},
     "json_schema", "too complex"),
    ({"json_schema": {"type": "object", "patternProperties": {"(a{1000}){1000}": {"type": "integer"}}}}, "json_schema",
     "too complex"),
    ({"min_new_tokens": 3, "max_new_tokens": 2}, "min_new_tokens", "must not exceed"),
    ({"frequency_penalty": 2.5}, "frequency_penalty", "must be in"),
])
def test_bad_constraints_name_the_field(params, field, message):
    with pytest.raises(InvalidRequest, match=message) as exc:
        SamplingParams.coerce(params)
    assert exc.value.param == field


def test_schema_dict_becomes_a_string_and_stop_regex_cuts(engine):
    assert json.loads(SamplingParams(json_schema=SCHEMA).json_schema) == SCHEMA
    out = engine.generate("x", {"max_new_tokens": 30, "temperature": 0, "regex": "[a-c]{25}",
                                "stop_regex": [r"b{2,}|c{2,}|a{2,}|[abc]{12}"]})
    assert out["meta_info"]["finish_reason"]["type"] == "stop" and len(out["text"]) < 25


def test_prompt_logprobs_under_chunked_prefill(engine, hf_models):
    """Prompt logprobs span several chunks (chunked_prefill_size 16) and still equal HF's."""
    import torch

    prompt = [(3 * j) % 400 + 20 for j in range(40)]
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                          logprob_start_len=3)
    with torch.no_grad():
        ref = torch.log_softmax(hf_models["llama"](torch.tensor([prompt])).logits[0], -1)
    got = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in got] == prompt[3:]
    for k, (lp, tok, _) in enumerate(got):
        assert abs(lp - ref[3 + k - 1, tok].item()) < 1e-4
