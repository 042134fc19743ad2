"""Fuzz every route of a live server with hypothesis, in concurrent batches of requests.

What is thrown: near-valid bodies (a valid request per route whose fields are replaced by random JSON values,
dropped, retyped, or joined by unknown ones; token ids out of the vocabulary; sampling values past their ranges),
fully random JSON, broken bytes, and sometimes the wrong method, content type or path.

What is asserted for every answer: no 5xx; every 4xx is OpenAI's ``{"error": {"message", "type", "param",
"code"}}`` with a message; a wrong method is 405, a POST that is not JSON 415, an unknown path 404; a 200 is a
real answer (a stream is SSE ending in ``[DONE]``, an error inside it in OpenAI's shape too).
What is asserted after every batch: the server and each actor are alive, /health is ok, a good chat request is
answered, and once idle no request holds KV (nothing running or protected, free + evictable = capacity).
"""
from __future__ import annotations

import copy
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

CHAT, COMP, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
ROUTES: dict[str, set[str]] = {  # the methods each route is registered for
    CHAT: {"POST"}, COMP: {"POST"}, GEN: {"POST"}, "/abort_request": {"POST"}, "/flush_cache": {"POST"},
    "/policies": {"GET", "POST"}, "/cache/stats": {"GET"}, "/v1/models": {"GET"}, "/get_server_info": {"GET"},
    "/health": {"GET"}, "/metrics": {"GET"}, "/health_generate": {"GET"}, "/tokenize": {"POST"},
    "/detokenize": {"POST"}, "/v1/tokenize": {"POST"}, "/v1/detokenize": {"POST"},
}
UNKNOWN_PATHS = ["/", "/v1/chat/completions/", "/v1/embeddings", "/generate/x"]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH"]
JSON_TYPES = ["application/json", "application/json; charset=utf-8"]
OTHER_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
               "application/octet-stream", None]
DOCUMENTED_4XX = {400, 404, 405, 413, 415, 429}

CONTEXT = 2048  # tiny_server's context length
VOCAB = 49152  # the SmolLM2 tokenizer's size, which tiny_server's model shares
MAX_VALID_NEW_TOKENS = 8  # a valid longer generation runs the same code for longer: accepted requests stay quick
MAX_VALID_N = 3
BATCH = 25
TIMEOUT_S = 60
GOOD_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
# no shrinking: each try re-sends a batch to the live server, and the failing call is named by the assertion
FUZZ = dict(deadline=None, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                   HealthCheck.data_too_large])

# -- random JSON -----------------------------------------------------------------------------------------
SPECIAL_TEXTS = ["", " ", "hi", "x" * 3000, "\ud800", "a\udfffb", "\x00", "\u200b\u202e", "🦙" * 40, "\r\n\t",
                 "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>", "{{ raise_exception('x') }}", "a" * 1025]
TEXTS = st.one_of(st.text(max_size=12), st.sampled_from(SPECIAL_TEXTS))
INTS = st.one_of(st.integers(-3, 70), st.integers(), st.sampled_from(
    [10**30, -10**30, 2**64, 2**63, 2**63 - 1, -2**63, -2**63 - 1, 2**31, 2**31 - 1, -2**31 - 1, VOCAB]))
FLOATS = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(
    [1e308, -1e308, -0.0, 5e-324, 1e-300, 2.0000001, float("inf"), float("nan")]))  # inf/nan: not JSON at all
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXTS)
JSON_VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXTS, inner, max_size=4), max_leaves=10)

# -- values near each field's range ----------------------------------------------------------------------
TOKEN_IDS = st.one_of(st.integers(0, VOCAB - 1),
                      st.sampled_from([0, 1, 2, VOCAB - 1, VOCAB, -1, 2**31, 2**63, 10**30]))
ID_LISTS = st.one_of(st.lists(TOKEN_IDS, max_size=12), st.just([5] * 1500), st.just([5] * 2100))
TOO_MANY = 1200  # prompts in one request: past --max-sequences-per-request (default 1024 + 128), a 429
LONG = st.integers(1, 1100)  # prompts up to near the KV pool (1200 tokens): together they force eviction
VALID_IDS = st.one_of(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
                      st.builds(lambda n, t: [t] * n, LONG, st.integers(0, VOCAB - 1)))
