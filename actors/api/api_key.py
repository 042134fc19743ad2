"""The API key: where it comes from, how a request proves it has it, and what a server without one warns about.

One of ``--api-key-file PATH``, ``$RADIXSERVE_API_KEY`` or ``--api-key KEY`` gives it (more than one is an error:
which should win is a guess). A flag's value sits on the command line, which every local user can read (``ps``);
a file (mode 600) or the environment (``/proc/<pid>/environ`` is the owner's alone) do not. A request carries it as
``Authorization: Bearer <key>`` (what OpenAI's and SGLang's clients send).
"""
from __future__ import annotations

import hmac
import logging
import os
import stat
from collections.abc import Collection, Mapping

from aiohttp import hdrs, web

from radixserve.actors.api.errors import APIError
from radixserve.actors.api.hosts import AllowedHosts, is_loopback

log = logging.getLogger(__name__)

ENV = "RADIXSERVE_API_KEY"


def load_api_key(flag: str | None, file: str | None, environ: Mapping[str, str], env: str = ENV,
                 name: str = "--api-key") -> str | None:
    """The key from the one place it was given (``name`` and ``name``-file are the flags, ``env`` the variable),
    or None. ValueError when it is given twice, empty, unreadable, or not something a header can carry."""
    given = {f"{name}-file": file, f"${env}": environ.get(env), name: flag}
    given = {where: value for where, value in given.items() if value is not None}
    if len(given) > 1:
        raise ValueError(f"the key is given {len(given)} ways ({', '.join(given)}); give it one way only "
                         f"({name}-file or ${env} keep it out of `ps`)")
    if not given:
        return None
    (where, value), = given.items()
    if where == name:
        log.warning("%s puts the key on the command line, where every user of this machine can read it (ps); "
                    "use %s-file PATH or $%s", name, name, env)
    key = _read(value, where) if where.endswith("-file") else value.strip()
    if not key:
        raise ValueError(f"{where} is empty: give the key (or leave {where} out to run without one)")
    if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        raise ValueError(f"the key from {where} must be printable ASCII without spaces or line breaks (it travels "
                         "in an `Authorization: Bearer <key>` header)")
    return key


def _read(path: str, where: str) -> str:
    try:
        mode = os.stat(path).st_mode
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where} {path}: cannot read the key from it ({exc})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s %s can be read by other users of this machine (mode %o): chmod 600 %s", where, path,
                    stat.S_IMODE(mode), path)
    return text.strip()  # the line break an editor or `echo` leaves is not part of the key


def auth_middleware(api_key: str, open_paths: Collection[str]):
    """Every path but ``open_paths`` needs ``Authorization: Bearer <api_key>`` (the scheme in any case)."""
    expected = api_key.encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path not in open_paths:
            scheme, _, given = request.headers.get(hdrs.AUTHORIZATION, "").partition(" ")
            ok = scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected)
            if not ok:
                raise APIError(401, "missing or wrong API key: send `Authorization: Bearer <key>`",
                               type="invalid_request_error", code="invalid_api_key")
        return await handler(request)

    return check


def exposure_warnings(host: str, api_key: str | None, hosts: AllowedHosts) -> list[str]:
    """What a server started this way should tell its operator: reachable by others, or by web pages, keyless."""
    if api_key is not None:
        return []
    warnings = []
    if not is_loopback(host):
        warnings.append(f"listening on {host} without an API key: anyone who can reach this port can run the "
                        f"model, switch policies and flush the cache. Set --api-key-file or ${ENV} (or listen on "
                        "--host 127.0.0.1)")
    if hosts.any:
        warnings.append("--allowed-hosts '*' without an API key: a web page you visit can drive this server by "
                        "DNS rebinding. Set a key, or list the server's names instead of '*'")
    return warnings
