"""GET /dashboard: one live page (plain files from ``static/``, nothing loaded from elsewhere) over the JSON routes
the server already has, plus GET /dashboard/state: the radix tree's largest and hottest subtrees and the queues,
from the scheduler (``dashboard`` control op).

The page and its files hold no data, so they are open even with --api-key (``OPEN_PATHS``); the page asks for the
key and sends it on every fetch. /dashboard/state needs the key like every other route.
"""
from __future__ import annotations

from pathlib import Path

from aiohttp import web

from radixserve.actors.api.errors import APIError
from radixserve.actors.api.http_io import json_response
from radixserve.actors.api.server import ApiServer

STATIC = Path(__file__).parent / "static"
# the only files /dashboard/{file} serves, with their content types
ASSETS = {"dashboard.js": "text/javascript", "page.js": "text/javascript", "chart.js": "text/javascript",
          "dashboard.css": "text/css"}
OPEN_PATHS = frozenset({"/dashboard", *(f"/dashboard/{name}" for name in ASSETS)})
SHADOW_ROUTE = "/policies/shadow"  # optional: the page asks for it only where the server has it
# the page may load only from this server; no inline script or style (so none can be injected)
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
           "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"}


class DashboardRoutes:
    def __init__(self, server: ApiServer) -> None:
        self.server = server

    def add_to(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/dashboard", self.page)
        r.add_get("/dashboard/state", self.state)  # before {file}: the first route that matches answers
        r.add_get("/dashboard/{file}", self.asset)

    async def page(self, request: web.Request) -> web.Response:
        """The dashboard: a page that polls /dashboard/state (the pool, the tree, the queues, the policies)."""
        return self._file("dashboard.html", "text/html")

    async def asset(self, request: web.Request) -> web.Response:
        """One of the dashboard page's own files (a fixed list of names)."""
        name = request.match_info["file"]
        if name not in ASSETS:  # a fixed set of names: no path from the request ever reaches the file system
            raise APIError(404, f"no dashboard file {name!r}", code="not_found")
        return self._file(name, ASSETS[name])

    async def state(self, request: web.Request) -> web.Response:
        """What the dashboard shows: the radix tree's largest and hottest subtrees, the queues, the pool."""
        body = (await self.server.control("dashboard")).body
        has_shadow = any(res.canonical == SHADOW_ROUTE for res in request.app.router.resources())
        return json_response({**body, "routes": {"shadow": has_shadow}})

    @staticmethod
    def _file(name: str, content_type: str) -> web.Response:
        return web.Response(body=(STATIC / name).read_bytes(), content_type=content_type, charset="utf-8",
                            headers=HEADERS)
