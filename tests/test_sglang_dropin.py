"""radixserve in SGLang's place (issue 27, items 1, 5, 8): the request bodies SGLang's own benchmarks and tests send
(copied from sglang 0.5.23's source, cited at each), fields SGLang ignores ignored and named in X-Ignored-Fields,
values that would change a request's meaning refused, and the OpenAI routes' echo, logprobs, stream shapes,
stop_regex, continue_final_message and /v1/models/{id} -- all on one tiny server."""
from __future__ import annotations

import importlib.util
import json
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from radixserve.server_process import ServerProcess

CHAT, COMP, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
FRONTEND = Path(__file__).resolve().parents[1] / ".venv" / "sglang-frontend"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tiny_models):
    """The flags of SGLang's radix-attention test (test/srt/test_radix_attention.py), on the tiny Llama."""
    proc = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32", "--served-model-name",
                         "tiny", "--chunked-prefill-size", "128", "--max-total-tokens", "20000")
    yield proc
    proc.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def sse(server, path: str, body: dict) -> tuple[httpx.Headers, list[dict]]:
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        headers = r.headers
    assert lines[-1] == "data: [DONE]"
    return headers, [json.loads(ln[6:]) for ln in lines[:-1]]


# -- item 1: what SGLang ignores is ignored, and named --------------------------------------------------------
def test_bench_serving_sglang_backend_body(server):
    """sglang/benchmark/serving.py, async_request_sglang_generate, with its defaults (no LoRA, no logprobs)."""
    payload = {"text": "The capital of France is", "sampling_params": {"temperature": 0.0, "max_new_tokens": 8,
                                                                      "ignore_eos": True},
               "stream": True, "lora_path": None, "return_logprob": False, "return_routed_experts": False,
               "logprob_start_len": -1}
    headers, events = sse(server, GEN, payload)
    assert headers["X-Ignored-Fields"] == "lora_path, return_routed_experts"
    assert events[-1]["meta_info"]["completion_tokens"] == 8 and events[-1]["text"]


def test_multiturn_cache_benchmark_hits_sglangs_expected_cached_tokens(server):
    """sglang/test/kits/cache_hit_kit.py: its payload (stream_options and lora_path "" included), its round barrier
    and its bound -- round r caches at least the previous round's prompt + output - 1 tokens (page size 1)."""
    def payload(ids: list[int]) -> dict:  # the kit's gen_payload
        return {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True},
                "stream": True, "stream_options": {"include_usage": True}, "lora_path": "",
                "return_logprob": False, "logprob_start_len": -1}

    def send(ids: list[int]) -> tuple[int, int, list[int], str]:
        headers, events = sse(server, GEN, payload(ids))
        first = next(e for e in events if e.get("output_ids"))  # the kit reads the counts from the first
        return first["meta_info"]["prompt_tokens"], first["meta_info"]["cached_tokens"], events[-1]["output_ids"], \
            headers["X-Ignored-Fields"]

    assert httpx.post(server.url + "/flush_cache", timeout=30).status_code == 200
    assert httpx.get(server.url + "/server_info", timeout=30).json()["page_size"] == 1  # what the kit asks
    rng = random.Random(1)
    histories = [[rng.randrange(100, 30000) for _ in range(32)] for _ in range(3)]
    previous = [0] * len(histories)
    with ThreadPoolExecutor(len(histories)) as pool:
        for round_num in range(3):
            results = list(pool.map(send, histories))
            for i, (prompt, cached, output_ids, ignored) in enumerate(results):
                assert ignored == "stream_options, lora_path"
                assert prompt == len(histories[i]) and len(output_ids) == 4
                expected = 0 if round_num == 0 else previous[i] + 4 - 1
                assert expected <= cached <= prompt, (round_num, i, cached, expected)
                previous[i] = prompt
                histories[i] += output_ids + [rng.randrange(100, 30000) for _ in range(32)]