VALID_TEXT = st.one_of(st.text(min_size=1, max_size=16), st.builds(lambda n: "a b" * (n // 3 + 1), LONG))
LENGTHS = st.one_of(st.integers(1, MAX_VALID_NEW_TOKENS),
                    st.sampled_from([0, -1, CONTEXT, 5000, 2**31, 2**63, 10**30, -2**63, 1.5, "4", None]))
STOPS = st.one_of(st.none(), TEXTS, st.lists(TEXTS, max_size=4),
                  st.sampled_from([[""], ["x" * 1025], [f"s{i}" for i in range(33)], [" ", "e", "a"]]))
LIVE_RIDS = st.sampled_from(["fuzz-0", "fuzz-1", "fuzz-1-0", "fuzz-2"])  # shared by generations and aborts
RIDS = st.one_of(LIVE_RIDS, st.sampled_from(["", "r" * 257]),
                 st.lists(st.sampled_from(["fuzz-0", "fuzz-1", "fuzz-2"]), max_size=3), TEXTS)
PRIORITIES = st.one_of(st.integers(-5, 5), st.sampled_from([2**31 - 1, 2**31, -2**31, -2**31 - 1]))
EVICTIONS = ["lru", "lfu", "fifo", "filo", "mru", "gdsf", "slru", "priority", "nope"]
SCHEDULES = ["fcfs", "lpm", "lpm-aging", "dfs-weight", "lof", "random", "priority", "nope"]

SAMPLING = {
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from([-0.0, -1, 2.5, 1e308, 1e-300, 1e-45])),
    "top_p": st.one_of(st.floats(0, 1), st.sampled_from([1e-300, 1.5, -0.0])),
    "top_k": st.one_of(st.integers(-2, 60), st.sampled_from([VOCAB, VOCAB + 1, 2**31, 3_000_000_000, -2**63])),
    "min_p": st.one_of(st.floats(-0.5, 1.5), st.just(1.0)),
    "seed": INTS,
    "stop": STOPS,
    "stop_token_ids": st.one_of(st.lists(TOKEN_IDS, max_size=4), st.just(list(range(1025)))),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "presence_penalty": st.one_of(st.floats(-2, 2), st.sampled_from([-2.5, 3.0, 1e308])),
    "frequency_penalty": st.one_of(st.floats(-2, 2), st.sampled_from([-3.0, 2.01])),
    "repetition_penalty": st.one_of(st.floats(0.01, 2), st.sampled_from([0, -1, 2.5, 1e-300])),
    "logit_bias": st.one_of(st.just({}), st.dictionaries(TEXTS, FLOATS, max_size=3),
                            st.dictionaries(st.one_of(TOKEN_IDS.map(str), st.just("-1")),
                                            st.one_of(st.floats(-100, 100), FLOATS), max_size=4)),
}
PART = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": TEXTS}),
                 st.just({"type": "image_url", "image_url": {"url": "x"}}), st.dictionaries(TEXTS, JSON_VALUES))
MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "developer", "user", "assistant", "tool"]), TEXTS),
     "content": st.one_of(TEXTS, st.none(), st.lists(PART, max_size=3))},
    optional={"name": TEXTS, "tool_call_id": TEXTS, "extra": JSON_VALUES})
