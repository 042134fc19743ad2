"""Token-slot allocator: which rows of the runner's K/V pool are free.

The scheduler owns the indices, the runner owns the tensors. Slot 0 is reserved as a dummy that attention
kernels may read when they pad a batch, so usable slots are 1..capacity.
"""
from __future__ import annotations

import numpy as np

from radixserve.cache.invariants import require

SLOT_DTYPE = np.int32
DUMMY_SLOT = 0


class SlotAllocator:
    """A stack of free slot indices.

    Contract:
      * ``alloc(n)`` returns ``n`` distinct free slots, or ``None`` (and changes nothing) if fewer are free.
      * ``alloc(0)`` returns an empty array.
      * ``free(slots)`` returns slots to the pool; freeing a slot that is already free is a bug that
        ``check()`` reports (it is not detected on the hot path).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the KV pool needs at least one slot, got capacity={capacity}")
        self.capacity = capacity
        # Popped from the end; reversed so that slot 1 is handed out first (readable traces).
        self._stack = np.arange(capacity, 0, -1, dtype=SLOT_DTYPE)
        self._top = capacity

    @property
    def num_free(self) -> int:
        return self._top

    def alloc(self, n: int) -> np.ndarray | None:
        if n > self._top:
            return None
        self._top -= n
        return self._stack[self._top : self._top + n][::-1].copy()

    def free(self, slots: np.ndarray) -> None:
        n = len(slots)
        if n == 0:
            return
        if self._top + n > self.capacity:
            require(False, "freed more slots than the pool holds (double free?)")
        self._stack[self._top : self._top + n] = slots
        self._top += n

    def free_slots(self) -> np.ndarray:
        return self._stack[: self._top].copy()

    def check(self) -> None:
        free = self._stack[: self._top]
        require(len(np.unique(free)) == len(free), "a slot is free twice")
        require(free.size == 0 or (free.min() >= 1 and free.max() <= self.capacity), "free slot out of range")
