"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for every client
mistake, and a middleware that makes sure nothing else ever reaches the client."""
from __future__ import annotations

import logging
import re

import msgspec
from aiohttp import web

log = logging.getLogger(__name__)

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


def from_validation(exc: msgspec.ValidationError | ValueError) -> APIError:
    """msgspec says e.g. "Expected `int`, got `str` - at `$.messages[0].content`": keep the words, name the param."""
    text = str(exc)
    match = re.search(r" - at `\$\.?(.*)`$", text)
    param = match.group(1) if match else None
    if match:
        text = text[: match.start()]
    field = re.search(r"`(\w+)`", text)
    if param is None and field and ("unknown field" in text or "missing required field" in text):
        param = field.group(1)
    text = text.replace("Object contains unknown field", "unrecognized request argument")
    text = text.replace("Object missing required field", "missing required argument")
    return APIError(400, f"{text}" + (f" (at {param})" if param else ""), param=param)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as exc:
        return exc.response()
    except web.HTTPRequestEntityTooLarge as exc:  # its text names the limit and the size
        return APIError(413, f"request body too large: {exc.text}", code="request_too_large").response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = {404: f"no route {request.method} {request.path}",
                   405: f"method {request.method} is not allowed on {request.path}"}.get(exc.status, exc.reason)
        return APIError(exc.status, message).response()
    except (ConnectionResetError, ConnectionError):
        raise
    except Exception:  # a bug of ours: say so, keep serving
        log.exception("internal error on %s %s", request.method, request.path)
        return APIError(500, "internal server error (logged)", type="server_error").response()
