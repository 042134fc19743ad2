"""Nothing one request carries ends an actor: each actor's core, driven without processes through a channel that
records what it sends, turns a failure on one request into a RequestError for that request and goes on."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from radixserve.sampling_params import SamplingParams
from radixserve.wire.codec import array
from radixserve.wire.messages import AddReq, FinishReq, GenerateReq, RequestError, TextBatch, TokenBatch
from radixserve.wire.plans import ForwardResult


class Recorder:
    """Stands in for an actor's Channel: keeps every (peer, message) sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    async def send(self, peer: str, msg) -> None:
        self.sent.append((peer, msg))

    def of(self, kind: type) -> list:
        return [m for _, m in self.sent if isinstance(m, kind)]

    def wait_for(self, ranks: int, timeout_s: float) -> None:  # as the scheduler's Publisher of plans
        pass


@pytest.fixture(scope="module")
def tokenizer_core(smollm2_path):
    from radixserve.actors.tokenizer import TokenizerCore

    return TokenizerCore(smollm2_path)


def test_a_request_that_breaks_detokenizing_fails_alone(tokenizer_core, monkeypatch):
    from radixserve.actors.tokenizer import OutputText
    from radixserve.actors.tokenizer_actor import TokenizerActor

    channel = Recorder()
    actor = TokenizerActor(tokenizer_core, channel)

    async def main():
        for rid in ("good", "bad"):
            await actor.handle(GenerateReq(rid, SamplingParams(), text="hello"))
        real = OutputText.add

        def add(self, token_id, finish):
            if self is actor.live["bad"]:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a tokenizer bug")
            return real(self, token_id, finish)

        monkeypatch.setattr(OutputText, "add", add)
        await actor.handle(TokenBatch(["good", "bad"], array([100, 101]), array([3, 3]), array([0, 0]), {}))

    asyncio.run(main())
    errors = channel.of(RequestError)
    assert [(e.rid, e.status) for e in errors] == [("bad", 500)]
    assert [f.rid for f in channel.of(FinishReq)] == ["bad"], "the scheduler is told to free its KV"
    deltas = [d for batch in channel.of(TextBatch) for d in batch.deltas]
    assert [d.rid for d in deltas] == ["good"] and "bad" not in actor.live and "good" in actor.live


def test_a_request_the_scheduler_cannot_queue_fails_alone_and_the_actor_goes_on(monkeypatch):
    from radixserve.actors.scheduler import Scheduler, SchedulerConfig
    from radixserve.actors.scheduler.actor import SchedulerActor
    from radixserve.cache import CacheManager
    from radixserve.policies.eviction import LRU
    from radixserve.policies.schedule import FCFS

    cfg = SchedulerConfig(context_length=512, vocab_size=50, eos_ids=frozenset({0}))
    sched = Scheduler(cfg, CacheManager(256, LRU()), FCFS())
    channel = Recorder()
    actor = SchedulerActor(sched, channel, plans=channel, ranks=1, timeout_s=1.0)
    real = sched.add_request

    def add_request(rid, *a, **kw):
        if rid == "bug":
            raise KeyError("a bug around this request")
        return real(rid, *a, **kw)

    monkeypatch.setattr(sched, "add_request", add_request)

    async def main():
        ids = array(np.arange(1, 6))
        await actor.guarded(AddReq("bug", ids, SamplingParams(max_new_tokens=2)))
        await actor.guarded(AddReq("bad-value", array([1, 99]), SamplingParams(max_new_tokens=2)))
        await actor.guarded(AddReq("ok", ids, SamplingParams(max_new_tokens=2)))

    asyncio.run(main())
    errors = {e.rid: e for e in channel.of(RequestError)}
    assert errors["bug"].status == 500 and errors["bad-value"].status == 400
    assert errors["bad-value"].param == "prompt" and "outside the vocabulary" in errors["bad-value"].message
    assert "ok" in sched.live and sched.has_work


def test_a_step_that_raises_in_the_runner_comes_back_as_an_error(tiny_models):
    from radixserve import Engine

    engine = Engine(str(tiny_models["llama"]), dtype="float32", max_total_tokens=300)
    sched, runner = engine.scheduler, engine.runner
    sched.add_request("r", [5, 6, 7], SamplingParams(max_new_tokens=3, temperature=0))
    plan = sched.schedule()

    def broken(batch):
        raise RuntimeError("out of memory")

    runner._run = broken  # whichever kernel serves the step (auto: the native one where the CPU has it)
    result = runner.forward(plan)
    assert isinstance(result, ForwardResult) and "out of memory" in result.error
    sched.process(result)
    assert [f.rid for f in sched.take_failures()] == ["r"] and sched.cache.owned_by_requests == 0
    engine.shutdown()
