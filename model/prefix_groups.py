"""Rows of one step that share a prefix, and what a prefill step costs the native step (model/native_decode.py).

The native kernel scores a run of slots that several rows' contexts start with once for all of them (a system
prompt under many requests, a document, a request's own cached prefix under its new tokens): ``prefix_groups``
finds those runs in any step. A prefill step runs native while its attention's ``step_cost`` fits a budget; past
it torch's attention is faster (``budget``: the figures behind each number).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import torch

from radixserve.kernels import cpu_native as native

# A group's rows of one request TILE or more slots past its shared run are split off in groups of TILE slots'
# steps (_tiled), each of TILE_ROWS rows at least. Each such group packs its whole shared context, so their number
# is held to TILES x span / (shared run + span) (longer steps where it would be more): all together they pack at
# most TILES x the rows' span, however long the cached prefix under them
TILE, TILES, TILE_ROWS = 128, 16, 16
SHARED_MIN = 128  # shared context slots from which a group of rows scores them once for all (fewer: the per-row
# path is as fast)
# A prefill step runs native while its attention costs at most this many (token, key) pairs visited row by row, a
# group's shared slots counted at 1 / SHARED_GAIN (``step_cost``): the kernel beats torch's per-request SDPA plus
# its small ops for short prompts and short continuations of cached ones, and loses for long prompts scored row by
# row. These two: where the kernel is built for AVX-512 but AMX tiles are not granted (bf16: the shared prefix
# scored with a tile's queries in a vector's lanes, shared_lanes.h), a long prompt's rows in causal tiles
# (``tiled``, as with AMX). Measured on Zen 4 (AVX-512 BF16, no AMX; SmolLM2, bf16, 2 threads;
# benchmarks/shared_extend.py, torch / native grouped ms, cost as counted here): fresh prompts 1 x 256 1.36x,
# 1 x 512 1.50x, 1 x 1024 1.46x, 1 x 2048 1.54x (18k), 4 x 256 1.31x, 8 x 256 1.24x, 2 x 880 1.36x, 1 x 8000 1.71x
# (250k: 32M pairs); on 860 cached slots 31 x 32 2.08x (23k), 8 x 32 2.18x, 4 x 64 2.00x, 1 x 512 1.75x,
# 1 x 1024 1.80x, 16 x 128 1.57x (146k: their rows near the run row by row); on 6000, 16 x 128 2.35x (228k),
# 1 x 2048 2.11x, 4 x 16 4.43x; Llama-3.2-1B's shape fresh 1 x 512 1.22x, 1 x 1024 1.19x, 1 x 2048 1.20x. Without
# the tiles (each row scoring its own slots past its group's run) fresh 1 x 1024 ran 1.03x and 1 x 2048 0.86x,
# 1 x 4096 0.78x, so the budget had kept them on torch (400k pairs, a shared one at 1 / 16). float32 (the vector
# shared path, shared_vector.h, tiled too) keeps the budget of a Xeon with AMX before prefill rows were grouped
# (40k, a shared pair at 1 / 2). It measured faster than torch where that budget sends steps to torch (fresh
# 1 x 512 1.25x, 1 x 1024 1.13x, 1 x 2048 1.01x; on 860 cached slots 31 x 32 1.27x, 1 x 512 1.15x, 16 x 128
# 1.21x), but float32 is what the tests hold to transformers token for token, and a step moved off torch rounds
# otherwise: not raised before those suites have run with it
EXTEND_KEYS = {torch.bfloat16: 400_000, torch.float32: 40_000}
SHARED_GAIN = {torch.bfloat16: 128, torch.float32: 2}  # a per-row pair / a shared one
# ... where AMX tiles score the shared slots (tile products for all a group's rows, and a request's rows far into
# its own context in causal tiles of their own: _tiled): a shared pair costs little beside the step's products.
# Measured on a Xeon with AMX (SmolLM2, bf16, 2 threads; benchmarks/shared_extend.py, torch / native ms), with the
# tiles' rows seeing their own slots through them: on 860 cached slots 31 x 32 2.39x, 4 x 64 1.94x, 1 x 512 1.53x,
# 1 x 1024 1.47x; fresh prompts 1 x 512 1.26x, 1 x 1024 1.19-1.25x, 2 x 880 1.23x, 1 x 2048 1.14x, 4 x 1024
# 1.13x, 1 x 4096 1.04x (within the budget now), 1 x 8000 1.03x (past it). Before (each row scoring its last
# slots, up to TILE, row by row; the cost as counted then): on 860 cached 1 x 512 1.29x (41k), 1 x 1024 1.21x
# (86k); on 6000 cached, 16 x 128 1.72-1.87x (324k), 1 x 2048 1.13x in 16 steps of 128 (353k), 1.17x in the 4 of
# 512 it now takes (740k: on torch); fresh 1 x 1024 1.00-1.14x (73k), 1 x 4096 0.88x (629k), 1 x 8000 0.87x
# (2.4M); before the tiles, a fresh 512-token prompt already went to torch (0.74-0.90x at 83k)
EXTEND_KEYS_AMX = 400_000
SHARED_GAIN_AMX = 64
# ... where the kernel is built for AVX2 (no AVX-512), against torch, whose bf16 products go through float32 copies
# there and whose float32 SDPA over a long gathered prefix is slow: measured on Zen 3, 2 threads
# (benchmarks/shared_extend.py, torch / native ms, cost as counted here): bf16 fresh prompts 1 x 512 1.20x (85k),
# 2 x 512 0.99x (170k), 1 x 768 0.85x (218k); on 860 cached slots 31 x 32 1.54x (70k), 1 x 512 1.18x (158k),
# 1 x 768 0.96x (336k); on 2000, 31 x 32 1.33x (140k). float32: fresh 1 x 384 1.17x (43k), 1 x 512 1.01x (85k);
# on 860 cached, 16 x 64 2.16x (88k), 1 x 512 0.95x (158k).
EXTEND_KEYS_AVX2 = {torch.bfloat16: 160_000, torch.float32: 100_000}
SHARED_GAIN_AVX2 = 16


def budget(isa: str, dtype: torch.dtype, amx: bool) -> tuple[float, float]:
    """(the most a prefill step may cost and still run native, a shared pair's gain) for a kernel built for
    ``isa`` (cpu_native.isa) running ``dtype``, with AMX tiles granted or not."""
    if isa == "avx2":
        return EXTEND_KEYS_AVX2[dtype], SHARED_GAIN_AVX2
    return (EXTEND_KEYS_AMX, SHARED_GAIN_AMX) if amx else (EXTEND_KEYS[dtype], SHARED_GAIN[dtype])


def step_cost(length: np.ndarray, groups: native.PrefixGroups, shared_gain: float) -> float:
    """A step's attention in (row, key) pairs visited row by row (row m's context: ``length[m]`` slots), its
    groups' shared slots counted at 1 / ``shared_gain`` (scored once for all the group's rows): tokens on one
    cached prefix, whether one request's or several requests', and a long prompt's rows on its own first slots."""
    shared = float(groups.row_shared.sum())
    return float(length.sum()) - shared + shared / shared_gain


