"""Which ``Host`` a request may name: the guard against DNS rebinding.

A page on an attacker's domain can have its name resolve to 127.0.0.1 a moment after it loaded, and then send
same-origin requests (JSON POSTs too, no CORS preflight) to a server on this machine and read the answers. What it
cannot change is the ``Host`` header: the browser sends the attacker's name. So a server answers only Host values
that are its own:

- the loopback name and addresses (``localhost``, 127.0.0.0/8, ``::1``): no outsider says what they resolve to;
- the address the connection arrived on, as an IP literal (``10.0.0.5``, ``[fe80::1]``): a browser sends an IP
  literal only to the machine at that IP, no name was rebound. With ``--host 0.0.0.0`` that is whichever address
  of this machine the client reached (what load balancers' and Kubernetes' health checks send); behind NAT (a
  published container port) the address the client used is not one the server sees: list it;
- the name given as ``--host``, and every ``--allowed-hosts`` entry: a name or address, or ``.example.com`` for that
  domain and its subdomains. ``*`` alone turns the check off (behind a reverse proxy that checks Host itself).

Ports are never compared: ``localhost:8080`` through a local proxy is still localhost. Any other Host is answered
421, a malformed one or none 400 -- on every route, /health included.
"""
from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

from aiohttp import hdrs, web

from radixserve.actors.api.errors import APIError

ANY = "*"
LOOPBACK_NAMES = frozenset({"localhost"})
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::", "[::]"})  # listening on every address: no one name of its own
_LABELS = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")  # a DNS name or a dotted IPv4 address, lowercase
IP = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_host(value: str) -> tuple[str, int | None]:
    """A Host value's host and port: ``name``, ``name:port``, ``1.2.3.4:port``, ``[::1]:port``. The host comes
    back lowercase, without brackets or a final dot, an IP literal in its canonical form. ValueError when the value
    is none of these."""
    text = value.strip().lower()
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket:
            raise ValueError(f"{value!r} opens an IPv6 address with [ and never closes it")
        try:
            host = str(ipaddress.IPv6Address(host))
        except ValueError:
            raise ValueError(f"{value!r} is not an IPv6 address in brackets") from None
    else:
        host, colon, port = text.partition(":")
        rest = colon + port
        host = host.rstrip(".")  # "localhost." is the same host, spelled absolute
        if not _LABELS.fullmatch(host):
            raise ValueError(f"{value!r} is not a host name, an IPv4 address or an [IPv6] address")
        if (ip := _ip(host)) is not None:
            host = str(ip)
    if not rest:
        return host, None
    if not (rest.startswith(":") and rest[1:].isdigit() and len(rest) <= 6 and int(rest[1:]) < 65536):
        raise ValueError(f"{value!r} has no valid port after the host")
    return host, int(rest[1:])


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a --host value) is reachable only from this machine."""
    name = host.strip("[]").lower()
    ip = _ip(name)
    return name in LOOPBACK_NAMES or (ip is not None and ip.is_loopback)


@dataclass(frozen=True, slots=True)
class AllowedHosts:
    """The Host values a server answers besides loopback and the connection's own address."""

    names: frozenset[str] = frozenset()  # exact hosts, parsed as parse_host returns them
    domains: tuple[str, ...] = ()  # "example.com" from ".example.com": that domain and every subdomain
    any: bool = False  # "*": no check at all

    @classmethod
    def build(cls, bound: str, listed: Iterable[str] | None = None) -> AllowedHosts:
        """``bound``: the --host the server listens on; ``listed``: --allowed-hosts. ValueError names a bad entry."""
        listed = tuple(listed or ())
        if ANY in listed:
            if len(listed) > 1:
                raise ValueError(f"--allowed-hosts {' '.join(listed)}: '*' allows every Host; give it alone")
            return cls(any=True)
        names, domains = set(), []
        if bound.strip() not in WILDCARD_BINDS:
            names.add(_entry(bound, "--host"))
        for entry in listed:
            if entry.startswith("."):
                domains.append(_entry(entry[1:], "--allowed-hosts"))
            else:
                names.add(_entry(entry, "--allowed-hosts"))
        return cls(frozenset(names), tuple(domains))

    def allows(self, host: str, local: str | None) -> bool:
        """``host`` as parse_host returns it; ``local``: the address the connection arrived on (None: unknown)."""
        if self.any or host in LOOPBACK_NAMES or host in self.names:
            return True
        if any(host == d or host.endswith("." + d) for d in self.domains):
            return True
        ip = _ip(host)
        if ip is None:
            return False
        here = _ip(local) if local else None
        return ip.is_loopback or (here is not None and _unmapped(ip) == _unmapped(here))


def host_middleware(allowed: AllowedHosts):
    @web.middleware
    async def check(request: web.Request, handler):
        if not allowed.any:
            value = request.headers.get(hdrs.HOST)
            if not value:
                raise APIError(400, "the request has no Host header; send the server's name or address in it",
                               code="invalid_host")
            try:
                host, _ = parse_host(value)
            except ValueError as exc:
                raise APIError(400, f"bad Host header: {exc}", code="invalid_host") from None
            if not allowed.allows(host, _local_address(request)):
                raise APIError(421, f"this server does not answer to Host {host!r} (a guard against DNS "
                                    f"rebinding). If that is its name, start it with --allowed-hosts {host}",
                               code="host_not_allowed")
        return await handler(request)

    return check


def _local_address(request: web.Request) -> str | None:
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    return sockname[0] if isinstance(sockname, tuple) else None  # a unix socket has a path, no address


def _entry(value: str, flag: str) -> str:
    if (ip := _ip(value.strip())) is not None:
        return str(ip)  # an IPv6 address without brackets too ("::1")
    try:
        host, port = parse_host(value)
    except ValueError as exc:
        raise ValueError(f"{flag} {value!r}: {exc}") from None
    if port is not None and flag == "--allowed-hosts":
        raise ValueError(f"--allowed-hosts {value!r}: give the host without a port (ports are not checked)")
    return host


def _ip(text: str) -> IP | None:
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])  # a link-local address may carry its interface
    except ValueError:
        return None


def _unmapped(ip: IP) -> IP:
    """A dual-stack socket reports an IPv4 client's connection as ::ffff:a.b.c.d."""
    return getattr(ip, "ipv4_mapped", None) or ip
