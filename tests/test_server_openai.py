"""The stock `openai` client against a real server subprocess on the bundled SmolLM2."""
from __future__ import annotations

import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused")


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_non_streaming(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=20)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_with_usage(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=20,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_and_stop_sequences(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens <= 8
    full = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=20)
    cut = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=20, stop=["Paris"])
    assert cut.choices[0].finish_reason == "stop"
    assert "Paris" not in cut.choices[0].message.content
    assert full.choices[0].message.content.startswith(cut.choices[0].message.content)
    streamed = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0,
                                         stop=[" 7"], stream=True)
    text = "".join(c.choices[0].text for c in streamed)
    assert "7" not in text and "5" in text


def test_shared_system_prompt_is_cached(client):
    system = {"role": "system", "content": "You are a meticulous librarian. Answer in one sentence. " * 8}
    client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": "Hi!"}], max_tokens=4)
    r = client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": "Hello?"}],
                                       max_tokens=4)
    assert r.usage.prompt_tokens_details.cached_tokens >= 80


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=5, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token, "greedy picks the most likely token"
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    assert len(c.choices[0].logprobs.tokens) == 3 and all(len(t) == 2 for t in c.choices[0].logprobs.top_logprobs)


def test_model_is_optional_and_a_wrong_one_is_404(smol_server):
    import httpx

    url = smol_server.url + "/v1"
    chat = httpx.post(url + "/chat/completions", json={"messages": FRANCE, "temperature": 0, "max_tokens": 20},
                      timeout=120)
    assert chat.status_code == 200 and chat.json()["model"] == MODEL and "Paris" in \
        chat.json()["choices"][0]["message"]["content"]
    comp = httpx.post(url + "/completions", json={"prompt": "The capital of France is", "max_tokens": 3},
                      timeout=120)
    assert comp.status_code == 200 and comp.json()["model"] == MODEL
    wrong = httpx.post(url + "/chat/completions", json={"model": "gpt-4", "messages": FRANCE}, timeout=60)
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"


def test_health_generate_runs_a_token_through_the_model(smol_server):
    import httpx

    r = httpx.get(smol_server.url + "/health_generate", timeout=60)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    stats = httpx.get(smol_server.url + "/cache/stats", timeout=60).json()
    assert stats["totals"]["requests_finished"] >= 1


def test_tokenize_and_detokenize_in_sglang_shapes(smol_server):
    import httpx
    from transformers import AutoTokenizer

    from radixserve.model.loader import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(None).path)
    url = smol_server.url
    one = httpx.post(url + "/tokenize", json={"prompt": "Hello world"}, timeout=60).json()
    assert one["tokens"] == tok("Hello world").input_ids and one["count"] == len(one["tokens"])
    assert one["max_model_len"] == httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["max_model_len"]
    many = httpx.post(url + "/v1/tokenize", json={"prompt": ["a b", "c"], "model": MODEL}, timeout=60).json()
    assert many["tokens"] == [tok("a b").input_ids, tok("c").input_ids]
    assert many["count"] == [len(t) for t in many["tokens"]]
    chat = httpx.post(url + "/tokenize", json={"messages": FRANCE}, timeout=60).json()
    want = tok.apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok(want, add_special_tokens=False).input_ids
    text = httpx.post(url + "/detokenize", json={"tokens": one["tokens"]}, timeout=60).json()
    assert text == {"text": "Hello world"}
    texts = httpx.post(url + "/detokenize", json={"tokens": many["tokens"]}, timeout=60).json()
    assert texts == {"text": ["a b", "c"]}
    special = httpx.post(url + "/detokenize", json={"tokens": chat["tokens"][:3], "skip_special_tokens": False},
                         timeout=60).json()["text"]
    assert special.startswith("<|im_start|>")
    for path, body, param in [("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": FRANCE}, "prompt"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"), ("/detokenize", {"tokens": "x"}, "tokens"),
                              ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "model")]:
        bad = httpx.post(url + path, json=body, timeout=60)
        assert bad.status_code in (400, 404) and bad.json()["error"]["param"] == param, (path, body, bad.text)


def test_penalties_and_logit_bias_through_the_openai_client(client):
    plain = client.completions.create(model=MODEL, prompt="Count: one, two,", max_tokens=12, temperature=0)
    forced = client.completions.create(model=MODEL, prompt="Count: one, two,", max_tokens=4, temperature=0,
                                       logit_bias={"28": 100})
    assert forced.choices[0].text != plain.choices[0].text[:len(forced.choices[0].text)]
    assert forced.choices[0].text == client.completions.create(
        model=MODEL, prompt="x", max_tokens=4, temperature=0, logit_bias={"28": 100}).choices[0].text
    penalized = client.completions.create(model=MODEL, prompt="Count: one, two,", max_tokens=12, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=2.0)
    assert penalized.choices[0].text != plain.choices[0].text
    short = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=30, temperature=0)
    held = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=30, temperature=0,
                                          extra_body={"min_tokens": 25, "repetition_penalty": 1.2})
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 25
    assert held.usage.completion_tokens >= 25


def test_n_on_generate(smol_server):
    import httpx

    r = httpx.post(smol_server.url + "/generate", json={"text": "Once upon a time", "sampling_params": {
        "max_new_tokens": 5, "temperature": 1.0, "seed": 3, "n": 3}}, timeout=60).json()
    assert isinstance(r, list) and len(r) == 3 and len({x["text"] for x in r}) > 1
    again = httpx.post(smol_server.url + "/generate", json={"text": "Once upon a time", "sampling_params": {
        "max_new_tokens": 5, "temperature": 1.0, "seed": 4}}, timeout=60).json()
    assert again["text"] == r[1]["text"]  # choice 1 is seed + 1
    too_many = httpx.post(smol_server.url + "/generate", json={"text": "x", "sampling_params": {"n": 100000}},
                          timeout=60)
    assert too_many.status_code == 429
