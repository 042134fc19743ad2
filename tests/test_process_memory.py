"""model/process_memory.py: the heap pages that freed objects leave go back to the system when the runner trims
after a load, instead of the process holding the load's peak."""
from __future__ import annotations

import gc

import pytest

from radixserve.model import process_memory


def test_trim_returns_the_pages_freed_objects_left_in_the_heap():
    """300 MB in 100 kB pieces (under glibc's mmap threshold: in the heap), every tenth kept, so the free space lies
    between live objects where malloc cannot shrink the heap by itself: resident until trimmed."""
    if process_memory.resident_bytes() is None or not process_memory._libc():
        pytest.skip("no /proc/self/statm or no malloc_trim (not glibc)")
    chunks = [bytearray(b"x" * 100_000) for _ in range(3000)]
    kept = chunks[::10]
    full = process_memory.resident_bytes()
    del chunks
    gc.collect()
    if process_memory.resident_bytes() < full - 100 * 2**20:
        pytest.skip("this malloc gave the pages back by itself: nothing for trim to do")
    assert process_memory.trim()
    assert process_memory.resident_bytes() < full - 200 * 2**20
    assert len(kept) == 300
