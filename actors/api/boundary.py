"""What every request passes before a route sees it, on the api server and the router alike: a cap on open
connections, the Host check (hosts.py), the API key (api_key.py), and a cap on the body's size.

Order matters: the connection cap first (it costs nothing and closes what it refuses), then Host (a rebound page
learns nothing, not even whether a key is needed), then the key.
"""
from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from aiohttp import web

from radixserve.actors.api.api_key import auth_middleware, exposure_warnings, load_api_key
from radixserve.actors.api.errors import APIError
from radixserve.actors.api.hosts import AllowedHosts, host_middleware

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 2**20
MAX_CONNECTIONS = 512  # well under the usual 1024 open files, which the server's own sockets share
RETRY_AFTER_S = 1


@dataclass(frozen=True, slots=True)
class Boundary:
    api_key: str | None = None  # None: every route is open
    hosts: AllowedHosts = field(default_factory=AllowedHosts)  # default: loopback and the connection's address
    max_connections: int = MAX_CONNECTIONS
    max_body: int = MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections={self.max_connections} must be >= 1")

    def middlewares(self, open_paths: Collection[str]) -> list:
        """Fresh middlewares for one app (the connection cap keeps its own count). ``open_paths`` need no key."""
        keyed = [auth_middleware(self.api_key, open_paths)] if self.api_key is not None else []
        return [ConnectionCap(self.max_connections).middleware, host_middleware(self.hosts), *keyed]


def boundary_from_flags(host: str, allowed_hosts: Iterable[str] | None, max_connections: int, api_key: str | None,
                        api_key_file: str | None, environ: Mapping[str, str]) -> Boundary:
    """A server's boundary from its flags (and $RADIXSERVE_API_KEY), logging what its operator should know: a key
    on the command line, a key file others may read, no key beyond loopback. ValueError says what is wrong."""
    boundary = Boundary(load_api_key(api_key, api_key_file, environ), AllowedHosts.build(host, allowed_hosts),
                        max_connections)
    for warning in exposure_warnings(host, boundary.api_key, boundary.hosts):
        log.warning("%s", warning)
    return boundary


class ConnectionCap:
    """At most ``limit`` HTTP connections open at once, keep-alive ones between requests included (each holds a
    file descriptor). A request that arrives while more are open is answered 503 with ``Retry-After``, and its
    connection closed: so the count comes back down by itself, and a client that left is never counted (aiohttp
    drops a closed connection's transport)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: set = set()  # the connections requests came on (aiohttp's RequestHandler, one per connection)

    @property
    def open(self) -> int:
        self._seen = {conn for conn in self._seen if conn.transport is not None}
        return len(self._seen)

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        self._seen.add(request.protocol)
        if self.open > self.limit:
            raise APIError(503, f"the server has {self.limit} connections open, the most it keeps "
                                "(--max-connections); retry later", code="too_many_connections",
                           retry_after=RETRY_AFTER_S, close=True)
        return await handler(request)
