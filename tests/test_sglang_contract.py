"""SGLang's server contract, as its frontend uses it: the requests it made against radixserve (recorded by a
proxy from the real ``sglang`` frontend running tests/sglang_frontend/drive.py) replayed, and every field it
reads checked; prefill-only caching, prompt logprobs, streaming, and structured output on every route."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import httpx
import jsonschema
import pytest

RECORDED = json.loads((Path(__file__).parent / "sglang_frontend" / "requests.json").read_text())


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def sse(server, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[5:]) for ln in lines[:-1]]


def check_result(body: dict, request: dict) -> None:
    """The fields SGLang's RuntimeEndpoint and interpreter read from one /generate result."""
    assert isinstance(body["text"], str)
    meta = body["meta_info"]
    assert isinstance(meta["prompt_tokens"], int) and isinstance(meta["cached_tokens"], int)
    if request.get("return_logprob"):
        for key in ("input_token_logprobs", "output_token_logprobs"):
            for lp, tid, text in meta[key]:
                assert (lp is None or lp <= 0) and isinstance(tid, int)
                assert isinstance(text, str) if request.get("return_text_in_logprobs") else text is None


@pytest.mark.parametrize("i", range(len(RECORDED)), ids=[f"{r['method']} {r['path']} #{i}"
                                                         for i, r in enumerate(RECORDED)])
def test_recorded_frontend_requests_replay(tiny_server, i):
    req = RECORDED[i]
    if req["method"] == "GET":
        r = httpx.get(tiny_server.url + req["path"], timeout=30)
        assert r.status_code == 200, r.text
        assert isinstance(r.json()["model_path"], str)  # RuntimeEndpoint picks its chat template from it
        return
    body = req["json"]
    if body.get("stream"):
        events = sse(tiny_server, body)
        texts = [e["text"] for e in events]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "cumulative text, as SGLang streams"
        check_result(events[-1], body)
        return
    r = post(tiny_server, req["path"], body)
    assert r.status_code == 200, r.text
    out = r.json()
    results = out if isinstance(body.get("text"), list) else [out]
    assert len(results) == (len(body["text"]) if isinstance(body.get("text"), list) else 1)
    for res in results:
        check_result(res, body)
    params = body.get("sampling_params", {})
    if params.get("max_new_tokens") == 0:
        assert all(res["text"] == "" and res["meta_info"]["completion_tokens"] == 0 for res in results)
    if params.get("regex"):
        assert all(re.fullmatch(params["regex"], res["text"]) or res["meta_info"]["finish_reason"]["type"] == "length"
                   for res in results)


def test_select_request_shape(tiny_server):
    """What select() sends: a prefill-only call, then all choices with prompt logprobs from prompt_len - 2."""
    prefix = "The capital of France is"
    first = post(tiny_server, "/generate", {"text": prefix, "sampling_params": {"max_new_tokens": 0}}).json()
    n = first["meta_info"]["prompt_tokens"]
    body = {"text": [prefix + c for c in (" Paris", " London")], "sampling_params": {"max_new_tokens": 0,
            "temperature": 0}, "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": n - 2}
    outs = post(tiny_server, "/generate", body).json()
    for out in outs:
        got = out["meta_info"]["input_token_logprobs"]
        assert len(got) == out["meta_info"]["prompt_tokens"] - (n - 2)
        assert all(isinstance(lp, float) for lp, _, _ in got), "no position here is the prompt's first"
        assert got[0][2] in prefix and got[1][2] in prefix, "scoring starts two tokens back, inside the prefix"
        assert out["meta_info"]["cached_tokens"] >= n - 3, "the prefix came from the cache up to the scored part"


def test_prefill_only_caches_the_prefix(tiny_server):
    text = "A long shared preamble that many requests will start with. " * 4
    first = post(tiny_server, "/generate", {"text": text, "sampling_params": {"max_new_tokens": 0}}).json()
    assert first["text"] == "" and first["output_ids"] == [] and first["meta_info"]["prompt_tokens"] > 40
    assert first["meta_info"]["finish_reason"]["type"] == "length"
    second = post(tiny_server, "/generate", {"text": text + "And a question?",
                                             "sampling_params": {"max_new_tokens": 2}}).json()
    assert second["meta_info"]["cached_tokens"] >= first["meta_info"]["prompt_tokens"] - 1


