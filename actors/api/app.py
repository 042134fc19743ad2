"""The aiohttp application: routes, auth, errors, body-size limit."""
from __future__ import annotations

import hmac

from aiohttp import web

from radixserve.actors.api.errors import APIError, error_middleware
from radixserve.actors.api.native import NativeRoutes
from radixserve.actors.api.openai import OpenAIRoutes
from radixserve.actors.api.server import ApiServer

MAX_BODY_BYTES = 8 * 2**20
OPEN_PATHS = {"/health"}


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


def make_app(server: ApiServer, api_key: str | None = None, max_body: int = MAX_BODY_BYTES) -> web.Application:
    middlewares = [error_middleware] + ([auth_middleware(api_key)] if api_key else [])
    app = web.Application(middlewares=middlewares, client_max_size=max_body)
    OpenAIRoutes(server).add_to(app)
    NativeRoutes(server).add_to(app)
    return app