OPENAI = {
    **SAMPLING,
    "model": st.one_of(st.just("tiny"), TEXTS),
    "max_tokens": LENGTHS,
    "n": st.one_of(st.integers(1, MAX_VALID_N), st.sampled_from([0, -1, 65, 1000, 10**30])),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
    "priority": PRIORITIES,
    "user": TEXTS,
    "min_tokens": st.one_of(st.integers(-1, 12), st.just(10**30)),
    "rid": RIDS,
}
FIELDS: dict[str, dict[str, st.SearchStrategy]] = {
    CHAT: {**OPENAI, "messages": st.one_of(st.lists(MESSAGE, max_size=4), TEXTS), "max_completion_tokens": LENGTHS,
           "logprobs": st.booleans(), "top_logprobs": st.integers(-1, 21),
           "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {}]),
           "tools": st.sampled_from([[], [{"type": "function", "function": {"name": "f"}}]]),
           "tool_choice": JSON_VALUES, "metadata": JSON_VALUES},
    COMP: {**OPENAI, "prompt": st.one_of(TEXTS, st.lists(TEXTS, max_size=4), ID_LISTS, st.lists(ID_LISTS, max_size=3),
                               st.just([[5]] * TOO_MANY)),
           "logprobs": st.integers(-1, 21), "echo": st.booleans(), "suffix": TEXTS, "best_of": st.integers(-1, 4)},
    GEN: {"text": st.one_of(TEXTS, st.lists(TEXTS, max_size=4), st.just(["a"] * TOO_MANY)),
          "input_ids": st.one_of(ID_LISTS, st.lists(ID_LISTS, max_size=3)),
          "sampling_params": st.dictionaries(st.sampled_from(sorted(SAMPLING)), JSON_VALUES, max_size=3),
          "stream": st.booleans(), "return_logprob": st.booleans(), "top_logprobs_num": st.integers(-1, 21),
          "rid": RIDS, "priority": PRIORITIES,
          **{f"sampling_params.{k}": v for k, v in {**SAMPLING, "max_new_tokens": LENGTHS}.items()}},
    "/abort_request": {"rid": RIDS},
    "/tokenize": {"model": st.one_of(st.just("tiny"), TEXTS), "prompt": st.one_of(TEXTS, st.lists(TEXTS, max_size=3)),
                  "messages": st.one_of(st.lists(MESSAGE, max_size=3), TEXTS), "add_special_tokens": st.booleans(),
                  "add_generation_prompt": st.booleans()},
    "/detokenize": {"model": st.one_of(st.just("tiny"), TEXTS), "skip_special_tokens": st.booleans(),
                    "tokens": st.one_of(ID_LISTS, st.lists(ID_LISTS, max_size=3), st.just([]), TEXTS)},
    "/flush_cache": {},
    "/policies": {"eviction": st.one_of(st.sampled_from(EVICTIONS), TEXTS),
                  "schedule": st.one_of(st.sampled_from(SCHEDULES), TEXTS)},
}

# -- valid bodies, and their mutations -------------------------------------------------------------------
SMALL = st.integers(1, MAX_VALID_NEW_TOKENS)
VALID_PRIORITY = st.integers(-2**31, 2**31 - 1)
VALID_SAMPLING = {  # in range, so that they reach the scheduler and the sampler
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.one_of(st.integers(-1, 50), st.just(VOCAB)),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-2**63, 2**63 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "ignore_eos": st.booleans(),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.05, 2),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3),
    "n": st.integers(1, MAX_VALID_N),
}
VALID_OPENAI = {**VALID_SAMPLING, "stream": st.booleans(), "n": st.integers(1, MAX_VALID_N), "priority": VALID_PRIORITY}
VALID_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                 "content": VALID_TEXT}), min_size=1, max_size=3)
VALID_TEXTS = st.one_of(VALID_TEXT, st.lists(VALID_TEXT, min_size=1, max_size=3))
VALID_BODIES: dict[str, st.SearchStrategy[dict]] = {
    CHAT: st.fixed_dictionaries({"model": st.just("tiny"), "max_tokens": SMALL, "messages": VALID_MESSAGES},
                                optional={**VALID_OPENAI, "logprobs": st.booleans()}),
    COMP: st.fixed_dictionaries({"model": st.just("tiny"), "max_tokens": SMALL,
                                 "prompt": st.one_of(VALID_TEXTS, VALID_IDS)},
                                optional={**VALID_OPENAI, "logprobs": st.integers(0, 3), "echo": st.booleans()}),
    GEN: st.builds(lambda prompt, rest: {**prompt, **rest},
                   st.one_of(st.fixed_dictionaries({"text": VALID_TEXTS}),
                             st.fixed_dictionaries({"input_ids": VALID_IDS})),
                   st.fixed_dictionaries(
                       {"sampling_params": st.fixed_dictionaries({"max_new_tokens": SMALL}, optional=VALID_SAMPLING)},
                       optional={"stream": st.booleans(), "rid": LIVE_RIDS, "return_logprob": st.booleans(),
                                 "top_logprobs_num": st.integers(0, 3), "priority": VALID_PRIORITY})),
    "/abort_request": st.fixed_dictionaries({"rid": LIVE_RIDS}),
    "/tokenize": st.one_of(st.fixed_dictionaries({"prompt": VALID_TEXTS}, optional={"add_special_tokens": st.booleans()}),
                           st.fixed_dictionaries({"messages": VALID_MESSAGES})),
    "/detokenize": st.fixed_dictionaries({"tokens": st.one_of(VALID_IDS, st.lists(VALID_IDS, max_size=3))}),
    "/flush_cache": st.builds(dict),  # a new dict each time: mutations must not pile up
    "/policies": st.fixed_dictionaries({}, optional={"eviction": st.sampled_from(EVICTIONS),
                                                     "schedule": st.sampled_from(SCHEDULES)}),
}


