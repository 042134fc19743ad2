"""The api actor alone (no other actors): what clients see when an actor dies."""
from __future__ import annotations

import asyncio
import tempfile

from aiohttp.test_utils import TestClient, TestServer

from radixserve.actors.api.app import make_app
from radixserve.actors.api.server import ApiServer
from radixserve.actors.transport import Endpoints

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_actor_death_answers_waiting_requests_503_and_health_503():
    async def main():
        server = ApiServer(Endpoints(tempfile.mkdtemp()), {"model": "m", "started": 0, "context_length": 8})
        server.start()
        async with TestClient(TestServer(make_app(server))) as client:
            assert (await client.get("/health")).status == 200
            waiting = asyncio.create_task(client.post("/v1/chat/completions", json=BODY))
            await asyncio.sleep(0.3)  # it is waiting for a tokenizer that will never answer
            assert not waiting.done() and len(server.pending) == 1
            server.fail_all("the runner actor exited with code -9")
            resp = await waiting
            assert resp.status == 503
            assert (await resp.json())["error"]["type"] == "service_unavailable"
            health = await client.get("/health")
            assert health.status == 503
            again = await client.post("/v1/chat/completions", json=BODY)
            assert again.status == 503
        await server.close()

    asyncio.run(main())


def test_openai_finish_reasons_are_openais_own():
    from radixserve.actors.api.openai import finish_reason
    from radixserve.wire.messages import FinishReason

    assert finish_reason(None) is None
    assert finish_reason(FinishReason("length")) == "length"
    assert finish_reason(FinishReason("stop", matched=2)) == "stop"
    assert finish_reason(FinishReason("abort", message="aborted by /abort_request")) == "stop"
