"""The aiohttp application: routes, auth, JSON-only state changes, errors, body-size limit.

Cross-site safety: every route that changes state or runs the model is POST-only and takes only
``Content-Type: application/json`` bodies. A web page can send a cross-site POST without asking the server first
only as a "simple" request (form or text/plain bodies); those are refused (415) before anything runs, and a JSON
request from another origin needs a CORS preflight that this server never grants (no Access-Control headers).
"""
from __future__ import annotations

import hmac

from aiohttp import web

from radixserve.actors.api import dashboard
from radixserve.actors.api.errors import APIError, error_middleware
from radixserve.actors.api.native import NativeRoutes
from radixserve.actors.api.openai import OpenAIRoutes
from radixserve.actors.api.server import SERVER, ApiServer

MAX_BODY_BYTES = 8 * 2**20
OPEN_PATHS = {"/health", *dashboard.OPEN_PATHS}  # the dashboard's page and files hold no data


def auth_middleware(api_key: str):
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                raise APIError(401, "missing or wrong API key: send `Authorization: Bearer <key>`",
                               type="invalid_request_error", code="invalid_api_key")
        return await handler(request)

    return check


@web.middleware
async def json_only(request: web.Request, handler):
    """POST routes take JSON only, so a web page cannot drive this server with a simple cross-site request. A POST
    with no body at all (SGLang's ``flush_cache()`` sends one) passes when no browser sent it: browsers add an
    ``Origin`` header to every cross-site POST, HTTP clients such as requests and urllib add none."""
    bodiless = not request.can_read_body and "Origin" not in request.headers
    if request.method == "POST" and request.match_info.http_exception is None \
            and request.content_type != "application/json" and not bodiless:
        raise APIError(415, f"send the body as JSON with `Content-Type: application/json` (got "
                            f"{request.content_type!r})", code="unsupported_media_type")
    return await handler(request)


def make_app(server: ApiServer, api_key: str | None = None, max_body: int = MAX_BODY_BYTES) -> web.Application:
    middlewares = [error_middleware(server.metrics)] + ([auth_middleware(api_key)] if api_key else []) + [json_only]
    app = web.Application(middlewares=middlewares, client_max_size=max_body)
    app[SERVER] = server
    OpenAIRoutes(server).add_to(app)
    NativeRoutes(server).add_to(app)
    dashboard.DashboardRoutes(server).add_to(app)
    return app
