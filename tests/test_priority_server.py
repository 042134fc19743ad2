"""SGLang's priority scenarios (its test/srt/test_priority_scheduling.py) against a live server started with its
flags: one running place, three queued. A more important arrival preempts; a full queue drops its least important
request. Tiny fp32 Llama: a preempted request's greedy tokens equal those it makes alone."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from conftest import ServerProcess, get_body

PROMPT = [[(7 * i + 3 * k) % 900 + 100 for i in range(24)] for k in range(12)]  # one prompt per request


@pytest.fixture(scope="module")
def server(tiny_models):
    server = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32", "--max-total-tokens",
                           "2000", "--max-running-requests", "1", "--max-queued-requests", "3",
                           "--enable-priority-scheduling", "--check-invariants")
    yield server
    server.stop()


def body(k: int, priority: int, tokens: int, stream: bool = False) -> dict:
    return {"input_ids": PROMPT[k], "priority": priority, "stream": stream,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}


class Call(threading.Thread):
    """One /generate in a thread: its status, its answer, when it ended; ``started`` is set at the first event
    of a streamed answer (the request is running)."""

    def __init__(self, url: str, payload: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.payload = url, payload
        self.started = threading.Event()
        self.status: int | None = None
        self.answer: dict = {}
        self.ended = 0.0
        self.start()

    def run(self) -> None:
        with httpx.Client(timeout=120) as client, client.stream("POST", self.url + "/generate",
                                                                json=self.payload) as resp:
            self.status = resp.status_code
            if resp.status_code != 200:
                self.answer = json.loads(resp.read())
            for line in resp.iter_lines() if resp.status_code == 200 else ():
                self.started.set()
                if line.startswith("data: ") and line != "data: [DONE]":
                    self.answer = json.loads(line[6:])
                elif line.startswith("{"):
                    self.answer = json.loads(line)
        self.ended = time.monotonic()
        self.started.set()


def running(url: str, payload: dict) -> Call:
    call = Call(url, {**payload, "stream": True})
    assert call.started.wait(60) and call.status == 200, call.answer
    return call


def wait_waiting(url: str, n: int) -> None:
    """Until the scheduler's queue holds ``n`` requests (it answers between steps)."""
    deadline = time.monotonic() + 30
    while get_body(url + "/dashboard/state")["queues"]["waiting_count"] != n:
        assert time.monotonic() < deadline, "the requests never reached the queue"
        time.sleep(0.02)


def finish_order(calls: dict[int, Call]) -> list[int]:
    for call in calls.values():
        call.join(120)
    return sorted(calls, key=lambda p: calls[p].ended)


def test_a_more_important_arrival_preempts_and_the_order_is_20_10_0(server):
    """SGLang's test_priority_scheduling_preemption_meeting_threshold_validation: 0 runs, then 10 and 20 arrive;
    20 outranks 0 by more than the threshold (10) and takes its place, 10 does not; 0 finishes last."""
    calls = {0: running(server.url, body(0, 0, 300))}
    calls.update({p: Call(server.url, body(k, p, 40)) for k, p in ((1, 10), (2, 20))})
    assert finish_order(calls) == [20, 10, 0]
    assert {c.status for c in calls.values()} == {200}
    preempted = calls[0].answer["output_ids"]
    alone = httpx.post(server.url + "/generate", json=body(0, 0, 300), timeout=120).json()
    assert len(preempted) == 300 and preempted == alone["output_ids"], "preempted, it resumes with the same tokens"


def test_a_full_queue_drops_the_least_important_and_refuses_the_less_important(server):
    """SGLang's test_priority_scheduling_existing_requests_abortion_validation, then its incoming-request
    rejection: the queue holds 2, 3, 4; 5, 6 and 7 drop them (503, a message saying why); 0 is refused (429)."""
    calls = {1: running(server.url, body(0, 1, 200))}
    calls.update({p: Call(server.url, body(p, p, 4)) for p in (2, 3, 4)})
    wait_waiting(server.url, 3)
    calls.update({p: Call(server.url, body(p, p, 4)) for p in (5, 6, 7)})
    for p in (2, 3, 4):
        calls[p].join(60)
        assert calls[p].status == 503, calls[p].answer
        message = calls[p].answer["error"]["message"]
        assert f"priority {p}" in message and "--max-queued-requests 3" in message and "dropped" in message
    wait_waiting(server.url, 3)
    late = httpx.post(server.url + "/generate", json=body(8, 0, 4), timeout=60)
    assert late.status_code == 429 and "queue is full" in late.json()["error"]["message"]
    kept = {p: calls[p] for p in (1, 5, 6, 7)}
    assert finish_order(kept) == [1, 7, 6, 5] and {c.status for c in kept.values()} == {200}
