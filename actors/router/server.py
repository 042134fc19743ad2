"""``radixserve router --worker-urls URL ...``: one HTTP front for several radixserve (or SGLang-compatible)
servers. Each request's text picks a worker through the routing policy (cache-aware by default: requests that
share a prefix go where it is probably cached); the worker's answer, streamed or not, is passed through as it
comes. Workers are health-checked (``GET /health``); one that fails is taken out (and forgotten by the policy)
until it answers again. A request whose worker fails before anything was sent back is retried on another; one
that fails mid-stream ends with an error event. The router's own routes: ``/health``, ``/workers``,
``/get_server_info``; ``POST /flush_cache`` goes to every healthy worker; the generation routes and the model
routes are proxied.

Its front door is the api server's (actors/api/boundary.py): Host check, its own key (``--api-key-file``,
``$RADIXSERVE_API_KEY`` or ``--api-key``; only ``/health`` is open), a cap on connections, 8 MiB bodies. A worker is
sent only the client's headers it needs (``FORWARDED``) and the workers' own key (``--worker-api-key-file``,
``$RADIXSERVE_WORKER_API_KEY``, ``--worker-api-key``): never the client's credentials or cookies."""
from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any

import aiohttp
import msgspec
from aiohttp import hdrs, web

from radixserve.actors.api.api_key import load_api_key
from radixserve.actors.api.boundary import MAX_CONNECTIONS, Boundary, boundary_from_flags
from radixserve.actors.api.errors import APIError, error_middleware
from radixserve.actors.router.policies import RoutingConfig, Worker, load_routing_policy

log = logging.getLogger(__name__)

ROUTED = ("/v1/completions", "/v1/chat/completions", "/generate")  # POST, a worker chosen by the request's text
ANY_WORKER = ("/v1/models", "/get_model_info")  # GET, any healthy worker answers
ANY_WORKER_POST = ("/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize")  # POST, any healthy worker
EVERY_WORKER = ("/flush_cache", "/abort_request")  # POST, sent to every healthy worker
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}
# the client's headers a worker is sent: what it needs to read the body and shape the answer, nothing that
# identifies or authenticates the client (Authorization, Cookie): workers get the router's worker key instead
FORWARDED = (hdrs.CONTENT_TYPE, hdrs.ACCEPT, "X-Request-Id")
OPEN_PATHS = frozenset({"/health"})  # needs no key: load balancers check it
WORKER_KEY_ENV = "RADIXSERVE_WORKER_API_KEY"
BUSY = (502, 503, 504)  # a worker's answer that another worker may not give: the request tries the next one


def route_text(path: str, body: Any) -> str:
    """The text a request's prefix is matched on: the prompt, a chat's messages in order, or /generate's text
    (token ids as text when it sends ids)."""
    if not isinstance(body, dict):
        return ""
    if path == "/v1/chat/completions":
        parts = []
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
            role = m.get("role", "") if isinstance(m, dict) else ""
            parts.append(f"{role}:{content if isinstance(content, str) else ''}\n")
        return "".join(parts)
    value = body.get("prompt") if path == "/v1/completions" else body.get("text", body.get("input_ids"))
    if isinstance(value, list) and value and not isinstance(value[0], int):
        value = value[0]  # a batch: routed by its first prompt
    if isinstance(value, list):
        return ",".join(map(str, value))
    return value if isinstance(value, str) else ""


