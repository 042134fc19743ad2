"""radixserve.lang against fake backends: prompt rendering, sampling payloads, fork/run_batch prefix sharing,
select scoring, streaming, errors, and RuntimeEndpoint over a stdlib HTTP server. No model, no GPU."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import radixserve.lang as sgl
from radixserve.lang import BackendError, ChatTemplate, RuntimeEndpoint

CHATML = ChatTemplate.by_name("chatml")
SMOL = ChatTemplate(CHATML.roles, "You are SmolLM.", ("<|im_end|>",))


class FakeBackend:
    """Char-level "tokenizer" (one token per character); records every payload; thread-safe.

    ``answer(payload) -> str`` gives a gen's text. Scoring calls give each choice token -0.1 if the choice is
    ``favour`` else -2.0, and the prompt's own last character -9.0 (it must be dropped from the scores).
    ``barrier``: every non-prefill gen waits there, proving that many calls are in flight at once.
    """

    def __init__(self, template: ChatTemplate | None = CHATML, answer: Any = "Paris", favour: str = "",
                 heal: bool = False, barrier: threading.Barrier | None = None, delay: float = 0.0) -> None:
        self.template, self.favour, self.heal, self.barrier, self.delay = template, favour, heal, barrier, delay
        self.answer = answer if callable(answer) else (lambda payload: answer)
        self.payloads: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0

    def model_info(self) -> dict[str, Any]:
        return {"model_path": "fake", "is_generation": True,
                "chat_template": self.template.to_dict() if self.template else None}

    def generate(self, payload: dict[str, Any]) -> Any:
        with self.lock:
            self.payloads.append(payload)
        if isinstance(payload["text"], list) and payload.get("return_logprob"):
            return [self._score(t, payload["logprob_start_len"]) for t in payload["text"]]
        if isinstance(payload["text"], list):  # n samples of one prompt
            return [self.generate({**payload, "text": t}) for t in payload["text"]]
        if payload["sampling_params"]["max_new_tokens"] == 0:
            return {"text": "", "output_ids": [], "meta_info": {"prompt_tokens": len(payload["text"]),
                                                                 "cached_tokens": 0}}
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.barrier is not None:
                self.barrier.wait()  # raises BrokenBarrierError after its timeout: the test fails, never hangs
            time.sleep(self.delay)
            text = self.answer(payload)
        finally:
            with self.lock:
                self.in_flight -= 1
        return {"text": text, "output_ids": [ord(c) for c in text],
                "meta_info": {"id": "r", "prompt_tokens": len(payload["text"]), "completion_tokens": len(text),
                              "cached_tokens": 0, "finish_reason": {"type": "stop", "matched": None}}}

    def _score(self, text: str, start: int) -> dict[str, Any]:
        choice = text[start + 1:]
        lp = -0.1 if choice == self.favour else -2.0
        if self.heal:  # the prompt's last character merged with the choice's first into one token
            triples = [[lp, 0, text[start:start + 2]]] + [[lp, ord(c), c] for c in text[start + 2:]]
        else:
            triples = [[-9.0, ord(text[start]), text[start]]] + [[lp, ord(c), c] for c in choice]
        return {"text": "", "meta_info": {"prompt_tokens": len(text), "input_token_logprobs": triples}}

    def generate_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with self.lock:
            self.payloads.append(payload)
        text = self.answer(payload)
        for end in range(1, len(text) + 1):
            time.sleep(0.001)
            yield {"text": text[:end], "output_ids": [], "meta_info": {"completion_tokens": end}, "index": 0}

    def flush_cache(self) -> None:
        self.payloads.append({"flush": True})

    def server_info(self) -> dict[str, Any]:
        return {"fake": True}

    def gens(self) -> list[dict[str, Any]]:
        return [p for p in self.payloads if "sampling_params" in p and p["sampling_params"]["max_new_tokens"] != 0]

    def prefills(self) -> list[dict[str, Any]]:
        return [p for p in self.payloads if "sampling_params" in p and p["sampling_params"]["max_new_tokens"] == 0
                and not p.get("return_logprob")]


@sgl.function
def qa(s, q):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(q)
    s += sgl.assistant(sgl.gen("answer", max_tokens=64))


def test_chat_rendering_gen_variables_and_stops_in_assistant_role():
    be = FakeBackend()
    state = qa.run(q="What is the capital of France?", backend=be, temperature=0.1, top_p=0.95)
    assert state.error() is None and state["answer"] == "Paris"
    prompt = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
              "What is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert state.text() == prompt + "Paris<|im_end|>\n"
    assert state.messages() == [{"role": "system", "content": "You are a helpful assistant."},
                                {"role": "user", "content": "What is the capital of France?"},
                                {"role": "assistant", "content": "Paris"}]
    (payload,) = be.gens()
    assert payload["text"] == prompt and payload["stream"] is False
    sp = payload["sampling_params"]
    assert (sp["max_new_tokens"], sp["temperature"], sp["top_p"], sp["stop"]) == (64, 0.1, 0.95, ["<|im_end|>"])
    assert state.get_meta_info("answer")["finish_reason"]["type"] == "stop" and "answer" in state


def test_default_system_prompt_context_managers_and_no_stops_outside_assistant():
    be = FakeBackend(template=SMOL, answer="42")

    @sgl.function
    def prog(s):
        with s.user():
            s += "Count: " + sgl.gen("n", stop="\n")
        s += sgl.assistant_begin() + "ok" + sgl.assistant_end()

    state = prog.run(backend=be)
    assert state.text() == ("<|im_start|>system\nYou are SmolLM.<|im_end|>\n<|im_start|>user\nCount: 42<|im_end|>\n"
                            "<|im_start|>assistant\nok<|im_end|>\n")
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant"]
    assert be.gens()[0]["sampling_params"]["stop"] == ["\n"]  # in the user turn: no <|im_end|> added


def test_default_template_when_server_describes_none_and_plain_concatenation():
    be = FakeBackend(template=None, answer=" blue")

    @sgl.function
    def prog(s, thing):
        s += "The " + thing + " is" + sgl.gen("color", max_tokens=3)
        s += sgl.user("hi")

    state = prog("sky", backend=be)
    assert state.text() == "The sky is blue" + "USER: hi\n" and state["color"] == " blue"


def test_dtype_regex_json_schema_and_sampling_defaults():
    be = FakeBackend(answer="7")

    @sgl.function
    def prog(s):
        s += sgl.gen_int("i") + sgl.gen("f", dtype="float", stop="x") + sgl.gen("b", dtype=bool)
        s += sgl.gen("j", json_schema={"type": "object"}, regex=None, return_logprob=True, top_logprobs_num=2)

    prog.run(backend=be, stop=["END"], max_new_tokens=5, frequency_penalty=0.5)
    i, f, b, j = (p["sampling_params"] for p in be.gens())
    assert i["regex"] == r"[-+]?[0-9]+[ \n]*" and i["stop"] == ["END", " ", "\n"] and i["max_new_tokens"] == 5
    assert f["regex"].startswith(r"[-+]?[0-9]*\.?") and f["stop"] == ["x", " ", "\n"]
    assert b["regex"] == "(True|False)" and b["stop"] == ["END"] and b["frequency_penalty"] == 0.5
    assert json.loads(j["json_schema"]) == {"type": "object"} and "regex" not in j
    assert be.gens()[3]["return_logprob"] is True and be.gens()[3]["top_logprobs_num"] == 2
    with pytest.raises(ValueError, match="dtype"):
        sgl.gen("x", dtype=list)

    @sgl.function
    def samples(s):
        s += "n: " + sgl.gen("x", n=2)

    state = samples.run(backend=be)  # n samples: the prompt n times in one list; the text goes on with the first
    assert state["x"] == ["7", "7"] and state.text() == "n: 7"
    assert [p["text"] for p in be.payloads if isinstance(p["text"], list)] == [["n: ", "n: "]]
    with pytest.raises(TypeError, match="unknown sampling parameter"):
        qa.run_batch([{"q": "x"}], backend=be, temprature=0.5)


def test_fork_prefills_once_then_runs_forks_concurrently_and_join_gathers():
    n = 3
    be = FakeBackend(answer=lambda p: f"tip{p['text'].count('#')}", barrier=threading.Barrier(n, timeout=10))

    @sgl.function
    def tips(s):
        s += "Shared intro. "
        forks = s.fork(n)
        forks += lambda i: "#" * (i + 1) + sgl.gen("tip", max_tokens=8)
        forks.join()
        s += "Done."

    state = tips.run(backend=be)
    assert state.error() is None, state.error()
    assert state["tip"] == ["tip1", "tip2", "tip3"] and state.text() == "Shared intro. Done."
    assert be.max_in_flight == n
    first_gen = be.payloads.index(be.gens()[0])
    assert [p["text"] for p in be.prefills()] == ["Shared intro. "]
    assert be.payloads.index(be.prefills()[0]) < first_gen  # the prefix was cached before any fork ran


def test_run_batch_prefills_common_prefix_once_keeps_order_and_honours_num_threads():
    be = FakeBackend(answer=lambda p: p["text"].split("user\n")[1].split("<")[0].upper(), delay=0.02)
    batch = [{"q": f"q{i}"} for i in range(6)]
    states = qa.run_batch(batch, backend=be, num_threads=2, temperature=0, progress_bar=True)
    assert [s["answer"] for s in states] == [f"Q{i}" for i in range(6)]
    assert be.max_in_flight == 2
    (prefill,) = be.prefills()
    assert prefill["text"] == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nq"
    assert be.payloads[0] is prefill and all(s.error() is None for s in states)

    auto = FakeBackend(barrier=threading.Barrier(4, timeout=10))
    states = qa.run_batch([("a",), ("b",), ("c",), ("d",)], backend=auto)  # tuples are positional arguments
    assert all(s.error() is None for s in states) and auto.max_in_flight == 4


@pytest.mark.parametrize("method", [sgl.token_length_normalized, sgl.greedy_token_selection])
@pytest.mark.parametrize("heal", [False, True])
def test_select_scores_choices_with_one_prefill_and_one_batched_call(method, heal):
    be = FakeBackend(favour="Paris", heal=heal)

    @sgl.function
    def pick(s):
        s += "Capital of France: " + sgl.select("city", choices=["London", "Paris", "Rome"], choices_method=method)

    state = pick.run(backend=be)
    assert state["city"] == "Paris" and state.text() == "Capital of France: Paris"
    prefill, scoring = be.payloads
    assert prefill["sampling_params"]["max_new_tokens"] == 0 and prefill["text"] == "Capital of France: "
    assert scoring["text"] == ["Capital of France: " + c for c in ("London", "Paris", "Rome")]
    assert scoring["logprob_start_len"] == len("Capital of France: ") - 1 and scoring["return_text_in_logprobs"]
    meta = state.get_meta_info("city")
    scores = meta["normalized_prompt_logprobs"]
    assert scores[1] == pytest.approx(-0.1) and scores[0] == pytest.approx(-2.0)  # the -9 tail was dropped
    kept = meta["input_token_logprobs"][1]  # a healed first token holds prompt text too, and is kept
    assert [t[2] for t in kept] == ([" P"] if heal else ["P"]) + ["a", "r", "i", "s"]


def test_choice_methods_differ_where_they_should():
    logprobs = [[-0.1, -3.0], [-0.5, -0.5]]
    assert sgl.token_length_normalized(logprobs) == 1  # best mean
    assert sgl.greedy_token_selection(logprobs) == 0  # best first token
    assert sgl.greedy_token_selection([[-0.2], [-0.2, -0.1]]) == 1  # the short one competes with its mean


def test_stream_text_iter_pieces_concatenate_to_final_text():
    be = FakeBackend(answer="The capital is Paris.")
    state = qa.run(q="?", backend=be, stream=True)
    pieces = list(state.text_iter("answer"))
    assert "".join(pieces) == "The capital is Paris." and len(pieces) > 1
    assert "".join(state.text_iter()) == state.text() and state.text().endswith("Paris.<|im_end|>\n")
    assert be.payloads[-1]["stream"] is True
    assert list(qa.run(q="?", backend=be).text_iter()) == [qa.run(q="?", backend=be).text()]


def test_backend_error_surfaces_instead_of_hanging():
    def refuse(payload: dict[str, Any]) -> str:
        raise BackendError("regex '(' is invalid", status=400, param="regex")

    for stream in (False, True):
        state = qa.run(q="?", backend=FakeBackend(answer=refuse), stream=stream)
        assert isinstance(state.error(), BackendError) and state.error().param == "regex"
        with pytest.raises(BackendError, match="regex"):
            state["answer"]
        with pytest.raises(BackendError):
            state.text()


def test_program_exception_is_kept_and_reraised_and_no_threads_leak():
    @sgl.function
    def broken(s):
        s += "x" + sgl.gen("a")
        s["a"]  # wait for it, so the failure below cannot drop it from the queue
        raise ZeroDivisionError("boom")

    before = threading.active_count()
    state = broken.run(backend=FakeBackend())
    assert isinstance(state.error(), ZeroDivisionError)
    with pytest.raises(ZeroDivisionError):
        state.text()
    assert state["a"] == "Paris"  # set before the failure
    with pytest.raises(KeyError, match="no variable 'nope'"):
        qa.run(q="?", backend=FakeBackend())["nope"]
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() <= before


def test_bind_default_backend_flush_and_server_info():
    be = FakeBackend()
    sgl.set_default_backend(be)
    try:
        assert qa.bind(q="bound").run()["answer"] == "Paris"
        assert "bound" in be.gens()[0]["text"]
        assert sgl.flush_cache() is True and be.payloads[-1] == {"flush": True}
        assert sgl.get_server_info() == {"fake": True}
    finally:
        sgl.set_default_backend(None)
    assert sgl.flush_cache() is False and sgl.get_server_info() is None
    with pytest.raises(ValueError, match="no backend"):
        qa.run(q="x")
    with pytest.raises(TypeError, match="no argument"):
        qa.bind(nope=1)


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:  # keep pytest output clean
        pass

    def _json(self, status: int, body: Any) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        self.server.auth.append(self.headers.get("Authorization"))
        if self.path == "/get_model_info":
            self._json(200, {"model_path": "m", "is_generation": True, "chat_template": CHATML.to_dict()})
        else:
            self._json(200, {"max_total_tokens": 1})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/flush_cache":
            return self._json(200, {"message": "ok"})
        if body["sampling_params"].get("regex") == "(":
            return self._json(400, {"error": {"message": "invalid regex '('", "type": "invalid_request_error",
                                              "param": "regex", "code": "invalid_regex"}})
        if not body.get("stream"):
            return self._json(200, {"text": "Paris", "output_ids": [1], "meta_info": {"prompt_tokens": 3}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for text in ("Pa", "Par", "Paris"):
            self.wfile.write(f"data: {json.dumps({'text': text, 'meta_info': {}, 'index': 0})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture()
def http_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.auth = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_runtime_endpoint_over_http(http_server):
    be = RuntimeEndpoint(f"http://127.0.0.1:{http_server.server_address[1]}", api_key="k")
    assert be.chat_template == CHATML and be.model_info()["model_path"] == "m"
    assert qa.run(q="?", backend=be)["answer"] == "Paris"
    assert "".join(qa.run(q="?", backend=be, stream=True).text_iter("answer")) == "Paris"
    states = qa.run_batch([{"q": str(i)} for i in range(16)], backend=be, num_threads=16)
    assert [s["answer"] for s in states] == ["Paris"] * 16
    be.flush_cache()
    assert be.server_info() == {"max_total_tokens": 1} and set(http_server.auth) == {"Bearer k"}
    with pytest.raises(BackendError) as err:
        be.generate({"text": "x", "sampling_params": {"regex": "("}})
    assert err.value.status == 400 and err.value.param == "regex" and "invalid regex" in err.value.message
    named = RuntimeEndpoint(f"http://127.0.0.1:{http_server.server_address[1]}", chat_template_name="default")
    assert named.chat_template == ChatTemplate.by_name("default")
    with pytest.raises(BackendError, match="cannot reach"):
        RuntimeEndpoint("http://127.0.0.1:9")


def test_engine_backend_wraps_engine_methods_and_errors():
    class FakeEngine:
        def model_info(self):
            return {"model_path": "e", "is_generation": True, "chat_template": None}

        def sglang_generate(self, payload):
            if payload["sampling_params"]["temperature"] == 0.5:
                raise ValueError("temperature 0.5 is refused")
            return {"text": "ok", "output_ids": [], "meta_info": {}}

        def sglang_generate_stream(self, payload):
            yield {"text": "o", "meta_info": {}}
            yield {"text": "ok", "meta_info": {}}

        def flush_cache(self):
            return None

        def cache_stats(self):
            return {"hits": 1}

    be = sgl.EngineBackend(FakeEngine())
    assert be.chat_template == ChatTemplate.by_name("default") and be.server_info()["cache_stats"] == {"hits": 1}
    assert qa.run(q="?", backend=FakeEngine())["answer"] == "ok"  # an Engine is wrapped automatically
    assert "".join(qa.run(q="?", backend=be, stream=True).text_iter("answer")) == "ok"
    state = qa.run(q="?", backend=be, temperature=0.5)
    assert isinstance(state.error(), BackendError) and state.error().status == 400


def test_import_is_stdlib_only():
    code = ("import sys, radixserve.lang; heavy = {'torch', 'transformers', 'numpy', 'aiohttp', 'tqdm', 'msgspec'}; "
            "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
