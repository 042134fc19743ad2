"""EngineBackend: run programs against an in-process ``radixserve.Engine`` (no server, same payloads).

The engine object is passed in, never imported here, so importing the frontend does not pull in torch.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from radixserve.lang.backend import BackendError, raise_if_failed
from radixserve.role_markers import ChatTemplate


class EngineBackend:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._model_info: dict[str, Any] = self._call(engine.model_info)
        described = self._model_info.get("chat_template")
        self.chat_template = ChatTemplate.from_dict(described) if described else ChatTemplate.by_name("default")

    def model_info(self) -> dict[str, Any]:
        return dict(self._model_info)

    def generate(self, payload: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        out = self._call(self.engine.sglang_generate, {**payload, "stream": False})
        for result in out if isinstance(out, list) else [out]:
            raise_if_failed(result)
        return out

    def generate_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        events = self._call(self.engine.sglang_generate_stream, {**payload, "stream": True})
        try:
            for event in events:
                raise_if_failed(event)
                yield event
        except BackendError:
            raise
        except Exception as exc:
            raise _as_backend_error(exc) from exc

    def flush_cache(self) -> None:
        self._call(self.engine.flush_cache)

    def server_info(self) -> dict[str, Any]:
        return {**self._model_info, "cache_stats": self._call(self.engine.cache_stats)}

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except BackendError:
            raise
        except Exception as exc:
            raise _as_backend_error(exc) from exc


def _as_backend_error(exc: Exception) -> BackendError:
    # the Engine raises InvalidRequest (a ValueError naming the field) for requests it refuses: a server's 400
    status = 400 if isinstance(exc, ValueError) else 500
    return BackendError(f"{type(exc).__name__}: {exc}", status=status, code=type(exc).__name__,
                        param=getattr(exc, "param", None))
