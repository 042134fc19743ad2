"""The scheduler's side of the lower KV tiers (``--enable-hierarchical-cache``): which pages go below, which come
back, and when a waiting request may start. No torch, no I/O: the runner holds the pages (model/kv_tiers.py) and
does every copy; this decides them and sends them along with the plans.

    L1  the paged pool (the radix tree's slots)              decided here, computed by the runner
    L2  host memory, in the runner: pages, maybe int8        } written and read by the runner, asked here
    L3  storage (a folder, Redis, a plugin): pages by key    }

A request's life with tiers: on arrival its L1 match is looked up and the full pages after it are asked for
(``Prefetch``); the runner reads them in its background while the request waits, and answers which pages it
found (``Prefetched``). When the request is admitted, the pages found are loaded into fresh pool slots (a
``PageLoad`` in its first plan) and only the rest of the prompt is computed. Pages go below by the write policy:
when computed (write-through), when reused (selective) or when evicted from the pool (write-back).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from radixserve.cache.allocator import SLOT_DTYPE
from radixserve.cache.pages import page_keys, pages_within
from radixserve.cache.radix_tree import TreeNode, pack
from radixserve.policies.tiers import PrefetchPolicy, WritePolicy
from radixserve.wire.plans import PageLoad, Prefetch, Prefetched, TierOps

RECENT_WRITES = 1 << 16  # keys written lately: a page every request shares (a system prompt) is sent once


@dataclass(frozen=True)
class TierConfig:
    page_size: int = 64
    namespace: bytes = b""  # cache/pages.namespace: the chain's start (the model, dtype, format, shard)
    write_policy: str = "write_through"
    prefetch_policy: str = "timeout"


@dataclass(eq=False)
class Fetch:
    """One waiting request's read-back: pages ``first`` .. ``first + len(keys)`` of its tokens."""

    rid: str
    fid: int  # its id in the messages
    first: int
    keys: list[bytes]
    issued: float
    tiers: list[int] | None = None  # where each page found was (2 or 3), once the runner has answered
    answered: float | None = None

    @property
    def done(self) -> bool:
        return self.tiers is not None

    @property
    def pages(self) -> int:
        return len(self.keys)


@dataclass
class TierCounters:
    hit_tokens: list[int] = field(default_factory=lambda: [0, 0, 0])  # L1, L2, L3 tokens reused at admission
    prompt_tokens: int = 0  # of the requests admitted (the hit rates' denominator)
    fetches: int = 0  # read-backs asked for
    fetch_pages: int = 0  # pages asked for
    answered: int = 0
    fetch_seconds: float = 0.0  # total from asking to the runner's answer
    unused: int = 0  # read-backs not used: not back in time (best effort), or the pool's match moved past a gap
    pages_written: int = 0  # pages sent below (the runner skips those it already holds)
    pages_loaded: int = 0


