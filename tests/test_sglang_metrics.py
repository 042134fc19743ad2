"""SGLang's dashboards and log habits work on radixserve: the ``sglang:`` metric families (labelled ``model_name``)
that SGLang's Grafana dashboard queries, scraped from a live server and read the way Prometheus would, and the
"Prefill batch." / "Decode batch." log lines (actors/api/sglang_metrics.py, actors/scheduler/batch_log.py)."""
from __future__ import annotations

import re
import types

import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from conftest import post_json
from radixserve.actors.api.sglang_metrics import THROUGHPUT_WINDOW_S, SGLangFamilies
from radixserve.actors.scheduler.batch_log import BatchLog
from radixserve.server_process import ServerProcess

# every family SGLang's examples/monitoring dashboard reads (its panels and its model_name variable)
DASHBOARD = ("sglang:e2e_request_latency_seconds", "sglang:time_to_first_token_seconds", "sglang:num_running_reqs",
             "sglang:gen_throughput", "sglang:cache_hit_rate", "sglang:num_queue_reqs")


@pytest.fixture(scope="module")
def server(tiny_models):
    proc = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32", "--max-total-tokens",
                         "2048", "--served-model-name", "team/tiny-llama")
    yield proc
    proc.stop()


def scrape(url: str) -> dict[str, list]:
    """family name -> its samples, parsed as Prometheus parses the exposition."""
    text = httpx.get(url + "/metrics").text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(samples: list, name: str, **labels: str) -> float:
    return next(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_an_sglang_dashboard_reads_radixserve(server):
    prompt = "The shared system prompt of every request here. " * 4
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 50, "temperature": 0, "ignore_eos": True}}
    usages = [post_json(server.url + "/generate", body)["meta_info"] for _ in range(3)]
    families = scrape(server.url)
    model = {"model_name": "team/tiny-llama"}
    for name in DASHBOARD:
        assert name in families and all(s.labels.get("model_name") == "team/tiny-llama" for s in families[name])
    e2e = families["sglang:e2e_request_latency_seconds"]
    buckets = [(float(s.labels["le"]), s.value) for s in e2e if s.name.endswith("_bucket")]
    assert [v for _, v in sorted(buckets)] == sorted(v for _, v in buckets)  # cumulative, as histogram_quantile needs
    assert value(e2e, "sglang:e2e_request_latency_seconds_count", **model) == 3
    assert value(families["sglang:time_to_first_token_seconds"],
                 "sglang:time_to_first_token_seconds_count", **model) == 3
    assert value(families["sglang:time_per_output_token_seconds"],
                 "sglang:time_per_output_token_seconds_count", **model) == 3
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["cached_tokens"] for u in usages)
    assert value(families["sglang:prompt_tokens"], "sglang:prompt_tokens_total", **model) == prompt_tokens
    assert value(families["sglang:generation_tokens"], "sglang:generation_tokens_total", **model) == 150
    assert value(families["sglang:cached_tokens"], "sglang:cached_tokens_total", **model) == cached > 0
    assert value(families["sglang:cache_hit_rate"], "sglang:cache_hit_rate", **model) == pytest.approx(
        cached / prompt_tokens)
    assert value(families["sglang:gen_throughput"], "sglang:gen_throughput", **model) > 0
    assert value(families["sglang:num_running_reqs"], "sglang:num_running_reqs", **model) == 0
    assert 0 <= value(families["sglang:token_usage"], "sglang:token_usage", **model) <= 1
    assert "radixserve_requests" in families  # radixserve's own families stay


def test_sglang_style_batch_lines_are_logged(server):
    body = {"text": "Count with me:", "sampling_params": {"max_new_tokens": 45, "temperature": 0,
                                                           "ignore_eos": True}}
    post_json(server.url + "/generate", body)
    log = server.output()
    assert re.search(r"Prefill batch\. #new-seq: 1, #new-token: \d+, #cached-token: \d+, token usage: \d\.\d\d, "
                     r"#running-req: \d+, #queue-req: 0", log)
    assert re.search(r"Decode batch\. #running-req: 1, #token: \d+, token usage: \d\.\d\d, "
                     r"gen throughput \(token/s\): \d+\.\d\d, #queue-req: 0", log)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fake_scheduler(capacity=1000, free=600, evictable=100, running=3, waiting=2):
    cache = types.SimpleNamespace(capacity=capacity, evictable=evictable,
                                  allocator=types.SimpleNamespace(num_free=free))
    return types.SimpleNamespace(cache=cache, running=[None] * running, waiting=[None] * waiting, chunked=None)


def plan(mode: str, extend: list[int], prefix: list[int]):
    return types.SimpleNamespace(mode=mode, extend_lens=np.array(extend), prefix_lens=np.array(prefix), drafts=None)


def test_batch_lines_count_the_batch_and_time_the_decode_steps():
    clock = Clock()
    lines = BatchLog(every=4, clock=clock)
    sched = fake_scheduler()
    assert lines.planned(plan("extend", [30, 10], [64, 0]), sched) == (
        "Prefill batch. #new-seq: 2, #new-token: 40, #cached-token: 64, token usage: 0.30, #running-req: 3, "
        "#queue-req: 2")
    out = []
    for _ in range(4):  # 3 requests a step, 0.1 s apart: 3 steps' tokens between the first plan and the fourth
        out.append(lines.planned(plan("decode", [1, 1, 1], [70, 20, 5]), sched))
        clock.now += 0.1
    assert out[:3] == [None, None, None]
    assert out[3] == ("Decode batch. #running-req: 3, #token: 300, token usage: 0.30, gen throughput (token/s): "
                      "30.00, #queue-req: 2")


def test_generation_throughput_is_over_the_last_window_and_tpot_over_decode_time():
    clock = Clock()
    fams = SGLangFamilies(CollectorRegistry(), "m", clock=clock)
    fams.tokens(50)
    clock.now += 1
    fams.tokens(30)
    assert fams._throughput() == pytest.approx(80 / THROUGHPUT_WINDOW_S)
    clock.now += THROUGHPUT_WINDOW_S + 0.5  # both older than the window now
    assert fams._throughput() == 0.0
    fams.finished(prompt=10, cached=4, e2e=2.0, ttft=0.5, output_tokens=4, hit_rate=0.4)
    assert fams.tpot._sum.get() == pytest.approx(0.5)  # (2.0 - 0.5) / 3 tokens after the first
    fams.finished(prompt=10, cached=0, e2e=1.0, ttft=None, output_tokens=0, hit_rate=0.2)  # no token: no TPOT
    assert fams.tpot._sum.get() == pytest.approx(0.5) and fams.requests._value.get() == 2


def test_speculative_steps_are_decode_lines_counting_the_tokens_they_kept():
    """A step that verified drafts is an extend plan, but a decode step to the log: its throughput counts the tokens
    each such step kept (the scheduler's spec.kept once it is processed), not one a request."""
    clock = Clock()
    lines = BatchLog(every=3, clock=clock)
    sched = fake_scheduler()
    sched.spec = types.SimpleNamespace(kept=7)
    out = []
    for _ in range(3):
        step = types.SimpleNamespace(mode="extend", extend_lens=np.array([5, 1]), prefix_lens=np.array([70, 20]),
                                     drafts=np.array([4, 0]))
        out.append(lines.planned(step, sched))
        clock.now += 0.1
    assert out[:2] == [None, None] and "gen throughput (token/s): 70.00" in out[2], out
