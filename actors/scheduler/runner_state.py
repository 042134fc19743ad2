"""What the runner holds for each request, as the scheduler tracks it: a row of its slot-index table (one per
request that holds KV: running, mid-prefill, or in the step being computed; model/slot_table.py keeps the slots)
and, for a constrained or penalized request, its sampling state (model/grammar.py's matcher, model/penalties.py's
output-token counts). The scheduler hands them out and takes them
back; each plan tells the runner what changed."""
from __future__ import annotations

from collections.abc import Iterable

from radixserve.actors.scheduler.req import Req
from radixserve.cache.invariants import require
from radixserve.wire.plans import ForwardPlan


class RunnerState:
    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._free = list(range(rows))[::-1]
        self._released: list[str] = []  # sampling states to drop, sent with the next plan

    def take_row(self, req: Req) -> None:
        """Give ``req`` a table row if it has none (it keeps it until ``release``)."""
        if req.table_row is None:
            require(bool(self._free), "more requests hold KV than the runner has rows")
            req.table_row = self._free.pop()

    def sent(self, reqs: list[Req], plan: ForwardPlan) -> None:
        """``plan`` is on its way: the runner will hold these requests' whole rows and the sampling states it
        starts, and drop the ones it releases."""
        for req in reqs:
            req.sampler_state |= (req.rid in plan.new_grammars or req.rid in plan.new_penalties
                                  or req.rid in plan.new_processors)
            req.kv.synced = req.kv.kv_len
        gone = set(plan.released)
        self._released = [rid for rid in self._released if rid not in gone]

    def release(self, req: Req) -> None:
        """``req`` let go of its KV: its row is free again; a finished request's sampling state is dropped (a
        retracted one keeps it: its output, and so its grammar state and counts, stay)."""
        if req.table_row is not None:
            self._free.append(req.table_row)
            req.table_row = None
        if req.finished and req.sampler_state:
            req.sampler_state = False
            self._released.append(req.rid)

    def released(self) -> list[str]:
        """The sampling states the runner should drop, for the next plan (pending until a plan is ``sent``)."""
        return list(self._released)

    def check(self, live: Iterable[Req]) -> None:
        """Every row is free or held by exactly one live request that holds KV."""
        holders = [r for r in live if r.table_row is not None]
        rows = [r.table_row for r in holders]
        require(len(set(rows)) == len(rows) and not set(rows) & set(self._free)
                and len(rows) + len(self._free) == self.rows, "the runner's table rows are not each held once")
        require(all(r.kv is not None for r in holders), "a request without KV holds a table row")
