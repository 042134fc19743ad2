"""Admission into one prefill step: requests join while they fit a new-token budget and the KV pool, after
reserving room for every admitted or running request to keep decoding."""
from __future__ import annotations

import numpy as np

from radixserve.actors.scheduler.req import Req
from radixserve.cache.invariants import require
from radixserve.cache.manager import CacheManager
from radixserve.cache.radix_tree import RadixTree
from radixserve.policies.eviction import LRU

DEDUP_MIN_TOKENS = 32  # an uncached prefix shared with a request admitted this step is worth waiting for


def future_tokens(req: Req, clip: int, ratio: float) -> float:
    """Decode slots to keep for ``req``: its remaining budget, clipped, scaled by the observed ratio."""
    return min(req.max_new_tokens - len(req.output_ids), clip) * ratio


class PrefillAdder:
    def __init__(self, cache: CacheManager, token_budget: int, chunking: bool, reserved: float, new_token_ratio: float,
                 clip_max_new_tokens: int) -> None:
        self.cache = cache
        self.tokens_left = token_budget
        self.chunking = chunking
        self.reserved = reserved  # slots promised to requests' future decode tokens
        self.ratio = new_token_ratio
        self.clip = clip_max_new_tokens
        self.reqs: list[Req] = []
        self.starts: list[int] = []  # kv_len of each admitted request before this step's forward
        self.floors: list[int] = []  # ... and before its loads from the lower tiers (what a failed step keeps)
        self.partial: Req | None = None  # the one request that only got part of its prompt (chunked prefill)
        self.short_of_kv = False  # the last add() failed for want of KV room, not of this step's token budget

    def future_tokens(self, req: Req) -> float:
        return future_tokens(req, self.clip, self.ratio)

    def add(self, req: Req) -> bool:
        """Try to admit ``req`` (a new or retracted request, or the chunked one continuing).

        True: admitted (maybe partially). False: it does not fit; the caller stops admitting so that the order
        the schedule policy chose is kept (no small request overtaking a blocked large one forever).
        """
        self.short_of_kv = False
        if self.partial is not None or self.tokens_left <= 0:
            return False
        fresh = req.kv is None
        load = 0  # tokens its read-back from the lower tiers brings (loaded, not computed)
        if fresh:
            req.kv = self.cache.open(req.fill_key, req.max_seq_len, req.priority, limit=req.match_limit)
            if self.cache.tiers is not None:
                load = self.cache.tiers.loadable(req.rid, req.kv_len, min(req.match_limit, req.seq_len - 1))
        want = req.extend_len - load
        if want <= self.tokens_left:
            n = want
        elif self.chunking:
            n = self.tokens_left
        elif not self.reqs:
            n = want  # chunking off: a prompt larger than the budget runs alone
        else:
            return self._reject(req, fresh)
        reserve = self.future_tokens(req) if n == want else 0.0  # 0 for a prefill-only request
        if self.cache.available - self.reserved < n + load + reserve:
            self.short_of_kv = True
            return self._reject(req, fresh)
        floor = req.kv_len
        below = (0, 0)
        if load:
            require(self.cache.extend(req.kv, load), "the pool had room a moment ago")
            below = self.cache.tiers.load(req.rid, floor, req.kv.row[floor : floor + load])
        start = req.kv_len
        require(self.cache.extend(req.kv, n), "the pool had room a moment ago")
        if fresh:
            self.cache.admit(req.kv, req.fill_key)  # only now does its cached prefix count as used (a hit)
        if req.cached_tokens is None:
            req.cached_tokens = start
            req.cached_tiers = (floor, *below)
            if self.cache.tiers is not None:
                self.cache.tiers.admitted(req.cached_tiers, req.seq_len)
        self.reqs.append(req)
        self.starts.append(start)
        self.floors.append(floor)
        self.tokens_left -= n
        self.reserved += reserve
        if n < want:
            self.partial = req
        return True

    def unreserve(self, req: Req) -> None:
        """``req`` left the running set (preempted): the slots kept for its future decode tokens are free again."""
        self.reserved -= self.future_tokens(req)

    def _reject(self, req: Req, fresh: bool) -> bool:
        if fresh:  # give back the prefix lock it took; a continuing chunked request keeps what it holds
            self.cache.close(req.kv, req.fill_key)
            req.kv = None
        return False


class InBatchDedup:
    """Of several waiting requests that share a prefix nobody has cached yet, the first admitted computes it;
    the others wait one step and then find it in the tree (each prefill is cached right after it runs)."""

    def __init__(self, cache: CacheManager) -> None:
        self.cache = cache
        self.batch = RadixTree(LRU(), lambda slots: None)  # this step's admitted prompts (slots unused)

    def defer(self, req: Req, anything_admitted: bool) -> bool:
        if not anything_admitted:
            return False
        tokens = req.fill_key
        return self.batch.match_len(tokens) - self.cache.match_len(tokens) >= DEDUP_MIN_TOKENS

    def admitted(self, req: Req) -> None:
        tokens = req.fill_key
        self.batch.insert(tokens, np.zeros(len(tokens), dtype=np.int32))
