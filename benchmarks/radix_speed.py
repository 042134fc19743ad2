"""The prefix cache alone, radixserve's against SGLang's own ``RadixCache`` (sglang 0.5.23, the copy ``make install``
puts in .venv/sglang-frontend), on one synthetic trace: requests per second of the cache bookkeeping a scheduler
does per request -- match the prompt, lock, evict for room, allocate, insert prompt + output, unlock -- at two pool
capacities, side by side in one run (alternating, best of repeats). Both evict LRU; their hit rates must agree.

The trace: 20,000 requests; 200 prefix groups (system prompts / few-shot blocks of 200-2,000 tokens, popular ones
more often), a fresh 20-300-token question and a 20-200-token answer each; 30% continue an earlier conversation
(its whole history + a new question).

    python benchmarks/radix_speed.py [--requests 20000] [--capacity 200000,50000] [--repeats 3]
"""
from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import random
import sys
import time
import types
from array import array
from pathlib import Path

import numpy as np
from tqdm import tqdm

from radixserve.cache import CacheManager
from radixserve.policies.eviction import LRU

SGLANG = Path(__file__).resolve().parents[1] / ".venv" / "sglang-frontend"
# sglang's import chain reaches modules the cache never uses that need packages it was installed without
# (torchvision, tvm_ffi, compressed_tensors, sentencepiece): those modules are replaced by empty stand-ins
UNUSED = ("sglang.srt.multimodal", "sglang.srt.configs.deepseek_ocr", "sglang.srt.configs.internvl",
          "sglang.kernels.ops.communication.all_reduce", "sglang.srt.layers.quantization.compressed_tensors")


def trace(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(prompt, prompt + output) per request."""
    rng = random.Random(seed)

    def run(k: int) -> list[int]:
        return [rng.randrange(50000) for _ in range(k)]

    groups = [run(rng.randrange(200, 2000)) for _ in range(200)]
    weights = [1 / (i + 1) for i in range(len(groups))]
    history: list[list[int]] = []
    out = []
    for _ in range(n):
        if history and rng.random() < 0.3:
            prompt = rng.choice(history) + run(rng.randrange(20, 300))
        else:
            prompt = rng.choices(groups, weights)[0] + run(rng.randrange(20, 300))
        full = prompt + run(rng.randrange(20, 200))
        out.append((prompt, full))
        history.append(full)
        if len(history) > 500:
            history.pop(rng.randrange(len(history)))
    return out


def ours(requests, capacity: int) -> tuple[float, float]:
    """Seconds and hit rate through radixserve's CacheManager: the calls the scheduler makes per request."""
    cache = CacheManager(capacity, LRU())
    hit = total = 0
    packed = [array("i", prompt) for prompt, _ in requests]  # a Req packs its prompt once, when it arrives
    start = time.perf_counter()
    for (prompt, full), first in zip(requests, packed):
        key = first[:]  # the Req's fill_key: its prompt, extended by its output
        handle = cache.open(key, len(full))
        cache.admit(handle)
        hit, total = hit + handle.kv_len, total + len(prompt)
        key.extend(full[len(prompt) :])
        if cache.extend(handle, len(full) - handle.kv_len):
            cache.close(handle, key)
        else:
            cache.close(handle, key[: handle.kv_len])
    return time.perf_counter() - start, hit / total


class _Stub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if any(name == m or name.startswith(m + ".") for m in UNUSED):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Empty(spec.name)

    def exec_module(self, module) -> None:
        module.__path__ = []


class _Anything(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})

    def __call__(cls, *args, **kwargs):
        return _Anything("instance", (), {})


class _Empty(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})


def sglang_cache():
    if not SGLANG.exists():
        raise SystemExit(f"SGLang is not installed at {SGLANG}: run `make install`")
    sys.meta_path.insert(0, _Stub())
    sys.path.insert(0, str(SGLANG))
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    return RadixCache, RadixKey, MatchPrefixParams, InsertParams, EvictParams


