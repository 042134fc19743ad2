"""The one error type for a request the client got wrong, shared by the offline Engine and every actor."""
from __future__ import annotations


class InvalidRequest(ValueError):
    """A request that can never run as given: the message says what was wrong and what to do; ``param`` names
    the request field (SGLang's names: ``max_new_tokens``, ``top_k``, ``prompt``...)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