def test_unknown_fields_are_ignored_and_named_in_the_header(server):
    r = post(server, CHAT, {"model": "tiny", "messages": FRANCE, "max_tokens": 2, "temprature": 0.5,
                            "U\u00abf": 1, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    # percent-encoded: any name is one ASCII token; stream_options is moot without stream
    assert r.headers["X-Ignored-Fields"] == "temprature, U%C2%ABf, stream_options"
    plain = post(server, COMP, {"model": "tiny", "prompt": "a", "max_tokens": 1})
    assert plain.status_code == 200 and "X-Ignored-Fields" not in plain.headers


@pytest.mark.parametrize("path,field,value", [
    (GEN, "lora_path", "my-adapter"), (GEN, "return_hidden_states", True), (GEN, "token_ids_logprob", [5]),
    (GEN, "session_params", {"id": "s"}), (CHAT, "lora_path", ["my-adapter"]), (CHAT, "chat_template_kwargs",
                                                                              {"enable_thinking": False}),
    (COMP, "cache_salt", "tenant-a"), (COMP, "bootstrap_host", "10.0.0.2"),
])
def test_a_value_that_would_change_the_meaning_is_refused_naming_it(server, path, field, value):
    body = {GEN: {"text": "a", "sampling_params": {"max_new_tokens": 1}}, CHAT: {"messages": FRANCE, "max_tokens": 1},
            COMP: {"prompt": "a", "max_tokens": 1}}[path]
    r = post(server, path, {**body, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["code"] == "unsupported_field" and field in err["message"]
    empty = post(server, path, {**body, field: None if value is True else type(value)()})
    assert empty.status_code == 200 and field in empty.headers["X-Ignored-Fields"], "empty: ignored"


# -- item 8: one request of SGLang's radix-attention test -------------------------------------------------------
def test_401_prompts_of_sglangs_radix_attention_test_in_one_request(server):
    """test/srt/test_radix_attention.py's gen_radix_tree / run_test, with shorter chunks and decodes (a CPU)."""
    rng = random.Random(0)
    nodes = [{"input_ids": [37] * 117, "decode_len": 4}]
    for _ in range(200):
        parent = rng.choice(nodes)
        nodes.append({"input_ids": parent["input_ids"] + [rng.randint(0, 32000)] * rng.randint(0, 8),
                      "decode_len": rng.randint(0, 3)})
    left = 200
    while left > 0:
        branch, parent = rng.randint(1, min(left, 10)), rng.choice(nodes)
        nodes += [{"input_ids": parent["input_ids"] + [rng.randint(0, 32000)] * rng.randint(0, 8),
                   "decode_len": rng.randint(0, 3)} for _ in range(branch)]
        left -= branch
    rng.shuffle(nodes)
    assert len(nodes) == 401
    data = {"input_ids": [n["input_ids"] for n in nodes],
            "sampling_params": [{"max_new_tokens": n["decode_len"], "temperature": 0} for n in nodes]}
    r = post(server, GEN, data)
    assert r.status_code == 200, r.text[:500]
    out = r.json()
    assert [o["meta_info"]["completion_tokens"] for o in out] == [n["decode_len"] for n in nodes]
    flood = post(server, GEN, {"text": ["x"] * (1024 + 128 + 1), "sampling_params": {"max_new_tokens": 1}})
    assert flood.status_code == 429 and flood.json()["error"]["code"] == "too_many_sequences", "the cap still holds"


# -- item 5: the OpenAI routes --------------------------------------------------------------------------------
def test_echo_with_token_id_prompts(server):
    ids = [[504, 3575, 282, 4649, 314], [1, 504, 3575, 2]]  # the second with special tokens: echoed without them
    texts = post(server, "/detokenize", {"tokens": ids}).json()["text"]
    r = post(server, COMP, {"model": "tiny", "prompt": ids, "echo": True, "max_tokens": 3, "n": 2,
                            "temperature": 0})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["text"][: len(texts[c["index"] // 2])] for c in choices] == [texts[0], texts[0], texts[1], texts[1]]
    assert "<|" not in texts[1] and len(texts[1]) < len(post(server, "/detokenize", {
        "tokens": ids[1], "skip_special_tokens": False}).json()["text"])
    one = post(server, COMP, {"model": "tiny", "prompt": ids[0], "echo": True, "max_tokens": 2})
    assert one.json()["choices"][0]["text"].startswith(texts[0])


def test_echo_with_logprobs_covers_the_prompt_streamed_or_not(server):
    body = {"model": "tiny", "prompt": "The capital of France is", "echo": True, "logprobs": 2, "max_tokens": 4,
            "temperature": 0}
    r = post(server, COMP, body).json()
    choice, usage = r["choices"][0], r["usage"]
    lp = choice["logprobs"]
    assert choice["text"].startswith("The capital of France is")
    assert len(lp["tokens"]) == usage["prompt_tokens"] + usage["completion_tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None, "the first token has no logprob"
    assert all(x <= 0 for x in lp["token_logprobs"][1:]) and all(len(t) <= 2 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert "".join(lp["tokens"][: usage["prompt_tokens"]]) == "The capital of France is"
    _, events = sse(server, COMP, {**body, "stream": True})
    chunks = [e["choices"][0] for e in events]
    assert chunks[0]["text"].startswith("The capital of France is"), "the echo rides on the first chunk"
    assert "".join(c["text"] for c in chunks) == choice["text"]
    streamed = {k: sum((c["logprobs"][k] for c in chunks if c["logprobs"]), []) for k in lp}
    assert streamed == lp


def test_streamed_chunks_are_shaped_as_sglangs(server):
    sse_utils = sglang_sse_utils()

    def sglang(**kw) -> dict:
        return json.loads(sse_utils.build_sse_content(chunk_id="x", created=0, model="tiny", index=0, **kw)[6:])

    headers, events = sse(server, CHAT, {"model": "tiny", "messages": FRANCE, "max_tokens": 6, "stream": True})
    assert "X-Ignored-Fields" not in headers
    role, *content, finish = events
    assert shape(role) == shape(sglang(role="assistant", content=""))
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": "", "reasoning_content": None}
    assert content and all(shape(c) == shape(sglang(content="x")) for c in content)
    assert all(c["choices"][0]["delta"]["content"] for c in content), "no empty content chunks"
    assert shape(finish) == shape(sglang(finish_reason="length"))
    assert finish["choices"][0]["delta"] == {"reasoning_content": None}

    _, events = sse(server, COMP, {"model": "tiny", "prompt": "a", "max_tokens": 6, "stream": True})
    keys = {"index", "text", "logprobs", "finish_reason", "matched_stop"}  # SGLang's CompletionResponseStreamChoice
    assert all(set(e["choices"][0]) == keys for e in events)
    assert [e["choices"][0]["finish_reason"] for e in events] == [None] * (len(events) - 1) + ["length"]
    assert all(e["choices"][0]["text"] for e in events[:-1]), "no empty chunk before the finish"


def test_stop_regex_on_both_openai_routes(server):
    for path, body, text_of in [
        (COMP, {"prompt": "1, 2, 3,"}, lambda c: c["text"]),
        (CHAT, {"messages": FRANCE}, lambda c: c["message"]["content"]),
    ]:
        base = {"model": "tiny", "max_tokens": 24, "temperature": 0, **body}
        full = text_of(post(server, path, base).json()["choices"][0])
        # a word of the output past its start (letters and digits: the same as a pattern): the cut comes before it
        word = next(w for w in full[4:].split() if w.isascii() and w.isalnum())
        cut = post(server, path, {**base, "stop_regex": ["zzz{9}", word]}).json()["choices"][0]
        assert cut["finish_reason"] == "stop" and cut["matched_stop"] == word
        assert text_of(cut) == full[: full.index(word)]
    bad = post(server, COMP, {"model": "tiny", "prompt": "a", "stop_regex": "(a)\\1"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_regex"


def test_continue_final_message_prefills_the_assistants_answer(server, tiny_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    messages = [*FRANCE, {"role": "assistant", "content": "The capital is"}]
    rendered = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True) + "The capital is"
    assert rendered == tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    base = {"model": "tiny", "max_tokens": 5, "temperature": 0}
    chat = post(server, CHAT, {**base, "messages": messages, "continue_final_message": True}).json()
    same = post(server, COMP, {**base, "prompt": rendered}).json()
    assert chat["usage"]["prompt_tokens"] == same["usage"]["prompt_tokens"]
    assert chat["choices"][0]["message"]["content"] == same["choices"][0]["text"]
    closed = post(server, CHAT, {**base, "messages": messages}).json()
    assert closed["usage"]["prompt_tokens"] > chat["usage"]["prompt_tokens"], "without it the turn is closed"
    user_last = post(server, CHAT, {**base, "messages": FRANCE, "continue_final_message": True}).json()
    plain = post(server, CHAT, {**base, "messages": FRANCE}).json()
    assert user_last["usage"] == plain["usage"], "a last message of the user's: no effect, as in SGLang"


def test_models_by_id(server):
    card = httpx.get(server.url + "/v1/models/tiny", timeout=30)
    assert card.status_code == 200 and card.json()["id"] == "tiny" and card.json()["object"] == "model"
    assert card.json() == httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
    missing = httpx.get(server.url + "/v1/models/org/other-model", timeout=30)
    assert missing.status_code == 404
    err = missing.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "model_not_found"
    assert "org/other-model" in err["message"]


def test_server_info_has_sglangs_names(server):
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    assert info["max_total_num_tokens"] == info["max_total_tokens"] == 20000
    assert info["max_req_input_len"] == 2048 - 1  # the context (2048) is below the pool
    assert (info["tp_size"], info["dp_size"], info["page_size"]) == (1, 1, 1)
    assert info["chunked_prefill_size"] == 128 and info["schedule_policy"] == "fcfs"
    assert info["served_model_name"] == "tiny" and isinstance(info["model_path"], str)
    assert len(info["internal_states"]) == 1 and info["internal_states"][0].get("avg_spec_accept_length") is None
    assert info["server_args"]["tp"] == 1, "radixserve's own fields stay"


# -- helpers ------------------------------------------------------------------------------------------------
def shape(value):
    """A JSON value's structure: the keys of objects, the types of values (None kept apart)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items() if k not in ("id", "created", "model")}
    if isinstance(value, list):
        return [shape(v) for v in value]
    return None if value is None else type(value).__name__


def sglang_sse_utils():
    """SGLang's own chat chunk builder (msgspec only), loaded from its file: no SGLang server imports."""
    path = FRONTEND / "sglang" / "srt" / "entrypoints" / "openai" / "sse_utils.py"
    if not path.exists():
        pytest.skip(f"SGLang's source is not installed in {FRONTEND}: run `make install`")
    spec = importlib.util.spec_from_file_location("sglang_sse_utils", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec resolves the Structs' annotations through it
    spec.loader.exec_module(module)
    return module
