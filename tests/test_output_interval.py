"""Tokens held back in the scheduler (``AddReq.output_interval``): a whole result's tokens reach the tokenizer in
runs, a stream's every --stream-interval tokens; the first at once, the rest with the end. The runs add up to the
output exactly (under retraction too), the text is the same as token by token, and a request whose text can end
it (stop strings, stop_regex) still goes token by token."""
from __future__ import annotations

import json
import random

import httpx
import numpy as np
import pytest

from radixserve.actors.scheduler import FinishReason
from radixserve.actors.scheduler.actor import take_tokens
from radixserve.actors.tokenizer import WHOLE_RESULT_INTERVAL, TokenizerCore, output_interval
from radixserve.sampling_params import SamplingParams
from radixserve.server_process import ServerProcess
from radixserve.wire.messages import TokenBatch
from radixserve.wire.plans import Logprob
from test_scheduler import make, reference


@pytest.mark.parametrize("capacity", [120, 2000])  # 120: far too small for the batch, requests are retracted
def test_the_runs_add_up_to_the_output_first_token_at_once_then_every_interval(capacity):
    rng = random.Random(capacity)
    sched, runner = make(capacity=capacity, chunk=16)
    intervals = [1, 3, 4, 50]
    reqs = [sched.add_request(f"r{i}", [rng.randrange(1, 50) for _ in range(rng.randrange(8, 40))],
                              SamplingParams(max_new_tokens=rng.randrange(5, 30), temperature=0),
                              output_interval=intervals[i % 4]) for i in range(12)]
    runs: dict[str, list[list[int]]] = {r.rid: [] for r in reqs}
    while sched.has_work:
        batch = take_tokens(sched.process(runner.forward(sched.schedule())))
        if batch is None:
            continue
        assert batch.counts is None or len(batch.counts) == len(batch.rids)
        for rid, run in zip(batch.rids, batch.runs()):
            runs[rid].append(run)
    sched.check()
    assert capacity > 120 or sched.stats.retractions > 0
    for req in reqs:
        got = runs[req.rid]
        assert [t for run in got for t in run] == req.output_ids == reference(req.prompt_ids, req.max_new_tokens)
        assert req.finish_reason == FinishReason("length") and req.sent == len(req.output_ids)
        n, k = len(req.output_ids), req.output_interval
        # the first token alone, then runs of the interval, the rest with the end
        want = [1] + [k] * ((n - 1) // k) + ([(n - 1) % k] if (n - 1) % k else [])
        assert [len(run) for run in got] == want, (req.rid, k)


def test_a_whole_result_is_held_a_stream_is_not_and_stop_strings_go_token_by_token():
    assert output_interval(SamplingParams(), stream=False) == WHOLE_RESULT_INTERVAL
    assert output_interval(SamplingParams(), stream=True) == 1
    assert output_interval(SamplingParams(), stream=True, stream_interval=4) == 4
    for params in (SamplingParams(stop="\n"), SamplingParams(stop_regex=r"\d")):
        assert output_interval(params, stream=False) == output_interval(params, True, 4) == 1


@pytest.fixture(scope="module")
def core(smollm2_path):
    return TokenizerCore(smollm2_path)


def detokenized(core, ids: list[int], sizes: list[int], params: SamplingParams, finish: FinishReason | None = None,
                logprobs: bool = False):
    """The deltas of ``ids`` sent in runs of ``sizes`` (the last with ``finish``)."""
    live = {"r": core.output(params)}
    deltas, at = [], 0
    for n, size in enumerate(sizes):
        run = ids[at : at + size]
        at += size
        last = n == len(sizes) - 1
        lps = {0: [Logprob(-0.5 - t / 1e4, [], []) for t in run]} if logprobs else {}
        batch = TokenBatch(["r"], np.array(run), np.array([3]), np.array([0]),
                           {0: finish} if last and finish is not None else {}, lps, counts=np.array([len(run)]))
        out = core.detokenize(batch, live)
        assert not out.failed
        deltas += out.deltas
        if out.stops:
            break
    return deltas


def test_a_run_gives_the_text_token_by_token_gives(core):
    """Multi-byte characters split across runs, a hidden EOS ending the last run, logprobs one per token."""
    text = "Héllo wörld! 日本語のテキスト 🚀🎉 and code: def f(x):\n    return x**2"
    ids = core.encode(text) + [core.tokenizer.eos_token_id]
    end = FinishReason("stop", matched=ids[-1])
    one = detokenized(core, ids, [1] * len(ids), SamplingParams(), end, logprobs=True)
    for sizes in ([len(ids)], [1, 5, 5, 5, len(ids) - 16], [1, 2, 3, len(ids) - 6]):
        runs = detokenized(core, ids, sizes, SamplingParams(), end, logprobs=True)
        assert "".join(d.text for d in runs) == "".join(d.text for d in one)
        assert [t for d in runs for t in d.token_ids] == ids
        assert [lp.logprob for d in runs for lp in d.logprobs] == [lp.logprob for d in one for lp in d.logprobs]
        assert runs[-1].completion_tokens == len(ids) and runs[-1].finish == end
    assert "".join(d.text for d in one).endswith("x**2")  # the EOS is not in the text


def test_a_stop_string_inside_a_run_ends_it_at_its_token(core):
    """A verified draft's run can hold a stop string: the tokens after it are not taken, nor counted."""
    ids = core.encode("one two three four five six")
    params = SamplingParams(stop=" three")
    one = detokenized(core, ids, [1] * len(ids), params)
    run = detokenized(core, ids, [1, len(ids) - 1], params)
    assert "".join(d.text for d in run) == "".join(d.text for d in one) == "one two"
    assert run[-1].finish == one[-1].finish == FinishReason("stop", matched=" three")
    assert run[-1].completion_tokens == one[-1].completion_tokens < len(ids)
    assert [t for d in run for t in d.token_ids] == [t for d in one for t in d.token_ids]


def sglang_stream(url: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=120) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def itl_count(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("radixserve_inter_token_latency_seconds_count")))


