"""RuntimeEndpoint: the Backend for a running radixserve (or SGLang) server, over plain HTTP.

Standard library only. Every request opens its own connection (urllib does not share them), so any number of
threads (run_batch runs 64) can call one endpoint at once without locking.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from radixserve.lang.backend import BackendError, raise_if_failed
from radixserve.role_markers import ChatTemplate


class RuntimeEndpoint:
    def __init__(self, base_url: str, api_key: str | None = None, chat_template_name: str | None = None,
                 timeout: float | None = None) -> None:
        """Connects at once (GET /get_model_info) so a wrong URL fails here, not in the middle of a program.

        The chat template is ``chat_template_name``'s built-in if given, else the one the server derived from its
        model's tokenizer, else the plain "default".
        """
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self._model_info: dict[str, Any] = self._request("GET", "/get_model_info")
        if chat_template_name:
            self.chat_template = ChatTemplate.by_name(chat_template_name)
        else:
            described = self._model_info.get("chat_template")
            self.chat_template = ChatTemplate.from_dict(described) if described else ChatTemplate.by_name("default")

    def model_info(self) -> dict[str, Any]:
        return dict(self._model_info)

    def generate(self, payload: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        out = self._request("POST", "/generate", {**payload, "stream": False})
        for result in out if isinstance(out, list) else [out]:
            raise_if_failed(result)
        return out

    def generate_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Server-sent events: ``data: {...}`` lines until ``data: [DONE]``."""
        with self._open("POST", "/generate", {**payload, "stream": True}) as resp:
            for raw in resp:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if isinstance(event, dict) and "error" in event:
                    raise _error_from_body(event, status=None)
                raise_if_failed(event)
                yield event

    def flush_cache(self) -> None:
        self._request("POST", "/flush_cache")

    def server_info(self) -> dict[str, Any]:
        return self._request("GET", "/get_server_info")

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.base_url!r})"

    # ---- HTTP ---------------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        with self._open(method, path, body) as resp:
            raw = resp.read()
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise BackendError(f"{method} {path} answered with something that is not JSON: {raw[:200]!r}",
                               status=resp.status) from None

    def _open(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            with exc:
                raise _error_from_response(exc.code, exc.read()) from None
        except urllib.error.URLError as exc:
            raise BackendError(f"cannot reach {self.base_url}{path}: {exc.reason}; is the server running at "
                               f"{self.base_url}?") from None
        except TimeoutError:
            raise BackendError(f"{method} {path} got no answer within {self.timeout} s") from None


def _error_from_response(status: int, raw: bytes) -> BackendError:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        text = raw.decode("utf-8", "replace").strip() or "(empty body)"
        return BackendError(text[:500], status=status)
    return _error_from_body(body, status)


def _error_from_body(body: Any, status: int | None) -> BackendError:
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return BackendError(str(err.get("message", err)), status=status, code=err.get("code") or err.get("type"),
                            param=err.get("param"))
    if err is not None:
        return BackendError(str(err), status=status)
    return BackendError(json.dumps(body)[:500], status=status)
