"""Executor: runs one program state's expressions in order, on a worker thread of its own.

``s += expr`` only queues; the worker calls the model, so a program's forks (each with its own executor) run
concurrently. The worker thread exists only while there is queued work: it exits when the queue drains and the
next ``submit`` starts a fresh one, so no thread outlives the work it was started for.

Readers (``s["x"]``, ``text()``, ``text_iter``) wait on one condition variable; every change to the text or the
variables, and the end of the program, notifies it. A failure stops the queue, records the error and wakes every
reader, which then re-raise it instead of waiting for a value that will never come.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.lang.backend import Backend
from radixserve.lang.choices import select_choice
from radixserve.lang.ir import (
    Expr,
    Gen,
    RoleBegin,
    RoleEnd,
    Select,
    Text,
    leaves,
    variable_names,
)
from radixserve.lang.sampling import SamplingDefaults, build_payload, prefill_payload
from radixserve.lang.transcript import Transcript
from radixserve.role_markers import ChatTemplate


@dataclass(frozen=True, slots=True)
class RunContext:
    """What every state of one run shares (forks included)."""

    backend: Backend
    template: ChatTemplate
    defaults: SamplingDefaults
    stream: bool = False


class Executor:
    def __init__(self, ctx: RunContext, transcript: Transcript | None = None,
                 variables: dict[str, Any] | None = None, program_thread: int | None = None) -> None:
        self.ctx = ctx
        self.transcript = transcript or Transcript(ctx.template)
        self.variables: dict[str, Any] = dict(variables or {})
        self.meta_info: dict[str, Any] = {}
        self.partial: dict[str, str] = {}  # streamed gens' text so far; moved to variables once complete
        self.error: BaseException | None = None
        self.program_thread = program_thread  # the thread running the program function: it never waits on itself
        self.children: list[Executor] = []
        self.cond = threading.Condition()
        self._queue: deque[Expr] = deque()
        self._pending: set[str] = set()  # variables queued but not set yet
        self._busy = 0  # expressions queued or running
        self._ended = False  # the program will submit nothing more
        self._worker_alive = False

    # ---- the program side -------------------------------------------------------------------------------------
    def submit(self, expr: Expr) -> None:
        with self.cond:
            if self.error is not None:
                return  # the program already failed; readers will raise that error
            self._pending.update(variable_names(expr))
            self._queue.append(expr)
            self._busy += 1
            if not self._worker_alive:
                self._worker_alive = True
                threading.Thread(target=self._work, name="radixserve-lang-executor", daemon=True).start()

    def end(self) -> None:
        """The program function returned (or a fork was joined): wake readers that wait for the end."""
        for child in self.children:
            child.end()
        with self.cond:
            self._ended = True
            self.cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = exc
            self._queue.clear()
            self._pending.clear()
            self._busy = 0
            self.cond.notify_all()

    def spawn(self) -> Executor:
        """A fork: a copy of this state's text, turns and variables with its own queue and worker."""
        with self.cond:
            child = Executor(self.ctx, self.transcript.copy(), self.variables, self.program_thread)
            self.children.append(child)
        return child

    def prefill(self) -> None:
        """Cache the current text's KV on the server (prefill only), so forks share it instead of each computing it."""
        self.ctx.backend.generate(prefill_payload(self.text_now()))

    # ---- the reader side --------------------------------------------------------------------------------------
    def wait(self, done: Callable[[], bool], timeout: float | None = None) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: done() or self.error is not None, timeout)

    def settle(self) -> None:
        """Wait until the state stops changing: its queue drained and, seen from outside a streaming program,
        the program ended. The program itself only waits for its queue (it cannot wait for its own end)."""
        outside = self.ctx.stream and threading.get_ident() != self.program_thread
        self.wait(lambda: self._busy == 0 and (self._ended or not outside))

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def get_var(self, name: str) -> Any:
        self._wait_var(name)
        return self.variables[name]

    def get_meta(self, name: str) -> Any:
        self._wait_var(name)
        return self.meta_info.get(name)

    def _wait_var(self, name: str) -> None:
        """Wait until ``name`` is set (queued gens and selects included); raise the error that stopped it."""
        # in stream mode the program runs in the background and may not have queued the gen yet
        others_may_submit = self.ctx.stream and threading.get_ident() != self.program_thread
        self.wait(lambda: name not in self._pending and (
            name in self.variables or not others_may_submit or self.finished))
        with self.cond:
            if name in self.variables:
                return
        self.raise_error()
        raise KeyError(f"the program set no variable {name!r}; it has {sorted(self.variables)}")

    @property
    def finished(self) -> bool:
        """No more text will come: the program ended and its queue drained (or it failed)."""
        return (self._ended and self._busy == 0) or self.error is not None

    def is_pending(self, name: str) -> bool:
        return name in self._pending

    def var_so_far(self, name: str) -> str:
        value = self.variables.get(name, self.partial.get(name, ""))
        return value if isinstance(value, str) else ""

    def text_now(self) -> str:
        with self.cond:
            return self.transcript.text

    def set_variable(self, name: str, value: Any) -> None:
        with self.cond:
            self.variables[name] = value
            self.cond.notify_all()

    # ---- the worker -------------------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self.cond:
                if not self._queue:
                    self._worker_alive = False
                    return
                expr = self._queue.popleft()
            try:
                for leaf in leaves(expr):
                    self._execute(leaf)
            except BaseException as exc:  # noqa: BLE001  (recorded and re-raised to every reader)
                self.fail(exc)
                continue
            with self.cond:
                if self.error is None:  # fail() already zeroed the count (the program raised meanwhile)
                    self._busy -= 1
                self.cond.notify_all()

    def _execute(self, e: Expr) -> None:
        if isinstance(e, Text):
            self._change(lambda: self.transcript.fill(e.value))
        elif isinstance(e, RoleBegin):
            self._change(lambda: self.transcript.begin(e.role))
        elif isinstance(e, RoleEnd):
            self._change(lambda: self.transcript.end(e.role))
        elif isinstance(e, Gen):
            self._gen(e)
        elif isinstance(e, Select):
            choice, meta = select_choice(self.ctx.backend, self.text_now(), e.choices, e.method)
            self._set_result(e.name, choice, choice, meta)
        else:
            raise TypeError(f"cannot run expression {e!r}")

    def _change(self, edit: Callable[[], None]) -> None:
        with self.cond:
            edit()
            self.cond.notify_all()

    def _set_result(self, name: str | None, value: Any, appended: str, meta: Any) -> None:
        with self.cond:
            self.transcript.fill(appended)
            if name is not None:
                self.variables[name] = value
                self.meta_info[name] = meta
                self.partial.pop(name, None)
                self._pending.discard(name)
            self.cond.notify_all()

    def _gen(self, e: Gen) -> None:
        stops = self.ctx.template.stop_str if self.transcript.in_assistant else ()
        stream = self.ctx.stream and (e.params.n or 1) == 1
        payload = build_payload(self.text_now(), self.ctx.defaults, e.params, stops, stream=stream)
        if not stream:
            out = self.ctx.backend.generate(payload)
            if isinstance(out, list):  # n > 1: the variable holds every sample, the text continues with the first
                self._set_result(e.name, [o["text"] for o in out], out[0]["text"], [o["meta_info"] for o in out])
            else:
                self._set_result(e.name, out["text"], out["text"], out["meta_info"])
            return
        so_far, meta = "", None
        for event in self.ctx.backend.generate_stream(payload):
            piece, so_far, meta = event["text"][len(so_far):], event["text"], event.get("meta_info")
            with self.cond:  # the text and the variable grow together, so a reader never sees one ahead
                self.transcript.fill(piece)
                if e.name is not None:
                    self.partial[e.name] = so_far
                self.cond.notify_all()
        self._set_result(e.name, so_far, "", meta)
