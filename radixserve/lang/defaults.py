"""The default backend (``sgl.set_default_backend``) and how a run picks its backend and chat template.

The default backend is the one piece of module-level mutable state in the package: SGLang's API has users set it
once at the top of a script, so programs can be run without passing ``backend=`` every time.
"""
from __future__ import annotations

import threading
from typing import Any

from radixserve.lang.backend import Backend
from radixserve.role_markers import ChatTemplate


class _DefaultBackend:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.backend: Backend | None = None

    def set(self, backend: Any) -> None:
        with self._lock:
            self.backend = None if backend is None else as_backend(backend)


DEFAULT = _DefaultBackend()


def as_backend(obj: Any) -> Backend:
    """A Backend as is; an in-process ``radixserve.Engine`` wrapped in EngineBackend."""
    if callable(getattr(obj, "sglang_generate", None)):
        from radixserve.lang.engine_backend import EngineBackend

        return EngineBackend(obj)
    for method in ("model_info", "generate"):  # generate_stream is needed only by stream=True runs
        if not callable(getattr(obj, method, None)):
            raise TypeError(f"{type(obj).__name__} is not a backend: it has no {method}(); use "
                            "RuntimeEndpoint(url) for a server or EngineBackend(engine) for an in-process Engine")
    return obj


def resolve_backend(backend: Any | None) -> Backend:
    if backend is not None:
        return as_backend(backend)
    if DEFAULT.backend is None:
        raise ValueError("no backend to run on: pass backend=RuntimeEndpoint('http://localhost:30000') or call "
                         "sgl.set_default_backend(...) first")
    return DEFAULT.backend


def resolve_template(backend: Backend) -> ChatTemplate:
    """The backend's own template if it has one, else what the server describes, else the plain "default"."""
    own = getattr(backend, "chat_template", None)
    if isinstance(own, ChatTemplate):
        return own
    described = backend.model_info().get("chat_template")
    return ChatTemplate.from_dict(described) if described else ChatTemplate.by_name("default")
