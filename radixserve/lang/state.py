"""ProgramState (the ``s`` a program receives) and StateGroup (what ``s.fork(n)`` returns).

Appending is asynchronous (the state's executor runs it); reading waits for what it needs and re-raises the error
that stopped the program, so nothing blocks forever on a variable a failed call will never set.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from radixserve.lang.executor import Executor
from radixserve.lang.roles import Roles
from radixserve.lang.ir import Expr, as_expr


class ProgramState(Roles):
    def __init__(self, executor: Executor) -> None:
        self._ex = executor

    # ---- building the prompt -------------------------------------------------------------------------------
    def __iadd__(self, other: Expr | str) -> ProgramState:
        if other is None:
            raise ValueError("tried to append None to the state; did a helper forget to return its expression?")
        self._ex.submit(as_expr(other))
        return self

    def fork(self, n: int = 1) -> StateGroup:
        """``n`` copies of this state that continue independently (and concurrently).

        With n > 1 the text so far is first prefilled once (max_new_tokens=0), so the radix cache holds the shared
        prefix and every fork reuses it instead of computing it again.
        """
        if int(n) < 1:
            raise ValueError(f"fork(n) needs n >= 1, got {n}")
        self._ex.settle()
        self._ex.raise_error()
        if int(n) > 1 and self._ex.text_now():
            self._ex.prefill()
        return StateGroup([ProgramState(self._ex.spawn()) for _ in range(int(n))], self)

    # ---- reading -------------------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        return self._ex.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self._ex.set_variable(name, value)

    def __contains__(self, name: str) -> bool:
        return name in self._ex.variables

    def get_var(self, name: str) -> Any:
        return self._ex.get_var(name)

    def get_meta_info(self, name: str) -> Any:
        return self._ex.get_meta(name)

    def text(self) -> str:
        """The whole text once the state settles; raises the error that stopped the program, if any."""
        self._ex.settle()
        self._ex.raise_error()
        return self._ex.text_now()

    def messages(self) -> list[dict[str, str]]:
        """The chat turns so far in OpenAI format; raises like ``text()``."""
        self._ex.settle()
        self._ex.raise_error()
        with self._ex.cond:
            return [dict(m) for m in self._ex.transcript.messages]

    def sync(self) -> None:
        """Wait until everything appended so far has run (errors are left to ``error()`` and the readers)."""
        self._ex.settle()

    def error(self) -> BaseException | None:
        """The exception that stopped the program (a BackendError, or one the program raised), or None."""
        self._ex.settle()
        return self._ex.error

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """With ``run(stream=True)``: the text (or one variable) piece by piece as it arrives; the pieces
        concatenate to the final value. Without streaming: the final value, once."""
        ex = self._ex
        if not ex.ctx.stream:
            yield self.text() if var_name is None else str(self[var_name])
            return

        def current() -> str:
            return ex.transcript.text if var_name is None else ex.var_so_far(var_name)

        def complete() -> bool:  # no more text will come for what we iterate
            if var_name is None or ex.is_pending(var_name):
                return ex.finished
            return var_name in ex.variables or ex.finished

        pos = 0
        while True:
            with ex.cond:
                ex.cond.wait_for(lambda seen=pos: len(current()) > seen or complete())
                piece = current()[pos:]
                pos += len(piece)
                over = complete() and len(current()) == pos
            if piece:
                yield piece
            if over:
                break
        ex.raise_error()

    def __repr__(self) -> str:
        return f"ProgramState({self._ex.text_now()!r})"


class StateGroup:
    """The states of one fork; ``join()`` copies their new variables back to the parent as lists."""

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        self.states = states
        self.parent = parent
        self._known = set(parent._ex.variables)  # variables that existed before the fork

    def __iadd__(self, other: Expr | str | list[Expr | str] | Callable[[int], Expr | str]) -> StateGroup:
        """One expression for every fork, a list with one per fork, or a function of the fork's index."""
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"got {len(other)} expressions for {len(self.states)} forks; give one per fork")
            for state, expr in zip(self.states, other):
                state += expr
        elif callable(other) and not isinstance(other, Expr):
            for i, state in enumerate(self.states):
                state += other(i)
        else:
            for state in self.states:
                state += other
        return self

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def join(self) -> None:
        """Wait for every fork, then set each variable they created in the parent to the list of their values."""
        gathered: dict[str, list[Any]] = {}
        for state in self.states:
            state._ex.settle()
            state._ex.raise_error()  # a fork's failure surfaces here, in the program
            for name, value in state._ex.variables.items():
                if name not in self._known:
                    gathered.setdefault(name, []).append(value)
            state._ex.end()
        for name, values in gathered.items():
            self.parent._ex.set_variable(name, values)
