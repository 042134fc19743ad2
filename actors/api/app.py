"""The aiohttp application: routes, the boundary every request passes (boundary.py: open connections, Host, API
key, body size), JSON-only state changes, errors.

Cross-site safety: a web page can reach a server on this machine in two ways, and both are closed.
- A cross-site request: every route that changes state or runs the model is POST-only and takes only
  ``Content-Type: application/json`` bodies. A page can send a cross-site POST without asking the server first only
  as a "simple" request (form or text/plain bodies); those are refused (415) before anything runs, and a JSON request
  from another origin needs a CORS preflight that this server never grants (no Access-Control headers).
- DNS rebinding (the page's own name made to resolve to 127.0.0.1, so its requests are same-origin): they name the
  page's domain in ``Host``, which is not one the server answers to (hosts.py: 421).
"""
from __future__ import annotations

from aiohttp import web

from radixserve.actors.api import dashboard, unknown_fields
from radixserve.actors.api.boundary import Boundary
from radixserve.actors.api.errors import APIError, error_middleware
from radixserve.actors.api.openai import OpenAIRoutes
from radixserve.actors.api.responses import ResponsesRoutes
from radixserve.actors.api.server import SERVER, ApiServer
from radixserve.actors.api.sglang_routes import SGLangRoutes

OPEN_PATHS = {"/health", *dashboard.OPEN_PATHS}  # need no key: the dashboard's page and files hold no data


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


def make_app(server: ApiServer, boundary: Boundary | None = None) -> web.Application:
    """``boundary``: the key, the Host values and the caps (default: no key, loopback hosts)."""
    boundary = boundary or Boundary()
    middlewares = [error_middleware(server.metrics), *boundary.middlewares(OPEN_PATHS), json_only]
    app = web.Application(middlewares=middlewares, client_max_size=boundary.max_body)
    app[SERVER] = server
    unknown_fields.install(app)
    openai = OpenAIRoutes(server)
    openai.add_to(app)
    ResponsesRoutes(server, openai).add_to(app)
    SGLangRoutes(server).add_to(app)
    dashboard.DashboardRoutes(server).add_to(app)
    return app
