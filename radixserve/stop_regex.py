"""``stop_regex``: a request's output is cut before the earliest match of its patterns, found in linear time.

The patterns run on RE2 (``google-re2``, Google's own binding): an automaton, so no pattern backtracks -- Python's
``re`` spent minutes on ``(a+)+b`` against a run of ``a``s while the one tokenizer process held every stream. RE2's
syntax is Perl's without backreferences and lookaround (refused here, naming ``stop_regex``); ``\\d \\w \\s \\b``
are ASCII, and ``$`` is the end of the text (Python's also matches before a final newline).

Each check looks only where a new match can be, and charges its CPU time to the request: past ``CPU_BUDGET_S``
the request fails alone (``InvalidRequest`` naming ``stop_regex``), the other streams keep their pace.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from radixserve.errors import InvalidRequest

WINDOW = 64  # characters one check covers; a longer addition is checked in pieces of this many (as if several tokens)
MAX_MEM = 2 << 20  # bytes RE2 may hold per compiled pattern (program and automaton cache): a larger one is refused
CPU_BUDGET_S = 1.0  # CPU seconds one request's matching may take in all (a check costs a few microseconds)


def _options():
    import re2  # lazily: only requests with stop_regex pay the import

    opts = re2.Options()
    opts.never_capture = True  # only where a match starts is asked for: no submatch pass after the automaton
    opts.log_errors = False  # a refused pattern is the client's error, said in the 400, not a line in our log
    opts.max_mem = MAX_MEM
    return opts


def _compile(source: str, what: str):
    """RE2's compiled ``source``; InvalidRequest naming stop_regex if RE2 refuses it (``what`` says which)."""
    import re2

    try:
        compiled = re2.compile(source, _options())
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise _refused(what, reason) from None
    if compiled.reverseprogramsize < 0:  # the backward automaton each check runs would not fit in MAX_MEM
        raise _refused(what, "pattern too large")
    return compiled


def _refused(what: str, reason: str) -> InvalidRequest:
    hint = (f"RE2 gives a pattern {MAX_MEM >> 20} MiB: fewer or shorter repetitions" if "too large" in reason
            else "RE2 has no backreferences, lookahead or lookbehind")
    return InvalidRequest(f"sampling parameter stop_regex: {what} is not a regular expression RE2 can run: {reason} "
                          f"({hint})", param="stop_regex")


def _windowed(sources: list[str]) -> str:
    """One pattern matching where any of ``sources`` matches and ends at most WINDOW characters before the text's
    end (RE2 runs it backward from the end: see ``StopRegexes``)."""
    union = "|".join(f"(?:{s})" for s in sources)
    return f"(?:{union})(?s:.{{0,{WINDOW}}})\\z"


def check(sources: list[str]) -> None:
    """InvalidRequest naming stop_regex if a pattern is not RE2 syntax, or they are too large together."""
    for s in sources:
        _compile(s, f"the pattern {_short(s)}")
        try:
            _compile(_windowed([s]), f"the pattern {_short(s)}")
        except InvalidRequest:
            if "\\Q" not in s:
                raise
            # valid alone, broken once wrapped: a \Q that runs to the pattern's end takes the wrapping in as text
            raise InvalidRequest(f"sampling parameter stop_regex: the pattern {_short(s)} ends inside \\Q...; close "
                                 "it with \\E", param="stop_regex") from None
    if len(sources) > 1:
        _compile(_windowed(sources), f"the {len(sources)} patterns together")


def _short(source: str) -> str:
    text = repr(source)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(eq=False)