class Router:
    def __init__(self, urls: list[str], policy: str = "cache-aware", config: RoutingConfig | None = None,
                 health_interval_s: float = 1.0, failures_to_remove: int = 2,
                 worker_api_key: str | None = None) -> None:
        """``worker_api_key``: sent to every worker as ``Authorization: Bearer`` (None: no Authorization at all)."""
        if not urls:
            raise ValueError("the router needs at least one --worker-urls URL")
        self.worker_api_key = worker_api_key
        self._refused_by: set[str] = set()  # workers that answered 401: said once in the log
        self.workers = [Worker(url.rstrip("/")) for url in urls]
        self.policy = load_routing_policy(policy, config)
        self.health_interval_s, self.failures_to_remove = health_interval_s, failures_to_remove
        self.routed = {w.url: 0 for w in self.workers}
        self._failures = {w.url: 0 for w in self.workers}
        self.session: aiohttp.ClientSession | None = None
        self._checks: aiohttp.ClientSession | None = None  # health checks: never queued behind requests
        self._health: asyncio.Task | None = None

    async def start(self, app: web.Application) -> None:
        # no cap on connections: each stream holds one for as long as it runs
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        self._checks = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        self._health = asyncio.create_task(self._watch())

    async def stop(self, app: web.Application) -> None:
        if self._health is not None:
            self._health.cancel()
        for session in (self.session, self._checks):
            if session is not None:
                await session.close()

    async def _watch(self) -> None:
        while True:
            try:
                await asyncio.gather(*(self._check(w) for w in self.workers))
            except Exception:  # a bug here must not end health checking for good
                log.exception("health check round failed")
            await asyncio.sleep(self.health_interval_s)

    async def _check(self, worker: Worker) -> None:
        try:
            async with self._checks.get(worker.url + "/health") as resp:
                ok = resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ok = False
        if ok:
            self._failures[worker.url] = 0
            if not worker.healthy:
                log.info("worker %s is back", worker.url)
            worker.healthy = True
        else:
            self._failures[worker.url] += 1
            if self._failures[worker.url] >= self.failures_to_remove:
                self._take_out(worker, "failed its health check")

    def _take_out(self, worker: Worker, why: str) -> None:
        if worker.healthy:
            log.warning("worker %s taken out: %s", worker.url, why)
            worker.healthy = False
            if hasattr(self.policy, "forget"):
                self.policy.forget(worker.url)

    def _healthy(self, exclude: set[str] = frozenset()) -> list[Worker]:
        workers = [w for w in self.workers if w.healthy and w.url not in exclude]
        if not workers:
            raise APIError(503, "no healthy worker to send the request to", code="no_healthy_worker",
                           retry_after=1)
        return workers

    # -- routes ------------------------------------------------------------------------------------------
    async def proxy_routed(self, request: web.Request) -> web.StreamResponse:
        data = await request.read()
        try:  # msgspec: an 8 MiB body is parsed in milliseconds, the event loop barely notices
            body = msgspec.json.decode(data) if data else None
        except msgspec.DecodeError:
            body = None  # the worker answers the malformed body with its own 400
        except RecursionError:
            raise APIError(400, "the request body is nested too deeply") from None
        text = route_text(request.path, body)
        return await self._serve(request, data, lambda workers: self.policy.choose(text, workers))

    async def proxy_any(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, await request.read(), lambda workers: workers[0])

    async def _serve(self, request: web.Request, data: bytes, pick) -> web.StreamResponse:
        """The request on the worker ``pick`` chooses among the healthy ones not tried yet; on another while one
        fails before answering or answers 502/503/504 (each worker once; the last such answer is passed on)."""
        tried: set[str] = set()
        while True:
            worker = pick(self._healthy(tried))
            tried.add(worker.url)
            self.routed[worker.url] += 1
            worker.load += 1
            try:
                return await self._forward(request, worker, data)
            except _NothingSent as exc:  # the worker failed before answering: another one may
                self._take_out(worker, str(exc))
                log.warning("retrying a request that %s failed before answering", worker.url)
            except _Busy as busy:  # draining, overloaded or broken there: the next worker, if there is one
                if not any(w.healthy and w.url not in tried for w in self.workers):
                    return busy.response
            finally:
                worker.load -= 1

    def worker_headers(self, request: web.Request) -> dict[str, str]:
        """What a worker is sent of ``request``'s headers (``FORWARDED``), and the worker key, if any."""
        headers = {name: request.headers[name] for name in FORWARDED if name in request.headers}
        if self.worker_api_key is not None:
            headers[hdrs.AUTHORIZATION] = f"Bearer {self.worker_api_key}"
        return headers

    def _note_refusal(self, worker: str, status: int) -> None:
        if status == 401 and worker not in self._refused_by:
            self._refused_by.add(worker)
            log.warning("worker %s wants an API key the router does not send it: start the router with "
                        "--worker-api-key-file (or $%s)", worker, WORKER_KEY_ENV)

    async def _forward(self, request: web.Request, worker: Worker, data: bytes) -> web.StreamResponse:
        try:
            upstream = await self.session.request(request.method, worker.url + request.path_qs, data=data,
                                                  headers=self.worker_headers(request))
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _NothingSent(f"{type(exc).__name__}: {exc}") from exc
        self._note_refusal(worker.url, upstream.status)
        async with upstream:
            passed = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
            if upstream.content_type != "text/event-stream":
                try:
                    payload = await upstream.read()
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    raise _NothingSent(f"{type(exc).__name__}: {exc}") from exc
                answer = web.Response(body=payload, status=upstream.status, headers=passed)
                if upstream.status in BUSY:
                    raise _Busy(answer)
                return answer
            response = web.StreamResponse(status=upstream.status, headers=passed)
            await response.prepare(request)
            while True:
                try:
                    chunk = await upstream.content.readany()
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # the worker broke: too late to retry
                    self._take_out(worker, f"failed mid-stream: {type(exc).__name__}")
                    error = APIError(502, f"the worker serving this request failed mid-stream ({worker.url})",
                                     code="worker_failed", type="server_error")
                    chunk = f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()
                    upstream = None
                if not chunk:
                    break
                try:
                    await response.write(chunk)
                except (ConnectionError, aiohttp.ClientConnectionResetError):  # the client left: the worker is
                    return response  # fine; leaving the upstream response closes it, which aborts the request
                if upstream is None:
                    break
            await response.write_eof()
            return response

    async def every_worker(self, request: web.Request) -> web.Response:
        """``/flush_cache``, ``/abort_request``: sent to every healthy worker (with the worker key)."""
        data = await request.read()
        headers = self.worker_headers(request)

        async def one(worker: Worker):
            try:
                async with self.session.post(worker.url + request.path, data=data, headers=headers) as resp:
                    self._note_refusal(worker.url, resp.status)
                    return worker.url, resp.status, await resp.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                return worker.url, 502, {"error": f"{type(exc).__name__}: {exc}"}

        answers = await asyncio.gather(*(one(w) for w in self._healthy()))
        codes = {code for _, code, _ in answers}
        status = 200 if codes == {200} else max(codes)
        return web.json_response({"workers": {url: body for url, _, body in answers}}, status=status)

    async def health(self, request: web.Request) -> web.Response:
        up = sum(w.healthy for w in self.workers)
        return web.json_response({"status": "ok" if up else "unhealthy", "healthy_workers": up},
                                 status=200 if up else 503)

    async def list_workers(self, request: web.Request) -> web.Response:
        return web.json_response({"policy": self.policy.name, "workers": [
            {"url": w.url, "healthy": w.healthy, "load": w.load, "routed": self.routed[w.url]}
            for w in self.workers]})

    def app(self, boundary: Boundary | None = None) -> web.Application:
        """``boundary``: the router's key, Host values and caps (default: no key, loopback hosts)."""
        boundary = boundary or Boundary()
        app = web.Application(middlewares=[error_middleware(None), *boundary.middlewares(OPEN_PATHS)],
                              client_max_size=boundary.max_body)
        for path in ROUTED:
            app.router.add_post(path, self.proxy_routed)
        for path in ANY_WORKER:
            app.router.add_get(path, self.proxy_any)
        for path in ANY_WORKER_POST:
            app.router.add_post(path, self.proxy_any)
        for path in EVERY_WORKER:
            app.router.add_post(path, self.every_worker)
        app.router.add_get("/health", self.health)
        app.router.add_get("/workers", self.list_workers)
        app.router.add_get("/get_server_info", self.list_workers)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app


