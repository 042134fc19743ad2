"""``radixserve router`` over two real servers (tiny model, float32): the same greedy tokens as a server asked
directly, streaming passed through, prefix groups kept on one worker by the cache-aware policy, and a worker that
dies taken out while every request still gets an answer from the other."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from radixserve.actors.router.server import route_text
from radixserve.server_process import ServerProcess

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def _post(url: str, body: dict, timeout: float = 60):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read().decode(), resp.headers.get("Content-Type", "")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)


def RouterProcess(*args: str) -> ServerProcess:
    return ServerProcess(*args, "--health-check-interval", "0.3", command="router")


@pytest.fixture(scope="module")
def workers(tiny_models):
    servers = [ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32",
                             "--max-total-tokens", "4096") for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


def test_route_text_reads_every_route():
    assert route_text("/v1/completions", {"prompt": "abc"}) == "abc"
    assert route_text("/v1/completions", {"prompt": ["first", "second"]}) == "first"
    assert route_text("/generate", {"input_ids": [1, 2, 3]}) == "1,2,3"
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [
        {"type": "text", "text": "hi"}]}]}
    assert route_text("/v1/chat/completions", chat) == "system:be brief\nuser:hi\n"
    assert route_text("/generate", "not an object") == ""


def test_the_router_serves_what_the_workers_serve_and_keeps_groups_together(workers):
    router = RouterProcess("--worker-urls", *(w.url for w in workers))
    try:
        prompt = "You are a helpful assistant. Always answer briefly and politely. Question: "
        direct = json.loads(_post(workers[0].url + "/generate", {"text": prompt + "one", "sampling_params": GREEDY})[0])
        routed = json.loads(_post(router.url + "/generate", {"text": prompt + "one", "sampling_params": GREEDY})[0])
        assert routed["output_ids"] == direct["output_ids"]
        for q in ("two", "three", "four"):  # the same group: the same worker
            _post(router.url + "/generate", {"text": prompt + q, "sampling_params": GREEDY})
        counts = sorted(w["routed"] for w in _get(router.url + "/workers")["workers"])
        assert counts == [0, 4]
        other = "Translate into French, word by word, keeping the punctuation as it is: "
        _post(router.url + "/generate", {"text": other + "cat", "sampling_params": GREEDY})
        assert sorted(w["routed"] for w in _get(router.url + "/workers")["workers"]) == [1, 4], "a new group: the idle one"
        text, kind = _post(router.url + "/v1/chat/completions", {
            "model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True})
        assert kind.startswith("text/event-stream") and text.rstrip().endswith("data: [DONE]")
        with pytest.raises(urllib.error.HTTPError) as bad:  # a worker's own 4xx passes through
            _post(router.url + "/v1/completions", {"model": "llama", "prompt": "x", "max_tokens": -1})
        assert bad.value.code == 400 and "error" in json.load(bad.value)
        assert _get(router.url + "/v1/models")["data"]
        tokens = json.loads(_post(router.url + "/tokenize", {"prompt": "hello"})[0])["tokens"]
        assert json.loads(_post(router.url + "/detokenize", {"tokens": tokens})[0]) == {"text": "hello"}
    finally:
        router.stop()


def test_a_worker_that_dies_is_taken_out_and_requests_still_get_answers(tiny_models):
    servers = [ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32",
                             "--max-total-tokens", "4096") for _ in range(2)]
    router = RouterProcess("--worker-urls", *(s.url for s in servers), "--policy", "round-robin")
    try:
        servers[1].proc.kill()
        servers[1].proc.wait()
        for i in range(4):  # round-robin would send every other one to the dead worker: retried, answered
            body = json.loads(_post(router.url + "/generate", {"text": f"hello {i}", "sampling_params": GREEDY})[0])
            assert len(body["output_ids"]) == GREEDY["max_new_tokens"]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            health = {w["url"]: w["healthy"] for w in _get(router.url + "/workers")["workers"]}
            if health == {servers[0].url: True, servers[1].url: False}:
                break
            time.sleep(0.2)
        assert health == {servers[0].url: True, servers[1].url: False}
        servers[0].proc.kill()
        servers[0].proc.wait()
        with pytest.raises(urllib.error.HTTPError) as none_left:
            _post(router.url + "/generate", {"text": "anyone?", "sampling_params": GREEDY})
        assert none_left.value.code == 503
    finally:
        router.stop()
        for s in servers:
            s.stop()


def test_a_stream_whose_worker_dies_ends_with_an_error_event(tiny_models):
    """Once tokens have been streamed the request cannot move: the client gets an error event, then [DONE]."""
    server = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32", "--max-total-tokens",
                           "8192")
    router = RouterProcess("--worker-urls", server.url)
    try:
        assert json.loads(_post(router.url + "/flush_cache", {})[0])["workers"][server.url]
        body = {"text": "count", "stream": True, "sampling_params": {"max_new_tokens": 2000, "temperature": 0,
                                                                     "ignore_eos": True}}
        req = urllib.request.Request(router.url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.readline().startswith(b"data: {")  # tokens are flowing
            server.proc.kill()
            rest = resp.read().decode()
        events = [line for line in rest.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == "worker_failed"
    finally:
        router.stop()
        server.stop()