class StopRegexes:
    """One request's stop_regex patterns against its output as it grows: the earliest match, looked for only where
    a new one can be.

    A new match ends in the text added since the last check, or right at its old end (where a ``\\b`` or ``$`` now
    sees the character after it); anything ending further back was checked, with the same characters around it,
    and did not match. It may start anywhere from the floor (the text written before min_new_tokens is never
    cut). So a check runs the ``_windowed`` pattern backward from the end, anchored there, and takes the longest
    reverse match: the earliest start of a match that ends in the window::

        0 ......... floor ..................... seen ........ end     the text (UTF-8 in ``_buf``)
                    [ a match starts here or later .............)
                                     [ window: WINDOW chars ....]     a match ends in here
                                                [ new text .....]     longer additions go in pieces
                                              the automaton runs from end backward <-

    The same earliest start as Python's ``re.search(text, floor)`` would give on the whole text, for RE2's
    syntax. An empty match counts: a pattern that matches the empty string cuts at the floor on the first check.
    A check costs the window plus the stretch a match could still span (the automaton stops where no match can
    start further back): microseconds for ``\\n\\n``, the whole text for ``x.*a`` against ``a``s -- linear per
    check but quadratic per request, which is what the CPU budget is for.
    """

    sources: list[str]
    budget_s: float = CPU_BUDGET_S
    _union: object = field(init=False, default=None)  # re2's compiled ``_windowed(sources)``
    _buf: bytearray = field(init=False, default_factory=bytearray)  # the text checked so far, UTF-8
    _chars: int = field(init=False, default=0)  # characters in _buf
    _floor: tuple[int, int] | None = field(init=False, default=None)  # (chars, bytes); None: never checked
    _spent_ns: int = field(init=False, default=0)  # thread CPU time of all checks

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("StopRegexes needs at least one pattern")
        self._union = _compile(_windowed(self.sources), "the patterns")

    def search(self, text: str, floor: int) -> tuple[int, str] | None:
        """``text`` is the whole output so far (it only grows between calls); ``floor`` where a match may start
        (fixed from the first call on). Returns (where the earliest match starts, its pattern) or None.
        InvalidRequest naming stop_regex once the request's matching has used up its CPU budget."""
        started = time.thread_time_ns()
        hit = self._search(text, floor)
        self._spent_ns += time.thread_time_ns() - started
        if hit is None and self._spent_ns > self.budget_s * 1e9:  # a match ends the request anyway
            raise InvalidRequest(
                f"sampling parameter stop_regex: matching {_short(' | '.join(self.sources))} took more than this "
                f"request's {self.budget_s:g} s CPU budget (over {len(text)} characters of output); use patterns "
                "whose matches span less text", param="stop_regex")
        return hit

    def _search(self, text: str, floor: int) -> tuple[int, str] | None:
        first = self._floor is None
        if first:
            self._append(text[:floor])
            self._floor = (floor, len(self._buf))
        elif floor != self._floor[0]:
            raise ValueError(f"the floor moved from {self._floor[0]} to {floor} after matching began")
        if len(text) < self._chars:
            raise ValueError(f"the text shrank from {self._chars} to {len(text)} characters")
        new = text[self._chars :]
        if first and not new:  # nothing after the floor yet: only an empty match there can be found
            return self._check()
        for i in range(0, len(new), WINDOW):
            self._append(new[i : i + WINDOW])
            if (hit := self._check()) is not None:
                return hit
        return None

    def _append(self, piece: str) -> None:
        self._buf += piece.encode("utf-8", "surrogatepass")
        self._chars += len(piece)

    def _check(self) -> tuple[int, str] | None:
        floor_b = self._floor[1]
        m = self._union.search(self._buf, floor_b)
        if m is None:
            return None
        start_b = m.start()
        if len(self.sources) == 1:
            source = self.sources[0]
        else:  # once per request: which pattern starts there (the first by name on a tie, as for stop strings)
            starts = [(m1.start(), s) for s in self.sources
                      if (m1 := _compile(_windowed([s]), s).search(self._buf, floor_b)) is not None]
            start_b, source = min(starts)
        start = len(bytes(self._buf[:start_b]).decode("utf-8", "surrogatepass"))
        return start, source
