"""The contract between the frontend language and whatever serves the model (an HTTP server or an Engine).

Every payload is SGLang's native ``POST /generate`` body, so the same program runs against either backend and a
recorded payload can be replayed with curl.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable


class BackendError(RuntimeError):
    """A request the backend refused or could not serve.

    ``status`` is the HTTP status (None when there was no response at all, e.g. the server is down); ``code`` and
    ``param`` come from the server's ``{"error": {...}}`` body and name what was wrong ("regex", "max_new_tokens").
    """

    def __init__(self, message: str, status: int | None = None, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.param = param

    def __str__(self) -> str:
        where = f" (param: {self.param})" if self.param else ""
        status = f"HTTP {self.status}: " if self.status is not None else ""
        return f"{status}{self.message}{where}"


def raise_if_failed(result: Any) -> None:
    """A result that reports a failure in ``meta_info.error`` (how an Engine, or a server mid-stream, says a
    request died after it started) becomes a BackendError."""
    err = (result.get("meta_info") or {}).get("error") if isinstance(result, dict) else None
    if not err:
        return
    if not isinstance(err, dict):
        raise BackendError(str(err))
    raise BackendError(str(err.get("message", err)), status=err.get("status"), code=err.get("code"),
                       param=err.get("param"))


@runtime_checkable
class Backend(Protocol):
    """What the interpreter needs from a model server. Methods may be called from many threads at once.

    Nothing here mutates frontend state; every method either returns or raises ``BackendError``.
    """

    def model_info(self) -> dict[str, Any]:
        """``{"model_path": str, "is_generation": bool, "chat_template": ChatTemplate.to_dict() | None}``."""
        ...

    def generate(self, payload: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        """Run one native ``/generate`` body to completion: a dict for ``text: str``, a list for ``text: list``.

        ``sampling_params.max_new_tokens == 0`` is prefill only: the prompt's KV lands in the radix cache and the
        answer's ``meta_info`` reports ``prompt_tokens`` and ``cached_tokens`` (how much was already shared).
        """
        ...

    def generate_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The same body with ``stream: true``; yields events whose ``text`` is cumulative (not a delta)."""
        ...

    def flush_cache(self) -> None:
        """Drop every unused cached prefix on the server."""
        ...

    def server_info(self) -> dict[str, Any]:
        """Whatever the server reports about itself (cache stats, limits)."""
        ...