def test_prompt_logprobs_from_zero(tiny_server):
    out = post(tiny_server, "/generate", {"text": "one two three", "sampling_params": {"max_new_tokens": 1},
                                          "return_logprob": True, "logprob_start_len": 0,
                                          "top_logprobs_num": 2}).json()
    meta = out["meta_info"]
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    assert all(len(top) == 2 for top in meta["input_top_logprobs"][1:])
    assert len(meta["output_token_logprobs"]) == 1 and len(meta["output_top_logprobs"][0]) == 2


def test_model_and_server_info_routes(tiny_server):
    for path in ("/get_model_info", "/model_info"):
        info = httpx.get(tiny_server.url + path).json()
        assert info["is_generation"] is True and info["model_path"].endswith("llama")
        assert set(info["chat_template"]["roles"]) == {"system", "user", "assistant"}
    for path in ("/get_server_info", "/server_info"):
        assert httpx.get(tiny_server.url + path).json()["model"] == "tiny"


# -- structured output ---------------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
          "maximum": 99}, "color": {"enum": ["red", "green", "blue"]}, "tag": {"type": "string", "maxLength": 6}},
          "required": ["ok", "n", "color", "tag"], "additionalProperties": False}
EMAIL = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_regex_outputs_never_leave_the_grammar(tiny_server, temperature):
    """A random model would write anything; under the regex every sampled output matches it."""
    body = {"text": [f"contact {i}:" for i in range(8)],
            "sampling_params": {"max_new_tokens": 40, "temperature": temperature, "regex": EMAIL}}
    for out in post(tiny_server, "/generate", body).json():
        assert re.fullmatch(EMAIL, out["text"]), out
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_json_schema_outputs_parse_and_validate(tiny_server, temperature):
    body = {"text": [f"record {i}:" for i in range(6)],
            "sampling_params": {"max_new_tokens": 60, "temperature": temperature, "json_schema": json.dumps(SCHEMA)}}
    for out in post(tiny_server, "/generate", body).json():
        jsonschema.validate(json.loads(out["text"]), SCHEMA)


def test_openai_response_format_on_chat_and_completions(tiny_server):
    fmt = {"type": "json_schema", "json_schema": {"name": "rec", "schema": SCHEMA}}
    chat = post(tiny_server, "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "a record"}], "max_tokens": 60,
        "response_format": fmt, "n": 3, "temperature": 1.0, "seed": 7}).json()
    for choice in chat["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    obj = post(tiny_server, "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "any object"}], "max_tokens": 80,
        "response_format": {"type": "json_object"}, "temperature": 0}).json()
    text = obj["choices"][0]["message"]["content"]
    if obj["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{"), "cut by max_tokens, but still an object's beginning"
    comp = post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": "mail:", "max_tokens": 40,
                                                 "regex": EMAIL, "temperature": 0.7}).json()
    assert re.fullmatch(EMAIL, comp["choices"][0]["text"])


def test_constrained_and_free_requests_share_a_batch(tiny_server):
    """A grammar touches only its own row: the free request's greedy output is what it is alone."""
    free = {"text": "the weather today", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    alone = post(tiny_server, "/generate", free).json()["output_ids"]
    body = {"text": ["the weather today", "mail to:"], "sampling_params": [
        {"max_new_tokens": 12, "temperature": 0}, {"max_new_tokens": 30, "temperature": 0, "regex": EMAIL}]}
    together, constrained = post(tiny_server, "/generate", body).json()
    assert together["output_ids"] == alone
    assert re.fullmatch(EMAIL, constrained["text"])


def test_streamed_constrained_output(tiny_server):
    events = sse(tiny_server, {"text": "mail:", "sampling_params": {"max_new_tokens": 30, "regex": EMAIL,
                                                                    "temperature": 0.5, "seed": random.randrange(99)}})
    assert re.fullmatch(EMAIL, events[-1]["text"])
