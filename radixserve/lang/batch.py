"""run_batch: prefill the batch's shared prompt prefix once, then run every member concurrently.

The shared prefix is found without calling the model: each member's program runs against a ProbeState, which
builds the constant text exactly as a real state would (same Transcript, same role markers) and stops at the
first thing that needs the model. The longest common prefix of those texts is sent once with max_new_tokens=0;
the members that follow find it in the radix cache.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from radixserve.lang.executor import RunContext
from radixserve.lang.ir import (
    Expr,
    Gen,
    RoleBegin,
    RoleEnd,
    Select,
    Text,
    as_expr,
    leaves,
)
from radixserve.lang.roles import Roles
from radixserve.lang.sampling import prefill_payload
from radixserve.lang.state import ProgramState
from radixserve.lang.transcript import Transcript

if TYPE_CHECKING:
    from radixserve.lang.function import Function

MAX_AUTO_THREADS = 64


class _ModelCall(BaseException):
    """The probe reached a model call; a BaseException so a program's ``except Exception`` cannot swallow it."""


class ProbeState(Roles):
    """Stands in for ProgramState while probing: records constant text, stops at gen/select/fork/reads."""

    def __init__(self, transcript: Transcript) -> None:
        self.transcript = transcript

    def __iadd__(self, other: Expr | str) -> ProbeState:
        for e in leaves(as_expr(other)):
            if isinstance(e, Text):
                self.transcript.fill(e.value)
            elif isinstance(e, RoleBegin):
                self.transcript.begin(e.role)
            elif isinstance(e, RoleEnd):
                self.transcript.end(e.role)
            elif isinstance(e, (Gen, Select)):
                raise _ModelCall()
        return self

    def text(self) -> str:
        return self.transcript.text

    def __getattr__(self, name: str) -> Any:
        raise _ModelCall()  # fork, reading a variable, anything else: the constant part ends here

    def __getitem__(self, name: str) -> Any:
        raise _ModelCall()


def probe_prefix(program: Function, kwargs: dict[str, Any], ctx: RunContext) -> str:
    """The text ``program`` builds before its first model call ("" if the program fails before one)."""
    probe = ProbeState(Transcript(ctx.template))
    try:
        program.func(probe, **{**program.bound, **kwargs})
    except _ModelCall:
        pass
    except Exception:  # noqa: BLE001  (the real run reports the error; the probe only loses its prefix)
        return ""
    return probe.transcript.text


def common_prefix(texts: list[str]) -> str:
    if not texts:
        return ""
    return os.path.commonprefix(texts)


def run_batch(program: Function, batch: list[dict[str, Any]], ctx: RunContext, num_threads: int | str,
              progress_bar: bool) -> list[ProgramState]:
    if not batch:
        return []
    workers = min(len(batch), MAX_AUTO_THREADS) if num_threads == "auto" else int(num_threads)
    if workers < 1:
        raise ValueError(f"num_threads must be 'auto' or >= 1, got {num_threads!r}")
    if len(batch) > 1:
        shared = common_prefix([probe_prefix(program, kw, ctx) for kw in batch])
        if shared:
            ctx.backend.generate(prefill_payload(shared))
    bar = None
    if progress_bar:
        from tqdm import (
            tqdm,  # only when asked for: importing radixserve.lang stays stdlib-only
        )

        bar = tqdm(total=len(batch))
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"sgl-batch-{program.__name__}") as pool:
            futures = [pool.submit(program.start, (), kw, ctx) for kw in batch]
            if bar is not None:
                for f in futures:
                    f.add_done_callback(lambda _: bar.update(1))
            return [f.result() for f in futures]
    finally:
        if bar is not None:
            bar.close()