class _NothingSent(Exception):
    """The worker failed before any of its answer reached the client: the request can go elsewhere."""


class _Busy(Exception):
    """The worker answered 502/503/504: another may serve the request (if none does, this answer is passed on)."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


def add_cli_args(parser) -> None:
    d = RoutingConfig()
    parser.add_argument("--worker-urls", nargs="+", required=True, help="the servers to route to")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=30000, help="port to listen on")
    parser.add_argument("--api-key-file", metavar="PATH",
                        help="clients must send `Authorization: Bearer <key>` with the key in this file (every "
                             "route but /health); or $RADIXSERVE_API_KEY, or --api-key KEY (visible in ps)")
    parser.add_argument("--api-key", metavar="KEY", help="the router's key on the command line (prefer "
                        "--api-key-file)")
    parser.add_argument("--worker-api-key-file", metavar="PATH",
                        help=f"the key sent to every worker (the workers' own --api-key); or ${WORKER_KEY_ENV}, or "
                             "--worker-api-key KEY. Clients' Authorization headers are never passed on")
    parser.add_argument("--worker-api-key", metavar="KEY", help="the workers' key on the command line (prefer "
                        "--worker-api-key-file)")
    parser.add_argument("--allowed-hosts", nargs="+", metavar="HOST",
                        help="Host values answered besides loopback, --host and the connection's own address "
                             "(others: 421); `.example.com` for a domain and its subdomains, `*` for any")
    parser.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                        help="open client connections at once; beyond: 503 with Retry-After (default: %(default)s)")
    parser.add_argument("--policy", default="cache-aware",
                        help="routing policy (entry points radixserve.routing_policies: round-robin, least-load, "
                             "cache-aware, ...)")
    parser.add_argument("--cache-threshold", type=float, default=d.cache_threshold,
                        help="matched share of a request's text above which cache-aware routes by affinity")
    parser.add_argument("--balance-abs-threshold", type=int, default=d.balance_abs_threshold,
                        help="loads are skewed when max - min exceeds this (and max exceeds rel x min)")
    parser.add_argument("--balance-rel-threshold", type=float, default=d.balance_rel_threshold)
    parser.add_argument("--max-tree-size", type=int, default=d.max_tree_size,
                        help="characters of request text the cache-aware policy remembers per worker")
    parser.add_argument("--health-check-interval", type=float, default=1.0, help="seconds between health checks")
    parser.add_argument("--log-level", default="info")


def run_cli(args) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s [router] %(name)s: %(message)s")
    config = RoutingConfig(args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold,
                           args.max_tree_size)
    try:
        boundary = boundary_from_flags(args.host, args.allowed_hosts, args.max_connections, args.api_key,
                                       args.api_key_file, os.environ)
        worker_key = load_api_key(args.worker_api_key, args.worker_api_key_file, os.environ, env=WORKER_KEY_ENV,
                                  name="--worker-api-key")
        router = Router(args.worker_urls, args.policy, config, args.health_check_interval,
                        worker_api_key=worker_key)
    except ValueError as exc:
        print(f"radixserve router: error: {exc}")
        return 2
    log.info("routing %d workers (%s) on http://%s:%d", len(router.workers), router.policy.name, args.host,
             args.port)
    # handler_cancellation: a client that leaves cancels its proxied request (the worker stops generating)
    web.run_app(router.app(boundary), host=args.host, port=args.port, print=None, access_log=None,
                handler_cancellation=True)
    return 0
