"""The one error type for a request the client got wrong, shared by the offline Engine and every actor; the one
way an error suggests the name that was meant."""
from __future__ import annotations


class InvalidRequest(ValueError):
    """A request that can never run as given: the message says what was wrong and what to do; ``param`` names
    the request field (SGLang's names: ``max_new_tokens``, ``top_k``, ``prompt``...)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def did_you_mean(word: str, choices, quote: bool = True) -> str:
    """``"; did you mean 'lru'?"`` for the closest of ``choices`` to a mistyped ``word``, else ``""``: every "unknown
    name" message ends the same way (``quote=False`` for flags: ``did you mean --port?``)."""
    import difflib

    close = difflib.get_close_matches(word, [str(c) for c in choices], n=1)
    if not close:
        return ""
    return f"; did you mean {close[0]!r}?" if quote else f"; did you mean {close[0]}?"
