"""radixserve.lang end to end, against a live server (RuntimeEndpoint) and in process (EngineBackend), on the
bundled SmolLM2: gen, select, fork, run_batch, stream, regex and JSON schema -- and the examples/ scripts. Forks
and batch members must visibly share their prefix through the radix cache (cached_tokens)."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import jsonschema
import pytest

import radixserve.lang as sgl
from radixserve.lang import EngineBackend, RuntimeEndpoint

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SYSTEM = "You are a helpful assistant who answers geography questions in one short sentence. " * 3


@pytest.fixture(scope="module", params=["http", "engine"])
def backend(request, smol_server):
    if request.param == "http":
        yield RuntimeEndpoint(smol_server.url)
        return
    from radixserve import Engine

    engine = Engine(max_total_tokens=4096)
    yield EngineBackend(engine)
    engine.shutdown()


@sgl.function
def capital(s, country):
    s += sgl.system(SYSTEM)
    s += sgl.user(f"What is the capital of {country}?")
    s += sgl.assistant(sgl.gen("answer", max_tokens=24, temperature=0))


def test_gen_uses_the_models_own_chat_template(backend):
    state = capital.run(country="France", backend=backend)
    assert "Paris" in state["answer"]
    assert state.text().startswith("<|im_start|>system\n" + SYSTEM), "SmolLM2's ChatML, from its tokenizer"
    assert state.messages()[-1] == {"role": "assistant", "content": state["answer"]}


def test_run_batch_prefills_the_shared_prefix_once(backend):
    backend.flush_cache()
    states = capital.run_batch([{"country": c} for c in ("France", "Italy", "Spain", "Germany")], backend=backend)
    assert [("Paris" in states[0]["answer"]), ("Rome" in states[1]["answer"])] == [True, True]
    shared = len(SYSTEM) // 8  # the system prompt is far longer than this many tokens
    assert all(s.get_meta_info("answer")["cached_tokens"] >= shared for s in states), \
        [s.get_meta_info("answer")["cached_tokens"] for s in states]


@sgl.function
def city_facts(s):
    s += sgl.system(SYSTEM)
    s += sgl.user("Tell me one fact about Paris.")
    forks = s.fork(3)
    forks += sgl.assistant(sgl.gen("fact", max_tokens=16, temperature=0.9, stop="\n"))
    forks.join()
    s["cached"] = [f.get_meta_info("fact")["cached_tokens"] for f in forks]
    s["prompt"] = [f.get_meta_info("fact")["prompt_tokens"] for f in forks]


def test_fork_shares_the_prefix(backend):
    backend.flush_cache()
    state = city_facts.run(backend=backend)
    assert len(state["fact"]) == 3 and all(isinstance(f, str) for f in state["fact"])
    # the fork prefilled the conversation once: every branch found it in the cache (all but its own last
    # tokens, the assistant header that each branch adds)
    assert all(p - c <= 8 for c, p in zip(state["cached"], state["prompt"])), (state["cached"], state["prompt"])


@sgl.function
def pick(s):
    s += "The capital of France is"
    s += sgl.select("city", choices=[" Paris", " London", " Berlin", " Madrid"])


def test_select(backend):
    state = pick.run(backend=backend)
    assert state["city"] == " Paris"
    meta = state.get_meta_info("city")
    assert len(meta["normalized_prompt_logprobs"]) == 4
    assert max(meta["normalized_prompt_logprobs"]) == meta["normalized_prompt_logprobs"][0]


def test_stream(backend):
    state = capital.run(country="Japan", backend=backend, stream=True)
    pieces = list(state.text_iter("answer"))
    assert len(pieces) > 1 and "".join(pieces) == state["answer"] and "Tokyo" in state["answer"]


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
          "age": {"type": "integer", "minimum": 0, "maximum": 130}}, "required": ["name", "age"],
          "additionalProperties": False}


@sgl.function
def structured(s, text):
    s += sgl.user(f"Extract the person as JSON: {text}")
    s += sgl.assistant(sgl.gen("person", max_tokens=48, json_schema=PERSON))
    s += sgl.user("And the year they were born, as four digits?")
    s += sgl.assistant(sgl.gen("year", max_tokens=8, regex=r"(19|20)[0-9]{2}"))


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_regex_and_json_schema(backend, temperature):
    states = structured.run_batch([{"text": "Ann Lee is 41."}, {"text": "Bob, aged 7."}], backend=backend,
                                  temperature=temperature)
    for s in states:
        jsonschema.validate(json.loads(s["person"]), PERSON)
        assert re.fullmatch(r"(19|20)[0-9]{2}", s["year"])


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_examples_run_against_the_server(smol_server):
    endpoint = RuntimeEndpoint(smol_server.url)
    qa = load_example("article_qa").main(endpoint, temperature=0)  # the article samples; a test can't
    assert "Paris" in qa["answer"] and qa["cached_tokens_second_run"] >= qa["prompt_tokens"] - 1
    trip = load_example("select_fork").main(endpoint)
    assert trip["country"] == "France" and len(trip["tips"]) == 3
    people = load_example("json_extraction")
    result = people.main(endpoint)
    for person in result["people"]:
        jsonschema.validate(person, people.PERSON)
    assert [p["name"] for p in result["people"]] == ["Maria Lopez", "Tom Baker", "Aiko Tanaka"]
    assert min(result["cached_tokens"]) > 15, "the shared system prompt came from the cache"