def test_stream_interval_on_a_server(tiny_models, tiny_server):
    """--stream-interval 4: a stream's tokens come 1, 4, 4, ..., the rest with the end, the same text as a whole
    result and as a server streaming each token; a request with a stop string still streams token by token."""
    server = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32", "--max-total-tokens",
                           "1200", "--stream-interval", "4", "--check-invariants")
    try:
        body = {"text": "The capital of France", "sampling_params": {"max_new_tokens": 10, "temperature": 0,
                                                                      "ignore_eos": True}}
        events = sglang_stream(server.url, body)
        assert [e["meta_info"]["completion_tokens"] for e in events] == [1, 5, 9, 10]
        whole = httpx.post(server.url + "/generate", json=body, timeout=120).json()
        each = sglang_stream(tiny_server.url, body)
        assert [e["meta_info"]["completion_tokens"] for e in each] == list(range(1, 11))
        assert events[-1]["text"] == whole["text"] == each[-1]["text"]
        assert whole["meta_info"]["completion_tokens"] == 10
        # a 120-token whole result (runs of 50) against the same tokens streamed one by one; /metrics counts an
        # inter-token gap for each token after the first, whatever runs they came in
        long = {**body, "sampling_params": {**body["sampling_params"], "max_new_tokens": 120}}
        gaps = itl_count(server.url)
        assert httpx.post(server.url + "/generate", json=long, timeout=120).json()["text"] == \
            sglang_stream(tiny_server.url, long)[-1]["text"]
        assert itl_count(server.url) - gaps == 119
        stop = sglang_stream(server.url, {**body, "sampling_params": {**body["sampling_params"], "stop": ["never"]}})
        assert [e["meta_info"]["completion_tokens"] for e in stop] == list(range(1, 11))
    finally:
        server.stop()


def test_stream_interval_below_one_is_refused():
    from radixserve.server_args import ServerArgs

    with pytest.raises(ValueError, match="stream_interval=0 must be >= 1"):
        ServerArgs(model_path="m", stream_interval=0)
