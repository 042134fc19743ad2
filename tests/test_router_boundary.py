"""``radixserve router``'s front door, over a fake worker that records what it is sent: the router's own key (only
/health open), the Host check, deeply nested JSON answered 400 by the router itself, and workers sent only the
headers they need -- the router's worker key, never the client's Authorization or Cookie."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from radixserve.actors.api.boundary import Boundary
from radixserve.actors.router.server import Router

CLIENT = {"Authorization": "Bearer router-key", "Cookie": "session=secret", "X-Request-Id": "req-7",
          "User-Agent": "curl/8", "Accept": "application/json"}


def fake_worker(seen: list[dict]) -> web.Application:
    """Answers like a worker, and keeps every request's path and headers (names in lower case) in ``seen``."""
    async def answer(request: web.Request) -> web.Response:
        seen.append({"path": request.path, **{k.lower(): v for k, v in request.headers.items()}})
        return web.json_response({"text": "ok"})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/health", health)
    for path in ("/generate", "/flush_cache"):
        app.router.add_post(path, answer)
    return app


def run(test, boundary: Boundary, worker_api_key: str | None) -> None:
    async def main():
        seen: list[dict] = []
        worker = TestServer(fake_worker(seen))
        await worker.start_server()
        router = TestServer(Router([str(worker.make_url("/"))], "round-robin", worker_api_key=worker_api_key)
                            .app(boundary))
        await router.start_server()
        try:
            async with aiohttp.ClientSession() as session:
                await test(session, str(router.make_url("/")), seen)
        finally:
            await router.close()
            await worker.close()

    asyncio.run(main())


def test_workers_get_the_worker_key_and_never_the_clients_credentials():
    async def test(s, url, seen):
        async with s.post(url + "generate", json={"text": "hi"}, headers=CLIENT) as resp:
            assert resp.status == 200 and await resp.json() == {"text": "ok"}
        async with s.post(url + "flush_cache", json={}, headers=CLIENT) as resp:
            assert resp.status == 200
        assert [r["path"] for r in seen] == ["/generate", "/flush_cache"]
        for got in seen:
            assert got["authorization"] == "Bearer worker-key"
            assert "cookie" not in got and "curl" not in got.get("user-agent", "")
            assert got["content-type"] == "application/json" and got["x-request-id"] == "req-7"
            assert got["accept"] == "application/json"

    run(test, Boundary(api_key="router-key"), worker_api_key="worker-key")


def test_without_a_worker_key_workers_get_no_authorization_at_all():
    async def test(s, url, seen):
        async with s.post(url + "generate", json={"text": "hi"}, headers=CLIENT) as resp:
            assert resp.status == 200
        assert "authorization" not in seen[0] and "cookie" not in seen[0]

    run(test, Boundary(), worker_api_key=None)


def test_the_routers_key_guards_everything_but_health():
    async def test(s, url, seen):
        for method, path in (("POST", "generate"), ("GET", "workers"), ("GET", "get_server_info"),
                             ("POST", "flush_cache")):
            async with s.request(method, url + path, json={"text": "hi"}) as resp:
                assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key", path
            async with s.request(method, url + path, json={"text": "hi"},
                                 headers={"Authorization": "Bearer wrong"}) as resp:
                assert resp.status == 401, path
        assert seen == [], "nothing reached a worker"
        async with s.get(url + "health") as resp:
            assert resp.status == 200
        async with s.get(url + "workers", headers={"Authorization": "Bearer router-key"}) as resp:
            assert resp.status == 200 and (await resp.json())["workers"][0]["healthy"]

    run(test, Boundary(api_key="router-key"), worker_api_key=None)


def test_rebound_hosts_and_deep_json_are_refused_by_the_router_itself():
    async def test(s, url, seen):
        async with s.post(url + "generate", json={"text": "hi"}, headers={"Host": "evil.example"}) as resp:
            assert resp.status == 421 and (await resp.json())["error"]["code"] == "host_not_allowed"
        deep = b'{"text": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
        for path in ("generate", "v1/chat/completions", "v1/completions"):
            async with s.post(url + path, data=deep, headers={"Content-Type": "application/json"}) as resp:
                body = await resp.json()
                assert resp.status == 400 and "nested too deeply" in body["error"]["message"], path
        assert seen == []
        async with s.get(url + "health", headers={"Host": "localhost"}) as resp:
            assert resp.status == 200

    run(test, Boundary(), worker_api_key=None)


def test_the_router_cli_refuses_a_key_given_twice():
    proc = subprocess.run([sys.executable, "-m", "radixserve", "router", "--worker-urls", "http://127.0.0.1:9",
                           "--worker-api-key", "a"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "RADIXSERVE_WORKER_API_KEY": "b"})
    assert proc.returncode == 2
    assert "given 2 ways ($RADIXSERVE_WORKER_API_KEY, --worker-api-key)" in proc.stdout + proc.stderr
