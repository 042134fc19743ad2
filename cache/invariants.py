"""Invariant checks that stay on under ``python -O`` (an ``assert`` would vanish): a broken invariant raises
InvariantError naming what broke."""
from __future__ import annotations

from collections.abc import Callable


class InvariantError(RuntimeError):
    """KV slot accounting or tree integrity is broken: a bug of ours, never the client's."""


def require(condition: object, message: str | Callable[[], str]) -> None:
    """Raise InvariantError(message) unless ``condition``; a callable message is built only on failure."""
    if not condition:
        raise InvariantError(message() if callable(message) else message)