class _Allocator:
    """The pool SGLang's cache frees into: a stack of free indices, as radixserve's SlotAllocator."""

    device = "cpu"

    def __init__(self, capacity: int) -> None:
        self.stack = np.arange(capacity, 0, -1, dtype=np.int64)
        self.top = capacity

    def alloc(self, n: int):
        import torch

        if n > self.top:
            return None
        self.top -= n
        return torch.from_numpy(self.stack[self.top : self.top + n].copy())

    def free(self, indices) -> None:
        n = len(indices)
        self.stack[self.top : self.top + n] = indices.numpy()
        self.top += n

    def free_segment(self, indices, start_pos: int = 0) -> None:
        self.free(indices[start_pos:])


def theirs(requests, capacity: int) -> tuple[float, float]:
    """Seconds and hit rate through SGLang's RadixCache, driven as its scheduler drives it."""
    import torch

    RadixCache, RadixKey, MatchPrefixParams, InsertParams, EvictParams = sglang_cache()
    alloc = _Allocator(capacity)
    cache = RadixCache.create_simulated(mock_allocator=alloc)
    hit = total = 0
    packed = [array("q", prompt) for prompt, _ in requests]  # SGLang's Req keeps its tokens as array('q')
    start = time.perf_counter()
    for (prompt, full), first in zip(requests, packed):
        key = first[:]
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(key[:-1])))
        node, cached = match.last_device_node, match.device_prefix_len
        cache.inc_lock_ref(node)
        hit, total = hit + cached, total + len(prompt)
        need = len(full) - cached
        if alloc.top < need:
            cache.evict(EvictParams(num_tokens=need - alloc.top))
        new = alloc.alloc(need)
        if new is not None:
            value = torch.cat([torch.zeros(cached, dtype=torch.int64), new])  # the matched part stays the tree's
            key.extend(full[len(prompt) :])
            done = cache.insert(InsertParams(key=RadixKey(key), value=value))
            alloc.free(value[cached : done.prefix_len])  # computed twice: the tree keeps its copy
        cache.dec_lock_ref(node)
    return time.perf_counter() - start, hit / total


def measure(requests: int = 20000, capacities: tuple[int, ...] = (200000, 50000), repeats: int = 3) -> dict:
    reqs = trace(requests)
    rows = []
    for capacity in tqdm(capacities, desc="radix tree vs SGLang", leave=False):
        times: dict[str, list[float]] = {"radixserve": [], "sglang": []}
        hits = {}
        for r in range(repeats):
            for name, fn in (("radixserve", ours), ("sglang", theirs))[:: 1 if r % 2 == 0 else -1]:
                seconds, hits[name] = fn(reqs, capacity)
                times[name].append(seconds)
        best = {k: min(v) for k, v in times.items()}
        rows.append({"capacity": capacity, "radixserve_req_s": len(reqs) / best["radixserve"],
                     "sglang_req_s": len(reqs) / best["sglang"], "speedup": best["sglang"] / best["radixserve"],
                     "radixserve_hit_rate": hits["radixserve"], "sglang_hit_rate": hits["sglang"],
                     "runs_s": times})
    return {"requests": len(reqs), "prompt_tokens": sum(len(p) for p, _ in reqs), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--capacity", default="200000,50000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/radix_speed.json")
    args = ap.parse_args()
    res = measure(args.requests, tuple(int(c) for c in args.capacity.split(",")), args.repeats)
    print(f"\n{'capacity':>9} {'radixserve req/s':>17} {'SGLang req/s':>13} {'speedup':>8} {'hit rates':>14}")
    for r in res["rows"]:
        print(f"{r['capacity']:>9} {r['radixserve_req_s']:>17.0f} {r['sglang_req_s']:>13.0f} {r['speedup']:>7.2f}x "
              f"{r['radixserve_hit_rate']:>6.3f}/{r['sglang_hit_rate']:.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
