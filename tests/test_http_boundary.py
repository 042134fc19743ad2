"""The api server's front door (actors/api/boundary.py, hosts.py, api_key.py): the Host check against DNS rebinding,
the API key from a file or the environment, the warnings of an exposed server, the caps on connections and streams
(503 + Retry-After, and the count given back when a client leaves or a request fails), deeply nested JSON."""
from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import tempfile

import aiohttp
import httpx
import pytest
from aiohttp.test_utils import TestServer

from radixserve.actors.api.api_key import exposure_warnings, load_api_key
from radixserve.actors.api.app import make_app
from radixserve.actors.api.boundary import Boundary
from radixserve.actors.api.hosts import AllowedHosts, parse_host
from radixserve.actors.api.server import ApiServer, Limits
from radixserve.actors.transport import Endpoints
from radixserve.server_process import ServerProcess

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
DEEP = b"[" * 10_000 + b"]" * 10_000


def api_server(**limits) -> ApiServer:
    """The api actor alone: nothing answers its requests, so a generation waits until the test ends it."""
    return ApiServer(Endpoints(tempfile.mkdtemp()), {"model": "m", "started": 0, "context_length": 8},
                     Limits(**limits))


def run(test, boundary: Boundary | None = None, **limits) -> None:
    """``test(server, base_url, api)`` against the app on a local port, client disconnects cancelling handlers as
    in launch_server."""
    async def main():
        api = api_server(**limits)
        api.start()
        server = TestServer(make_app(api, boundary), handler_cancellation=True)
        await server.start_server()
        try:
            await test(server, str(server.make_url("/")), api)
        finally:
            await server.close()
            await api.close()

    asyncio.run(main())


# -- Host --------------------------------------------------------------------------------------------------
def test_host_values_parse_with_and_without_port():
    assert parse_host("LocalHost:30000") == ("localhost", 30000)
    assert parse_host("localhost.") == ("localhost", None)
    assert parse_host("[::1]:8080") == ("::1", 8080)
    assert parse_host("[0:0::1]") == ("::1", None)
    assert parse_host("10.0.0.5:1") == ("10.0.0.5", 1)
    for bad in ("[::1", "[nope]:1", "a b", "evil.example:port", "host:99999", "", "ex\u00e4mple.com", "::1"):
        with pytest.raises(ValueError):
            parse_host(bad)


def test_allowed_hosts_default_to_loopback_the_bound_name_and_the_connections_own_address():
    default = AllowedHosts.build("127.0.0.1")
    for host in ("localhost", "127.0.0.1", "127.3.2.1", "::1"):
        assert default.allows(host, "127.0.0.1")
    assert not default.allows("evil.example", "127.0.0.1")
    assert not default.allows("10.0.0.5", "127.0.0.1"), "an address the connection did not arrive on"
    anywhere = AllowedHosts.build("0.0.0.0")  # a health check naming the address it reached
    assert anywhere.allows("10.0.0.5", "10.0.0.5") and anywhere.allows("10.0.0.5", "::ffff:10.0.0.5")
    assert not anywhere.allows("10.0.0.6", "10.0.0.5") and not anywhere.allows("box.lan", "10.0.0.5")
    named = AllowedHosts.build("box.lan", ["api.example.com", ".corp.example", "::2"])
    assert named.allows("box.lan", None) and named.allows("api.example.com", None) and named.allows("::2", None)
    assert named.allows("corp.example", None) and named.allows("a.b.corp.example", None)
    assert not named.allows("evilcorp.example", None) and not named.allows("example.com", None)
    assert AllowedHosts.build("127.0.0.1", ["*"]).allows("evil.example", None)


@pytest.mark.parametrize("entries, said", [(["*", "a.example"], "give it alone"), (["a.example:443"], "without a port"),
                                           (["a b"], "not a host name")])
def test_bad_allowed_hosts_are_named(entries, said):
    with pytest.raises(ValueError, match=said):
        AllowedHosts.build("127.0.0.1", entries)


def test_a_rebound_host_is_refused_421_and_loopback_names_are_served():
    async def test(server, url, api):
        port = server.port
        async with aiohttp.ClientSession() as s:
            for path in ("/v1/models", "/health", "/dashboard"):
                async with s.get(url + path.lstrip("/"), headers={"Host": f"evil.example:{port}"}) as resp:
                    body = await resp.json()
                    assert resp.status == 421 and body["error"]["code"] == "host_not_allowed", path
                    assert "--allowed-hosts evil.example" in body["error"]["message"]
            async with s.post(url + "generate", json={"text": "hi"}, headers={"Host": "evil.example"}) as resp:
                assert resp.status == 421
            async with s.post(url + "flush_cache", headers={"Host": "evil.example"}) as resp:
                assert resp.status == 421
            for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost"):
                async with s.get(url + "v1/models", headers={"Host": host}) as resp:
                    assert resp.status == 200, host
            async with s.get(url + "v1/models", headers={"Host": "[::1"}) as resp:
                assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_host"

    run(test)