def prefix_groups(slots: torch.Tensor, first: np.ndarray, length: np.ndarray,
                  tiled: bool = False) -> native.PrefixGroups:
    """The rows whose contexts start with the same run of at least SHARED_MIN slots (a system prompt, a document,
    few-shot examples, a request's own cached prefix under its new tokens), one group per run, which the kernel
    scores once for all the group's rows. Row m's context: ``slots[first[m] : first[m] + length[m]]``
    (``attn.tree_contexts``): a decode row's is its request's row; a prefill row's, its request's row up to itself.

    Rows are bucketed by their first slot. Prompts that begin alike (a chat template's first tokens) share their
    first slots in the radix tree and land in one bucket, so a bucket is split: a group is the rows sharing at
    least SHARED_MIN slots with the bucket's first row (its shared run the shortest they have in common with it),
    and the rows it leaves out are grouped the same way among themselves. The rows of one request share their
    context's start, so each distinct start is compared once, not each row. ``tiled``: a request's rows far past
    their group's shared run split off in causal tiles of their own (_tiled), and a fresh prompt's first rows form
    one (_first_rows), where AMX tiles score shared slots."""
    rows = len(length)
    if rows < 2:
        return native.PrefixGroups(rows)
    slots = slots.numpy()
    long = np.flatnonzero(length >= SHARED_MIN)
    heads = slots[first[long]]
    order = np.argsort(heads, kind="stable")
    cuts = np.flatnonzero(np.diff(heads[order])) + 1
    members, shared = [], []
    for left in np.split(long[order], cuts):
        while len(left) >= 2:
            common = _common_run(slots, first, length, left)
            keep = common >= SHARED_MIN  # the first row keeps itself (its own context): each pass takes one row
            if keep.sum() >= 2:
                members.append(left[keep].tolist())
                shared.append(int(common[keep].min()))
            left = left[~keep]
    if tiled:
        members, shared, reach = _tiled(members, shared, first, length)
        _first_rows(members, shared, reach, first, length)
        return native.PrefixGroups(rows, members, shared, reach)
    return native.PrefixGroups(rows, members, shared)


