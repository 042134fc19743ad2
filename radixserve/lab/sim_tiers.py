"""The KV tiers in the simulator: the scheduler's real LowerTiers (cache/tiers.py) and its write and prefetch
policies, with the runner's side replaced by sets of page keys -- host memory (L2, least recently used first out
beyond its pages) and storage (L3) -- that answer read-backs at once and charge loads and writes to the step.

    a step's extra cost = load_per_token * tokens loaded back + write_per_token * tokens written below
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from radixserve.cache.tiers import LowerTiers, TierConfig
from radixserve.policies import load_prefetch_policy, load_write_policy
from radixserve.wire.plans import Prefetch, Prefetched, TierOps


@dataclass(frozen=True)
class TierSpec:
    """What is simulated below the pool. ``host_pages``: L2's size; ``storage_pages``: L3's (0: no L3)."""

    write: str = "write_through"
    prefetch: str = "timeout"
    page_size: int = 64
    host_pages: int = 256
    storage_pages: int = 1 << 20
    load_per_token: float = 0.00001  # seconds: ~23 KB of bf16 KV a token (SmolLM2), copied and checked
    write_per_token: float = 0.000002


class Pages:
    """Keys, least recently used first, at most ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self.keys

    def add(self, key: bytes) -> None:
        if self.capacity <= 0:
            return
        self.keys[key] = None
        self.keys.move_to_end(key)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)

    def touch(self, key: bytes) -> None:
        self.keys.move_to_end(key)


class SimTiers:
    def __init__(self, spec: TierSpec, clock) -> None:
        self.spec = spec
        self.scheduler_side = LowerTiers(TierConfig(spec.page_size, b"simulated", spec.write, spec.prefetch),
                                         load_write_policy(spec.write), load_prefetch_policy(spec.prefetch), clock)
        self.host, self.storage = Pages(spec.host_pages), Pages(spec.storage_pages)

    def answer(self, sched) -> None:
        """Every read-back the scheduler asked for, answered (the pages found, in order, up to the first missing)."""
        for msg in self.scheduler_side.take_outbox():
            if isinstance(msg, Prefetch) and not msg.flush:
                sched.prefetched(Prefetched(msg.fetch, self._find(msg.keys), 0.0))

    def _find(self, keys: list[bytes]) -> list[int]:
        found = []
        for key in keys:
            if key in self.host:
                self.host.touch(key)
                found.append(2)
            elif key in self.storage:
                self.host.add(key)  # read back into host memory, as the runner does
                found.append(3)
            else:
                break
        return found

    def apply(self, ops: TierOps | None) -> float:
        """A plan's tier work; returns its cost in seconds."""
        if ops is None:
            return 0.0
        for key in ops.write_keys:
            self.host.add(key)
            self.storage.add(key)
        loaded = sum(len(load.slots) for load in ops.loads)
        return self.spec.load_per_token * loaded + self.spec.write_per_token * len(ops.write_keys) * self.spec.page_size