def test_listed_hosts_and_the_wildcard():
    async def listed(server, url, api):
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "v1/models", headers={"Host": "llm.example.com:443"}) as resp:
                assert resp.status == 200
            async with s.get(url + "v1/models", headers={"Host": "other.example.com"}) as resp:
                assert resp.status == 421

    run(listed, Boundary(hosts=AllowedHosts.build("127.0.0.1", ["llm.example.com"])))

    async def anything(server, url, api):
        async with aiohttp.ClientSession() as s, s.get(url + "v1/models", headers={"Host": "x.example"}) as resp:
            assert resp.status == 200

    run(anything, Boundary(hosts=AllowedHosts.build("127.0.0.1", ["*"])))


# -- the API key -------------------------------------------------------------------------------------------
def test_the_key_comes_from_a_file_the_environment_or_the_flag(tmp_path, caplog):
    path = tmp_path / "key"
    path.write_text("s3cret\n")
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING):
        assert load_api_key(None, str(path), {}) == "s3cret"
        assert not caplog.records, "a private key file is not worth a warning"
        assert load_api_key(None, None, {"RADIXSERVE_API_KEY": "from-env"}) == "from-env"
        assert not caplog.records
        assert load_api_key("on-the-line", None, {}) == "on-the-line"
        assert "ps" in caplog.text, "the flag is visible to every local user"
    assert load_api_key(None, None, {}) is None
    caplog.clear()
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        load_api_key(None, str(path), {})
    assert "can be read by other users" in caplog.text and "chmod 600" in caplog.text


@pytest.mark.parametrize("flag, file, env, said", [
    ("a", "KEYFILE", None, "given 2 ways (--api-key-file, --api-key)"),
    (None, "KEYFILE", "b", "given 2 ways (--api-key-file, $RADIXSERVE_API_KEY)"),
    ("a", None, "b", "given 2 ways ($RADIXSERVE_API_KEY, --api-key)"),
    (None, None, "", "$RADIXSERVE_API_KEY is empty"),
    (None, "EMPTY", None, "--api-key-file is empty"),
    (None, "MISSING", None, "cannot read the key"),
    ("two words", None, None, "without spaces"),
])
def test_a_key_given_twice_or_unusable_is_an_error(tmp_path, flag, file, env, said):
    (tmp_path / "KEYFILE").write_text("k")
    (tmp_path / "EMPTY").write_text("\n")
    environ = {} if env is None else {"RADIXSERVE_API_KEY": env}
    with pytest.raises(ValueError) as err:
        load_api_key(flag, str(tmp_path / file) if file else None, environ)
    assert said in str(err.value)


def test_the_key_guards_every_route_but_health_and_the_host_check_comes_first():
    async def test(server, url, api):
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "v1/models") as resp:
                assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
            for auth in ("Bearer sesame", "bearer sesame"):
                async with s.get(url + "v1/models", headers={"Authorization": auth}) as resp:
                    assert resp.status == 200
            async with s.get(url + "v1/models", headers={"Authorization": "Basic sesame"}) as resp:
                assert resp.status == 401
            async with s.get(url + "health") as resp:
                assert resp.status == 200
            async with s.get(url + "v1/models", headers={"Authorization": "Bearer sesame",
                                                         "Host": "evil.example"}) as resp:
                assert resp.status == 421

    run(test, Boundary(api_key="sesame"))


def test_an_exposed_server_without_a_key_is_warned_about():
    loopback, exposed = AllowedHosts.build("127.0.0.1"), AllowedHosts.build("0.0.0.0")
    assert exposure_warnings("127.0.0.1", None, loopback) == [] and exposure_warnings("::1", None, loopback) == []
    assert exposure_warnings("0.0.0.0", "k", exposed) == []
    [warning] = exposure_warnings("0.0.0.0", None, exposed)
    assert "without an API key" in warning and "--api-key-file" in warning
    [rebinding] = exposure_warnings("127.0.0.1", None, AllowedHosts.build("127.0.0.1", ["*"]))
    assert "DNS rebinding" in rebinding