for _path in ("/tokenize", "/detokenize"):  # the same routes under /v1
    FIELDS["/v1" + _path], VALID_BODIES["/v1" + _path] = FIELDS[_path], VALID_BODIES[_path]


def set_field(body: dict, name: str, value: Any) -> None:
    """``name`` may be "sampling_params.top_k": set inside the nested object (made anew if it is not one)."""
    if "." in name:
        outer, inner = name.split(".", 1)
        if not isinstance(body.get(outer), dict):
            body[outer] = {}
        body[outer][inner] = value
    else:
        body[name] = value


def retyped(value: Any) -> Any:
    """The same content in another JSON type: str <-> list, number -> str, object -> list."""
    if isinstance(value, list):
        return value[0] if value else ""
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return [value]


def bounded(path: str, body: Any) -> Any:
    """Cap valid lengths and n, and give a length where none is (the default is 128 tokens): a longer valid
    generation runs the same code for longer. Invalid values stay as drawn."""
    if not isinstance(body, dict):
        return body
    if path == CHAT and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_VALID_NEW_TOKENS
    if path == GEN:
        body["sampling_params"] = {} if body.get("sampling_params") is None else body["sampling_params"]
        if isinstance(body["sampling_params"], dict) and body["sampling_params"].get("max_new_tokens") is None:
            body["sampling_params"]["max_new_tokens"] = MAX_VALID_NEW_TOKENS
    for d in (body, body.get("sampling_params")):
        if not isinstance(d, dict):
            continue
        for key in ("max_tokens", "max_completion_tokens", "max_new_tokens"):
            if type(d.get(key)) is int and MAX_VALID_NEW_TOKENS < d[key] < CONTEXT:
                d[key] = MAX_VALID_NEW_TOKENS
        if type(d.get("n")) is int and MAX_VALID_N < d["n"] <= (1152 if d is not body else 64):  # past 1152: 429
            d["n"] = MAX_VALID_N
    return body


@st.composite
def near_valid_bodies(draw, path: str) -> Any:
    body = draw(VALID_BODIES[path])
    fields = FIELDS[path]
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3]))):
        op = draw(st.sampled_from(["set", "set", "set", "drop", "unknown", "retype"]))
        if op == "set" and fields:
            name = draw(st.sampled_from(sorted(fields)))
            set_field(body, name, copy.deepcopy(draw(st.one_of(fields[name], JSON_VALUES))))  # bounded() edits it
        elif op == "unknown":
            body[draw(TEXTS)] = draw(JSON_VALUES)
        elif body:
            key = draw(st.sampled_from(sorted(body)))
            if op == "drop":
                del body[key]
            else:
                body[key] = retyped(body[key])
    return bounded(path, body)


