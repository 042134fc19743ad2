"""The runner's copy of every running request's row of KV slot indices.

The scheduler owns the slot indices and decides every one of them; the runner only needs to know them. Sending
each request's whole row every step costs O(context) per request per step (a 4k-token chat: 16 KB a step, and as
much numpy work on both sides). So the runner keeps the rows, in a table indexed by a row number the scheduler
assigns, and each plan carries only what changed: for request i, the slots of row positions
``row_writes[i] .. prefix_lens[i] + extend_lens[i]`` (a decode step: one slot; a new request: its cached prefix
once; a row the radix cache rewrote: from the first rewritten position).

    table[row]:  | written before (still valid) | written by this plan (new_slots) | unused |
                 0                          row_writes[i]           prefix + extend

numpy only: the scheduler tests' fake runner keeps the same table.
"""
from __future__ import annotations

import numpy as np

from radixserve.wire.plans import ForwardPlan


class SlotTable:
    def __init__(self, rows: int = 8, length: int = 256) -> None:
        self.table = np.zeros((rows, length), dtype=np.int32)  # grows on demand; slot 0 (the dummy) where unset

    def apply(self, plan: ForwardPlan) -> np.ndarray:
        """Write the plan's new slots; return every request's whole row for this step, back to back (int64)."""
        rows, starts = plan.rows, plan.row_writes
        ends = plan.prefix_lens + plan.extend_lens
        self._fit(int(rows.max()) + 1, int(ends.max()))
        counts = ends - starts
        if counts.sum():
            r = np.repeat(rows, counts)
            c = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts - starts, counts)
            self.table[r, c] = plan.new_slots
        r = np.repeat(rows, ends)
        c = np.arange(int(ends.sum())) - np.repeat(np.cumsum(ends) - ends, ends)
        return self.table[r, c].astype(np.int64)

    def _fit(self, rows: int, length: int) -> None:
        have_rows, have_len = self.table.shape
        if rows <= have_rows and length <= have_len:
            return
        grown = np.zeros((max(rows, 2 * have_rows if rows > have_rows else have_rows),
                          max(length, 2 * have_len if length > have_len else have_len)), dtype=np.int32)
        grown[:have_rows, :have_len] = self.table
        self.table = grown
