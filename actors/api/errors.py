"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for every client
mistake (429/503 with ``Retry-After`` when the server is busy or draining), and a middleware that makes sure
nothing else ever reaches the client -- and counts every refusal for /metrics."""
from __future__ import annotations

import logging
import re

import msgspec
from aiohttp import web

from radixserve.errors import InvalidRequest

log = logging.getLogger(__name__)

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
         421: "invalid_request_error",
         429: "rate_limit_error", 503: "service_unavailable"}
# SGLang's field names (what the scheduler reports) as the OpenAI routes call them
OPENAI_PARAMS = {"max_new_tokens": "max_tokens"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, retry_after: int | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.retry_after = retry_after
        self.close = close  # end the connection after this answer (the client holds one too many)

    @property
    def reason(self) -> str:
        """The label /metrics counts it under."""
        return self.code or self.type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        response = web.json_response(self.body(), status=self.status, headers=headers)
        if self.close:
            response.force_close()
        return response


def from_validation(exc: msgspec.ValidationError | ValueError) -> APIError:
    """msgspec says e.g. "Expected `int`, got `str` - at `$.messages[0].content`": keep the words, name the param."""
    text = str(exc)
    match = re.search(r" - at `\$\.?(.*)`$", text)
    param = match.group(1) if match else None
    cause = exc.__cause__
    if isinstance(cause, InvalidRequest):  # a range check inside a nested struct: "sampling_params.top_k"
        return APIError(400, str(cause), param=".".join(p for p in (param, cause.param) if p) or None)
    if match:
        text = text[: match.start()]
    field = re.search(r"`([^`]+)`", text)
    if field and ("unknown field" in text or "missing required field" in text):  # the field, under its object
        param = ".".join(p for p in (param, field.group(1)) if p)
    text = text.replace("Object contains unknown field", "unrecognized request argument")
    text = text.replace("Object missing required field", "missing required argument")
    return APIError(400, f"{text}" + (f" (at {param})" if param else ""), param=param)


def from_invalid(exc: InvalidRequest) -> APIError:
    return APIError(400, str(exc), param=exc.param)


def error_middleware(metrics=None):
    @web.middleware
    async def handle(request: web.Request, handler):
        try:
            return await handler(request)
        except APIError as exc:
            return _refuse(request, exc, metrics)
        except InvalidRequest as exc:
            return _refuse(request, from_invalid(exc), metrics)
        except web.HTTPRequestEntityTooLarge as exc:  # its text names the limit and the size
            return _refuse(request, APIError(413, f"request body too large: {exc.text}", code="request_too_large"),
                           metrics)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = {404: f"no route {request.method} {request.path}",
                       405: f"method {request.method} is not allowed on {request.path}"}.get(exc.status, exc.reason)
            return _refuse(request, APIError(exc.status, message), metrics)
        except (ConnectionResetError, ConnectionError):
            raise
        except Exception:  # a bug of ours: say so, keep serving
            log.exception("internal error on %s %s", request.method, request.path)
            return _refuse(request, APIError(500, "internal server error (logged)", type="server_error",
                                             code="internal_error"), metrics)

    return handle


def _refuse(request: web.Request, exc: APIError, metrics) -> web.Response:
    if request.path.startswith("/v1/") and exc.param in OPENAI_PARAMS:
        exc.param = OPENAI_PARAMS[exc.param]
    if metrics is not None:
        metrics.rejected(exc.reason)
    return exc.response()