@st.composite
def broken_bytes(draw, path: str) -> bytes:
    valid = json.dumps(draw(VALID_BODIES.get(path, st.just({"model": "tiny"})))).encode()
    depth = draw(st.sampled_from([64, 5000, 100_000]))
    return draw(st.sampled_from([
        valid[: draw(st.integers(0, max(len(valid) - 1, 0)))], b"\xef\xbb\xbf" + valid, valid + b" trailing",
        valid.replace(b'"', b"'"), valid.decode().encode("utf-16"), b"", b"null", b"0", b'"tiny"', b"[]",
        b"[" * depth + b"]" * depth, b'{"a": ' * depth + b"1" + b"}" * depth, b'{"model": NaN}',
        b'{"model": "tiny", "model": "other", ' + valid[1:], valid[:-1] + b', "x": "\xff\xfe"}',
        draw(st.binary(max_size=40)),
    ]))


@dataclass(frozen=True)
class Call:
    """One HTTP request as sent; its repr is a reproduction."""

    method: str
    path: str
    content_type: str | None
    body: bytes | None

    def __repr__(self) -> str:
        return f"Call({self.method} {self.path}, Content-Type: {self.content_type}, body={self.body!r})"

    @property
    def expected_status(self) -> int | None:
        """The status this call must get whatever its body says, if there is one."""
        methods = ROUTES.get(self.path)
        if methods is None:
            return 404
        if self.method not in methods:
            return 405
        if self.method == "POST" and self.content_type not in JSON_TYPES:
            return 415
        return None


@st.composite
def calls(draw, paths: list[str], surface: bool) -> Call:
    """A request to one of ``paths``; ``surface``: also fuzz the method and content type (1 call in 4)."""
    path = draw(st.sampled_from(paths))
    methods = sorted(ROUTES.get(path, {"GET"}))
    odd = surface and draw(st.integers(0, 3)) == 0
    method = draw(st.sampled_from(METHODS if odd else methods))
    content_type = draw(st.sampled_from(OTHER_TYPES + JSON_TYPES if odd else JSON_TYPES))
    kind = draw(st.integers(0, 9))
    if kind == 9:
        return Call(method, path, content_type, draw(broken_bytes(path)))
    if kind == 8:
        value = draw(JSON_VALUES)
    elif path in VALID_BODIES:
        value = draw(near_valid_bodies(path))
    else:  # a GET route: mostly no body at all
        return Call(method, path, content_type, None)
    text = json.dumps(value, ensure_ascii=draw(st.booleans()))
    return Call(method, path, content_type, text.encode("utf-8", "surrogatepass"))


# -- sending and judging ---------------------------------------------------------------------------------
def send(client: httpx.Client, call: Call) -> httpx.Response:
    headers = {"Content-Type": call.content_type} if call.content_type else {}
    try:
        return client.request(call.method, call.path, content=call.body, headers=headers)
    except httpx.HTTPError as exc:
        raise AssertionError(f"{call!r} got no answer within {TIMEOUT_S}s: {exc!r}") from exc


def assert_openai_error(where: str, error: Any) -> None:
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, where
    assert isinstance(error["message"], str) and error["message"].strip(), where
    assert isinstance(error["type"], str) and error["type"], where
    assert error["param"] is None or isinstance(error["param"], str), where
    assert error["code"] is None or isinstance(error["code"], str), where


def assert_documented(call: Call, answer: httpx.Response) -> None:
    where = f"{call!r} -> {answer.status_code} {answer.content[:600]!r}"
    assert answer.status_code < 500, where
    if call.expected_status is not None:
        assert answer.status_code == call.expected_status, where
    if answer.status_code >= 400:
        assert answer.status_code in DOCUMENTED_4XX, where
        body = json.loads(answer.content)
        assert isinstance(body, dict) and set(body) == {"error"}, where
        assert_openai_error(where, body["error"])
        if answer.status_code == 429:
            assert "Retry-After" in answer.headers, where
        return
    assert answer.status_code == 200, where
    if answer.headers.get("content-type", "").startswith("text/event-stream"):
        events = [e for e in answer.content.split(b"\n\n") if e.strip()]
        assert events and events[-1] == b"data: [DONE]", where
        for event in events[:-1]:
            assert event.startswith(b"data: "), where
            payload = json.loads(event[len(b"data: "):])
            if "error" in payload:
                assert_openai_error(where, payload["error"])
    elif call.path != "/metrics":
        body = json.loads(answer.content)
        if call.path in (CHAT, COMP):
            assert body["choices"], where
        elif call.path == GEN:
            assert all("text" in out for out in (body if isinstance(body, list) else [body])), where