def _first_rows(members: list[list[int]], shared: list[int], reach: list[list[int]], first: np.ndarray,
                length: np.ndarray) -> None:
    """A fresh prompt's first rows (contexts shorter than SHARED_MIN, in no group) as a causal tile of their own,
    TILE_ROWS of them or more: rows of one request (one ``first``) see nested runs of its slots."""
    short = np.flatnonzero(length < SHARED_MIN)
    starts, count = np.unique(first[short], return_counts=True)
    for start in starts[count >= TILE_ROWS]:
        rows = short[first[short] == start]
        rows = rows[np.argsort(-length[rows], kind="stable")]  # the longest first: its context holds the run
        members.append(rows.tolist())
        shared.append(int(length[rows[0]]))
        reach.append(length[rows].tolist())


def _tiled(members: list[list[int]], shared: list[int], first: np.ndarray,
           length: np.ndarray) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """Each group with the rows of one request that reach TILE or more slots past its shared run split off: one
    group per TILE-slot step they reach, its run their request's context up to its furthest row, each row seeing
    its own context through it (a causal tile: members, runs and each member's reach, the longest row first, whose
    context holds the run). A long prompt's or continuation's rows then score all their slots through the shared
    path; only the rows left in the group score their own slots past its run row by row (fewer than TILE each). A
    group of one request's rows alone (a long prompt on its own first slots) splits its rows near the run too.
    Rows of one request share their context's start (``first``); a split-off group needs TILE_ROWS rows (fewer:
    they stay, packing would cost what it saves)."""
    out_members, out_shared, out_reach = [], [], []
    for rows, n in zip(members, shared):
        rows = np.asarray(rows)
        past = length[rows] - n  # each row's reach past the shared run
        alone = bool(np.all(first[rows] == first[rows[0]]))
        stay = np.ones(len(rows), dtype=bool)
        for start in np.unique(first[rows]):
            mine = first[rows] == start
            span = int(past[mine].max())
            if mine.sum() < TILE_ROWS or (span < TILE and not alone):
                continue  # fewer rows far out (a decode step's one a request): no tile to split
            tiles = max(1, TILES * span // (n + span))  # so that they pack at most TILES x span slots in all
            tile = max(TILE, -(-span // (tiles * 16)) * 16)
            level = past // tile
            for k in np.unique(level[mine]):
                split = mine & (level == k)
                if (k > 0 or alone) and split.sum() >= TILE_ROWS:
                    tile_rows = rows[split][np.argsort(-length[rows[split]], kind="stable")]  # the longest first
                    out_members.append(tile_rows.tolist())
                    out_shared.append(int(length[tile_rows[0]]))
                    out_reach.append(length[tile_rows].tolist())
                    stay &= ~split
        if stay.any():
            out_members.append(rows[stay].tolist())
            out_shared.append(n)
            out_reach.append([n] * int(stay.sum()))
    return out_members, out_shared, out_reach


def _common_run(slots: np.ndarray, first: np.ndarray, length: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """How many slots each of ``rows`` has in common with the first one's context, from the start."""
    starts, which = np.unique(first[rows], return_inverse=True)
    reach = np.zeros(len(starts), dtype=np.int64)  # the longest context from each start
    np.maximum.at(reach, which, length[rows])
    span = np.arange(int(length[rows[0]]))  # the first row's context
    at = starts[:, None] + span  # [starts, span]: past a start's longest context, not its slots
    inside = span < reach[:, None]
    same = inside & (slots[np.minimum(at, len(slots) - 1)] == slots[first[rows[0]] + span])
    run = np.where(same.all(axis=1), len(span), same.argmin(axis=1))  # each start's run in common with it
    return np.minimum(run[which], length[rows])


@dataclass(frozen=True, slots=True)
class StepContexts:
    """What ``NativeDecode.applies`` works out for a prefill step it takes, kept as the step's attention metadata
    (``attn.backend_data``) so that the step runs on it: each row's context (``attn.tree_contexts``: a draft tree's
    rows read lists of their own, built row by row) and the groups of rows sharing a prefix."""

    slots: torch.Tensor
    first: np.ndarray
    length: np.ndarray
    groups: native.PrefixGroups