def _serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``radixserve serve`` that fails at the model (a path that does not exist): the boundary is settled first."""
    return subprocess.run([sys.executable, "-m", "radixserve", "serve", "--model-path", "/nonexistent/model", *args],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def test_the_cli_warns_before_loading_and_refuses_two_keys(tmp_path):
    exposed = _serve("--host", "0.0.0.0")
    assert "listening on 0.0.0.0 without an API key" in exposed.stderr
    keyfile = tmp_path / "key"
    keyfile.write_text("k\n")
    keyfile.chmod(0o600)
    quiet = _serve("--host", "0.0.0.0", "--api-key-file", str(keyfile))
    assert "without an API key" not in quiet.stderr and "--api-key-file" not in quiet.stderr
    twice = _serve("--api-key-file", str(keyfile), env={"RADIXSERVE_API_KEY": "k"})
    assert twice.returncode == 2 and "the key is given 2 ways" in twice.stderr
    assert "/nonexistent" not in twice.stderr, "refused before the model is looked for"


def test_a_served_model_takes_its_key_from_the_environment_and_refuses_rebound_hosts(tiny_models):
    server = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32", "--max-total-tokens",
                           "600", env={"RADIXSERVE_API_KEY": "from-env"})
    try:
        key = {"Authorization": "Bearer from-env"}
        assert httpx.get(server.url + "/v1/models").status_code == 401
        for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}"):
            assert httpx.get(server.url + "/v1/models", headers={**key, "Host": host}).status_code == 200
        rebound = httpx.post(server.url + "/generate", json={"text": "hi"}, headers={**key, "Host": "evil.example"})
        assert rebound.status_code == 421 and rebound.json()["error"]["code"] == "host_not_allowed"
        assert "from-env" not in httpx.get(server.url + "/get_server_info", headers=key).text
    finally:
        server.stop()


# -- caps --------------------------------------------------------------------------------------------------
def test_connections_beyond_the_cap_get_503_and_the_cap_recovers():
    async def test(server, url, api):
        first, second, third = (aiohttp.ClientSession() for _ in range(3))  # a connection each, kept alive
        try:
            for s in (first, second):
                async with s.get(url + "health") as resp:
                    assert resp.status == 200
            async with third.get(url + "health") as resp:
                assert resp.status == 503 and resp.headers["Retry-After"] == "1"
                assert (await resp.json())["error"]["code"] == "too_many_connections"
                assert resp.headers.get("Connection", "").lower() == "close"
            await first.close()  # one client leaves: its place is free again
            for _ in range(50):
                async with third.get(url + "health") as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.05)
            assert resp.status == 200
        finally:
            for s in (first, second, third):
                await s.close()

    run(test, Boundary(max_connections=2))


def test_streams_beyond_the_cap_get_503_and_leaving_or_failing_gives_the_place_back():
    stream = {**CHAT, "stream": True}

    async def wait_for(condition) -> None:
        for _ in range(100):
            if condition():
                return
            await asyncio.sleep(0.02)
        raise AssertionError("the server did not get there")

    async def test(server, url, api):
        async with aiohttp.ClientSession() as s:
            leaving = aiohttp.ClientSession()
            first = asyncio.create_task(leaving.post(url + "v1/chat/completions", json=stream))
            await wait_for(lambda: api.open_streams == 1)  # admitted, waiting for its first token
            async with s.post(url + "generate", json={"text": "hi", "stream": True}) as resp:
                assert resp.status == 503 and resp.headers["Retry-After"] == "1"
                assert (await resp.json())["error"]["code"] == "too_many_streams"
            unstreamed = asyncio.create_task(s.post(url + "v1/chat/completions", json=CHAT))
            await wait_for(lambda: len(api.pending) == 2)  # a request that does not stream is not counted
            unstreamed.cancel()
            first.cancel()
            await leaving.close()  # the client goes away: its stream's place is given back
            await wait_for(lambda: api.open_streams == 0)
            again = asyncio.create_task(s.post(url + "v1/chat/completions", json=stream))
            await wait_for(lambda: api.open_streams == 1)
            api.fail_all("the tokenizer actor exited")  # a request that fails gives its place back too
            resp = await again
            assert resp.status == 503 and api.open_streams == 0

    run(test, max_streams=1)


# -- bodies ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body", [
    ("/generate", b'{"text": ' + DEEP + b"}"),
    ("/v1/chat/completions", DEEP),
    ("/v1/completions", b'{"model": "m", "prompt": "a", "logit_bias": {"1": ' + DEEP + b"}}"),
])
def test_ten_thousand_nested_arrays_are_a_400(path, body):
    async def test(server, url, api):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + path.lstrip("/"), data=body,
                              headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 400 and "error" in await resp.json()

    run(test)