def send_batch(server, batch: list[Call]) -> None:
    """Concurrently, so that fuzzed requests share scheduler steps and sampler batches (and aborts find them).
    An exception the server caught and logged (an internal error, a message it could not handle) fails too."""
    log_start = len(server.output())
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as client, ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda call: send(client, call), batch))
    for call, answer in zip(batch, answers):
        assert_documented(call, answer)
    logged = server.output()[log_start:]
    assert "Traceback" not in logged, f"the server logged an exception during the batch:\n{logged[-4000:]}"


# -- the server after a batch ----------------------------------------------------------------------------
def alive(pid: int) -> bool:
    """kill(pid, 0) succeeds on a zombie too, so its state is read from /proc: Z (zombie) or X (dead) is dead."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def idle_status(client: httpx.Client, within_s: float = 5.0) -> dict:
    """The scheduler's status once nothing runs (it is pushed a few times a second): the last one seen."""
    deadline = time.monotonic() + within_s
    while True:
        info = client.get("/get_server_info").json()
        status = info["status"]
        busy = info["in_flight"] + status["running"] + status["waiting"] + status["protected"]
        if not busy or time.monotonic() > deadline:
            return {**status, "in_flight": info["in_flight"]}
        time.sleep(0.05)


def assert_still_serving(server) -> None:
    log_tail = lambda: server.output()[-4000:]  # noqa: E731
    assert server.proc.poll() is None, f"the server exited with {server.proc.returncode}:\n{log_tail()}"
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as client:
        health = client.get("/health")
        assert health.status_code == 200 and health.json() == {"status": "ok", "tp_ranks": 1}, health.text
        for name, actor in client.get("/get_server_info").json()["actors"].items():
            assert alive(actor["pid"]), f"the {name} actor (pid {actor['pid']}) died:\n{log_tail()}"
        good = client.post(CHAT, json=GOOD_CHAT)
        assert good.status_code == 200, good.text
        assert isinstance(good.json()["choices"][0]["message"]["content"], str), good.text
        status = idle_status(client)
        assert status["in_flight"] == 0 and status["running"] == 0 and status["waiting"] == 0, status
        assert status["protected"] == 0, f"KV still locked once idle: {status}"
        pool = client.get("/cache/stats").json()["pool"]
        assert pool["owned_by_requests"] == 0 and pool["free"] + pool["evictable"] == pool["capacity"], \
            f"KV slots leaked (neither free nor in the cache) once idle: {pool}"


@pytest.fixture
def policies_restored(tiny_server):
    """The fuzzer switches policies; the tests after it find the server as it was."""
    before = httpx.get(tiny_server.url + "/policies").json()
    yield
    httpx.post(tiny_server.url + "/policies", json={"eviction": before["eviction"]["current"],
                                                    "schedule": before["schedule"]["current"]}).raise_for_status()


@settings(max_examples=10, **FUZZ)
@given(batch=st.lists(calls([CHAT, COMP, GEN, GEN, "/abort_request"], surface=False), min_size=BATCH,
                      max_size=BATCH))
def test_near_valid_generation_requests_get_documented_answers_and_the_server_keeps_serving(tiny_server, batch):
    send_batch(tiny_server, batch)
    assert_still_serving(tiny_server)


@settings(max_examples=6, **FUZZ)
@given(batch=st.lists(calls([*ROUTES, *ROUTES, *UNKNOWN_PATHS], surface=True), min_size=BATCH,
                      max_size=BATCH))
def test_any_route_method_and_content_type_gets_a_documented_answer_and_the_server_keeps_serving(
        tiny_server, policies_restored, batch):
    send_batch(tiny_server, batch)
    assert_still_serving(tiny_server)