class LowerTiers:
    def __init__(self, config: TierConfig, write: WritePolicy, prefetch: PrefetchPolicy,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.page = config.page_size
        self.write = write
        self.prefetch = prefetch
        self.clock = clock
        self.fetches: dict[str, Fetch] = {}  # by request
        # waiting request -> its tokens in the pool when its pages were asked for, and the pool's version then
        self.asked: dict[str, tuple[int, int]] = {}
        self._by_id: dict[int, Fetch] = {}
        self._next_id = 0
        self.outbox: list[Any] = []  # Prefetch messages for the runner, sent at once (not with a plan)
        self.counters = TierCounters()
        self.runner: dict[str, float] = {}  # the runner's own counters, as of its latest answer
        self._write_keys: list[bytes] = []
        self._write_slots: list[np.ndarray] = []
        self._loads: list[PageLoad] = []
        self._drops: list[int] = []
        self._recent: OrderedDict[bytes, None] = OrderedDict()

    # -- reading back ------------------------------------------------------------------------------------
    def ask(self, rid: str, tokens, cached: int, cap: int, version: int = 0) -> None:
        """A request arrived (or came back to the queue) with ``cached`` of its tokens in the pool (``version``:
        the pool's, CacheManager.version); computing will start from at most ``cap``: ask for the full pages in
        between."""
        self.forget(rid)
        self.asked[rid] = (cached, version)
        first, last = cached // self.page, cap // self.page
        if last <= first:
            return
        keys = page_keys(pack(tokens[: last * self.page]), self.page, self.config.namespace)[first:]
        self._next_id += 1
        fetch = self.fetches[rid] = self._by_id[self._next_id] = Fetch(rid, self._next_id, first, keys, self.clock())
        self.outbox.append(Prefetch(fetch.fid, keys))
        self.counters.fetches += 1
        self.counters.fetch_pages += len(keys)

    def answered(self, msg: Prefetched) -> None:
        self.runner = msg.counters
        fetch = self._by_id.get(msg.fetch)
        if fetch is None or fetch.done:  # forgotten meanwhile (its drop is on the way)
            return
        fetch.tiers, fetch.answered = list(msg.tiers), self.clock()
        self.counters.answered += 1
        self.counters.fetch_seconds += fetch.answered - fetch.issued

    def ready(self, rid: str, now: float) -> bool:
        """May the request start now? (Its read-back is back, or the prefetch policy stops waiting for it.)"""
        fetch = self.fetches.get(rid)
        return fetch is None or fetch.done or bool(self.prefetch.ready(fetch, now))

    def unchanged_since_asked(self, rid: str, version: int) -> bool:
        """Is the pool as it was when the request's pages were asked for (nothing can have moved)?"""
        asked = self.asked.get(rid)
        return asked is None or asked[1] == version

    def moved(self, rid: str, cached: int, version: int) -> bool:
        """Has the pool lost pages of the request's prefix since they were asked for (``cached`` of its tokens are
        there now, in the pool of ``version``: fewer full pages than then)? Pages below may hold them: ask again.
        If not, the check holds until the pool changes again."""
        asked = self.asked.get(rid)
        if asked is None:
            return False
        if cached // self.page < asked[0] // self.page:
            return True
        self.asked[rid] = (asked[0], version)
        return False

    def waiting_until(self) -> float | None:
        """When the earliest unanswered read-back is due to be asked about again (None: none is pending)."""
        return min((f.issued for f in self.fetches.values() if not f.done), default=None)

    def loadable(self, rid: str, cached: int, cap: int) -> int:
        """Tokens after ``cached`` that the request's read-back brought back, up to ``cap`` (0: none; a read-back
        that will not be used is let go)."""
        fetch = self.fetches.get(rid)
        if fetch is None:
            return 0
        start = fetch.first * self.page
        end = min((fetch.first + len(fetch.tiers or ())) * self.page, cap)
        if start > cached or end <= cached:  # not back, or the pool's match moved (a gap before, or past it)
            self.forget(rid)
            self.counters.unused += 1
            return 0
        return end - cached

    def load(self, rid: str, cached: int, slots: np.ndarray) -> tuple[int, int]:
        """Load the tokens ``cached`` .. ``cached + len(slots)`` of the request's read-back into ``slots`` (its
        fresh pool slots) with the next plan; returns (tokens from L2, tokens from L3)."""
        fetch = self.fetches.pop(rid)
        self.asked.pop(rid, None)
        del self._by_id[fetch.fid]
        n, page = len(slots), self.page
        lo, hi = cached // page - fetch.first, (cached + n - 1) // page - fetch.first + 1
        self._loads.append(PageLoad(fetch.fid, fetch.keys[lo:hi], cached % page, slots.astype(SLOT_DTYPE)))
        per_tier = [0, 0]
        for i in range(lo, hi):
            start, end = max((fetch.first + i) * page, cached), min((fetch.first + i + 1) * page, cached + n)
            per_tier[fetch.tiers[i] - 2] += end - start
        self.counters.pages_loaded += hi - lo
        return per_tier[0], per_tier[1]

    def forget(self, rid: str) -> None:
        """The request's read-back will not be used (it ended, or starts without it): the runner lets its pages
        go."""
        self.asked.pop(rid, None)
        fetch = self.fetches.pop(rid, None)
        if fetch is not None:
            del self._by_id[fetch.fid]
            self._drops.append(fetch.fid)

    def admitted(self, cached: tuple[int, int, int], tokens: int) -> None:
        """A request of ``tokens`` tokens was admitted with ``cached`` of them from L1, L2, L3."""
        for i, n in enumerate(cached):
            self.counters.hit_tokens[i] += n
        self.counters.prompt_tokens += tokens

    # -- writing below -----------------------------------------------------------------------------------
    def inserted(self, node: TreeNode, tokens, slots: np.ndarray, start: int, end: int) -> None:
        """Tokens ``start`` .. ``end`` of a request (``slots``: the tree's slots of its tokens 0 .. end) were
        just cached in the pool, up to ``node``."""
        if self.write.on_insert(node):
            self._write(tokens, slots, pages_within(start, end, self.page))

    def hit(self, node: TreeNode, tokens, slots: np.ndarray) -> None:
        """A request reuses its cached prefix, ``slots``, up to ``node``."""
        if self.write.on_hit(node):
            self._write(tokens, slots, pages_within(0, len(slots), self.page))

    def evicting(self, leaf: TreeNode) -> None:
        """``leaf`` leaves the pool (its slots are still intact until the next step's forward)."""
        if not self.write.on_evict(leaf):
            return
        pages = pages_within(leaf.depth - leaf.num_tokens, leaf.depth, self.page)
        if not pages:
            return
        keys, slots, node = [], [], leaf
        while node.parent is not None:  # the path from the root: every page's key depends on all before it
            keys.append(node.key)
            slots.append(node.slots)
            node = node.parent
        self._write(b"".join(reversed(keys)), np.concatenate(slots[::-1]), pages)

    def _write(self, tokens, slots: np.ndarray, pages: range) -> None:
        if not pages:
            return
        packed = tokens if isinstance(tokens, bytes) else pack(tokens[: pages.stop * self.page])
        keys = page_keys(packed, self.page, self.config.namespace, pages.stop)
        page, recent = self.page, self._recent
        for i in pages:
            key = keys[i]
            if key in recent:
                recent.move_to_end(key)
                continue
            recent[key] = None
            if len(recent) > RECENT_WRITES:
                recent.popitem(last=False)
            self._write_keys.append(key)
            self._write_slots.append(slots[i * page : (i + 1) * page])
            self.counters.pages_written += 1

    # -- the plan's share --------------------------------------------------------------------------------
    def take_ops(self) -> TierOps | None:
        """What the next plan carries (None: nothing); the runner does it before that plan's forward."""
        if not (self._write_keys or self._loads or self._drops):
            return None
        ops = TierOps(self._write_keys, np.concatenate(self._write_slots).astype(SLOT_DTYPE)
                      if self._write_slots else None, self._loads, self._drops)
        self._write_keys, self._write_slots, self._loads, self._drops = [], [], [], []
        return ops

    def flush(self, storage: bool) -> None:
        """Forget every page below the pool (in storage too, with ``storage``); read-backs under way are let go."""
        for rid in list(self.fetches):
            self.forget(rid)
        self._write_keys, self._write_slots = [], []
        self._recent.clear()
        self.outbox.append(Prefetch(0, [], flush=3 if storage else 2))

    def take_outbox(self) -> list[Any]:
        out, self.outbox = self.outbox, []
        return out

    def counts(self) -> dict[str, float]:
        """Flat counts that add up across replicas (the api's /metrics)."""
        c, r = self.counters, self.runner
        return {"hit_L1": c.hit_tokens[0], "hit_L2": c.hit_tokens[1], "hit_L3": c.hit_tokens[2],
                "prompt_tokens": c.prompt_tokens, "prefetches_answered": c.answered, "prefetch_seconds": c.fetch_seconds,
                "pages_written": c.pages_written, "pages_loaded": c.pages_loaded,
                **{k: float(r.get(k, 0)) for k in ("l2_bytes", "l3_bytes_read", "l3_bytes_written", "l3_pages_damaged",
                                                   "l3_errors", "l3_pages_not_written")}}

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "page_size": self.page, "write_policy": self.write.name, "prefetch_policy": self.prefetch.name,
            "hit_tokens": {f"L{i + 1}": n for i, n in enumerate(c.hit_tokens)},
            "hit_rate": {f"L{i + 1}": n / c.prompt_tokens if c.prompt_tokens else 0.0
                         for i, n in enumerate(c.hit_tokens)},
            "prefetches": c.fetches, "prefetch_pages": c.fetch_pages, "prefetches_unused": c.unused,
            "load_back_mean_s": c.fetch_seconds / c.answered if c.answered else None,
            "pages_written": c.pages_written, "pages_loaded": c.pages_loaded,
            "runner": dict(self.runner),
        }
