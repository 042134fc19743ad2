"""Bad input gets a 4xx with OpenAI's error object and loses nothing: the table below is the contract."""
from __future__ import annotations

import json

import httpx
import pytest

CHAT, COMP, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
MSG = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return {"model": "tiny", "messages": MSG, "max_tokens": 4, **kw}


# (name, method, path, body (dict -> JSON, bytes -> raw), status, param or None)
CASES = [
    ("invalid JSON", "POST", CHAT, b'{"model": "tiny", "messages": [', 400, None),
    ("empty body", "POST", CHAT, b"", 400, None),
    ("body is a list", "POST", CHAT, b"[1, 2]", 400, None),
    ("messages not a list", "POST", CHAT, {"model": "tiny", "messages": "hi"}, 400, "messages"),
    ("missing messages", "POST", CHAT, {"model": "tiny"}, 400, "messages"),
    ("model not a string", "POST", CHAT, {"model": 3, "messages": MSG}, 400, "model"),
    ("empty messages", "POST", CHAT, chat(messages=[]), 400, "messages"),
    ("unknown role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
    ("content a number", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    ("image content part", "POST", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages[0].content[0]"),
    ("max_tokens 0", "POST", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max_tokens negative", "POST", COMP, {"model": "tiny", "prompt": "a", "max_tokens": -3}, 400, "max_tokens"),
    ("max_tokens a string", "POST", CHAT, chat(max_tokens="ten"), 400, "max_tokens"),
    ("max_tokens beyond context", "POST", CHAT, chat(max_tokens=5000), 400, "max_tokens"),
    ("prompt beyond context", "POST", COMP, {"model": "tiny", "prompt": [5] * 2100}, 400, "prompt"),
    ("prompt beyond the KV pool", "POST", COMP, {"model": "tiny", "prompt": [5] * 1500}, 400, "prompt"),
    ("token id outside vocabulary", "POST", COMP, {"model": "tiny", "prompt": [1, 10**7]}, 400, "prompt"),
    ("token id negative", "POST", COMP, {"model": "tiny", "prompt": [1, -4]}, 400, "prompt"),
    ("token id beyond int32", "POST", COMP, {"model": "tiny", "prompt": [1, 2**40]}, 400, "prompt"),
    ("max_tokens a float", "POST", CHAT, chat(max_tokens=1.5), 400, "max_tokens"),
    ("n too large", "POST", CHAT, chat(n=1000), 400, "n"),
    ("user message without content", "POST", CHAT, chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
    ("stream not a bool", "POST", CHAT, chat(stream="yes"), 400, "stream"),
    ("wrong method on models", "POST", "/v1/models", {}, 405, None),
    ("empty prompt", "POST", COMP, {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("prompt of mixed types", "POST", COMP, {"model": "tiny", "prompt": ["a", 3]}, 400, "prompt"),
    ("unknown model", "POST", CHAT, chat(model="gpt-5"), 404, "model"),
    ("n = 0", "POST", CHAT, chat(n=0), 400, "n"),
    ("temperature 5", "POST", CHAT, chat(temperature=5), 400, "temperature"),
    ("top_p 0", "POST", CHAT, chat(top_p=0), 400, "top_p"),
    ("top_logprobs 30", "POST", CHAT, chat(logprobs=True, top_logprobs=30), 400, "top_logprobs"),
    ("top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("stop a number", "POST", CHAT, chat(stop=5), 400, "stop"),
    ("stop with an empty string", "POST", CHAT, chat(stop=[""]), 400, "stop"),
    ("lora_path naming an adapter", "POST", CHAT, chat(lora_path="my-adapter"), 400, "lora_path"),
    ("return_hidden_states asked for", "POST", COMP, {"model": "tiny", "prompt": "a", "return_hidden_states": True},
     400, "return_hidden_states"),
    ("tools", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    ("presence_penalty beyond 2", "POST", CHAT, chat(presence_penalty=2.5), 400, "presence_penalty"),
    ("repetition_penalty 0", "POST", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    ("min_tokens above max_tokens", "POST", CHAT, chat(min_tokens=9, max_tokens=3), 400, "min_new_tokens"),
    ("logit_bias with a word for a key", "POST", CHAT, chat(logit_bias={"hello": 1.0}), 400, "logit_bias"),
    ("logit_bias of 500", "POST", CHAT, chat(logit_bias={"5": 500.0}), 400, "logit_bias"),
    ("logit_bias outside the vocabulary", "POST", CHAT, chat(logit_bias={"99999999": 1.0}), 400, "logit_bias"),
    ("response_format of an unknown type", "POST", CHAT, chat(response_format={"type": "xml"}), 400,
     "response_format.type"),
    ("response_format json_schema without a schema", "POST", CHAT,
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400, "response_format.json_schema"),
    ("response_format with an invalid schema", "POST", CHAT,
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}), 400,
     "json_schema"),
    ("completions: invalid regex", "POST", COMP, {"model": "tiny", "prompt": "a", "regex": "(ab"}, 400, "regex"),
    ("generate: invalid regex", "POST", GEN, {"text": "a", "sampling_params": {"regex": "[z-a]"}}, 400,
     "sampling_params.regex"),
    ("generate: schema that is not JSON", "POST", GEN, {"text": "a", "sampling_params": {"json_schema": "{nope"}},
     400, "sampling_params.json_schema"),
    ("generate: regex and json_schema", "POST", GEN,
     {"text": "a", "sampling_params": {"regex": "a", "json_schema": "{}"}}, 400, "sampling_params.regex"),
    ("generate: ebnf with an undefined rule", "POST", GEN, {"text": "a", "sampling_params": {"ebnf": "root ::= b"}},
     400, "sampling_params.ebnf"),
    ("generate: bad stop_regex", "POST", GEN, {"text": "a", "sampling_params": {"stop_regex": ["("]}}, 400,
     "sampling_params.stop_regex"),
    ("generate: logprob_start_len past the prompt", "POST", GEN,
     {"text": "a", "return_logprob": True, "logprob_start_len": 999}, 400, "logprob_start_len"),
    ("generate: logprob_start_len -5", "POST", GEN, {"text": "a", "return_logprob": True, "logprob_start_len": -5},
     400, "logprob_start_len"),
    ("generate: image_data", "POST", GEN, {"text": "a", "image_data": "x.png"}, 400, "image_data"),
    ("generate: lora_path naming an adapter", "POST", GEN, {"text": "a", "lora_path": ["x"]}, 400, "lora_path"),
    ("generate: text and input_ids", "POST", GEN, {"text": "a", "input_ids": [1]}, 400, "text"),
    ("generate: bad sampling param", "POST", GEN, {"text": "a", "sampling_params": {"top_k": -7}}, 400,
     "sampling_params.top_k"),
    ("generate: unknown sampling param", "POST", GEN, {"text": "a", "sampling_params": {"foo": 1}}, 400,
     "sampling_params.foo"),
    ("top_k past the vocabulary (int32 overflow once)", "POST", CHAT, chat(top_k=3_000_000_000), 400, "top_k"),
    ("top_k larger than the vocabulary", "POST", CHAT, chat(top_k=10**6), 400, "top_k"),
    ("generate: top_k past the vocabulary", "POST", GEN, {"text": "a", "sampling_params": {"top_k": 2**40}}, 400,
     "sampling_params.top_k"),
    ("max_tokens beyond int64", "POST", CHAT, chat(max_tokens=10**30), 400, "max_tokens"),
    ("stop_token_ids beyond int64", "POST", CHAT, chat(stop_token_ids=[10**30]), 400, "stop_token_ids"),
    ("stop_token_ids outside the vocabulary", "POST", CHAT, chat(stop_token_ids=[10**6]), 400, "stop_token_ids"),
    ("too many stop strings", "POST", CHAT, chat(stop=[f"s{i}" for i in range(100)]), 400, "stop"),
    ("a stop string too long", "POST", CHAT, chat(stop=["x" * 5000]), 400, "stop"),
    ("priority beyond int32", "POST", CHAT, chat(priority=10**30), 400, "priority"),
    ("logit_bias map too large", "POST", CHAT, chat(logit_bias={str(i): 1.0 for i in range(1100)}), 400,
     "logit_bias"),
    ("5000 nested arrays", "POST", COMP, b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400,
     None),
    ("nested arrays in a content part", "POST", CHAT,
     b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "x": '
     + b"[" * 5000 + b"]" * 5000 + b"}]}]}", 400, None),
    ("generate: rid too long", "POST", GEN, {"text": "a", "rid": "r" * 1000}, 400, "rid"),
    ("generate: rid list of the wrong length", "POST", GEN, {"text": ["a", "b"], "rid": ["x"]}, 400, "rid"),
    ("generate: token id past the vocabulary", "POST", GEN, {"input_ids": [1, 2**40]}, 400, "input_ids"),
    ("form body (a cross-site simple request)", "POST", CHAT, "form", 415, None),
    ("text/plain body (a cross-site simple request)", "POST", "/flush_cache", "text", 415, None),
    ("bodiless cross-site POST (a browser's no-cors fetch)", "POST", "/flush_cache", "origin", 415, None),
    ("flush_cache by GET", "GET", "/flush_cache", None, 405, None),
    ("abort by prefix only", "POST", "/abort_request", {"rid": "chatcmpl"}, 404, "rid"),
    ("policies: an empty name", "POST", "/policies", {"eviction": ""}, 400, "eviction"),
    ("stop an empty string", "POST", CHAT, chat(stop=""), 400, "stop"),
    ("abort: unknown rid", "POST", "/abort_request", {"rid": "nope"}, 404, "rid"),
    ("abort: no rid", "POST", "/abort_request", {}, 400, "rid"),
    ("unknown route", "GET", "/v2/whatever", None, 404, None),
    ("wrong method", "GET", CHAT, None, 405, None),
    ("body too large", "POST", CHAT, b'{"model": "tiny", "messages": "' + b"x" * (9 * 2**20) + b'"}', 413, None),
]


def send(url: str, method: str, path: str, body) -> httpx.Response:
    if body == "form":  # what an HTML form on another site can post without asking first
        kw = {"data": {"model": "tiny", "messages": "hi"}}
    elif body == "origin":  # fetch(url, {method: "POST", mode: "no-cors"}) from another site: no body, an Origin
        kw = {"headers": {"Origin": "https://elsewhere.example"}}
    elif body == "text":
        kw = {"content": b"{}", "headers": {"Content-Type": "text/plain"}}
    elif isinstance(body, bytes):
        kw = {"content": body, "headers": {"Content-Type": "application/json"}}
    else:
        kw = {"json": body} if body is not None else {}
    return httpx.request(method, url + path, timeout=30, **kw)


def test_bodiless_post_from_an_http_client(tiny_server):
    """SGLang's frontend flushes the cache with a POST that has no body and no Content-Type."""
    r = httpx.post(tiny_server.url + "/flush_cache", timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("name,method,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_input(tiny_server, name, method, path, body, status, param):
    r = send(tiny_server.url, method, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    if status == 404 and path == CHAT:
        assert err["code"] == "model_not_found"


def test_error_messages_say_what_to_do(tiny_server):
    r = httpx.post(tiny_server.url + COMP, json={"model": "tiny", "prompt": [5] * 2100})
    assert "2100 tokens" in r.json()["error"]["message"] and "2048" in r.json()["error"]["message"]
    r = httpx.post(tiny_server.url + CHAT, json=chat(max_tokens=5000))
    assert "lower max_new_tokens to at most" in r.json()["error"]["message"]


def test_server_keeps_serving_after_bad_input(tiny_server):
    for _, method, path, body, _, _ in CASES:
        send(tiny_server.url, method, path, body)
    assert httpx.get(tiny_server.url + "/health").json() == {"status": "ok", "tp_ranks": 1}
    ok = httpx.post(tiny_server.url + CHAT, json=chat(), timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None
    info = httpx.get(tiny_server.url + "/get_server_info").json()
    assert info["status"]["protected"] == 0 and info["status"]["running"] == 0


def print_table() -> str:
    """The table for humans: python -c 'import tests.test_server_bad_input as t; print(t.print_table())'."""
    return "\n".join(f"| {n} | {m} {p} | {s} |" for n, m, p, _, s, _ in CASES)


def test_streaming_request_refused_before_the_stream_starts(tiny_server):
    r = httpx.post(tiny_server.url + COMP, json={"model": "tiny", "prompt": [5] * 2100, "stream": True})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert json.loads(r.text)["error"]["param"] == "prompt"
