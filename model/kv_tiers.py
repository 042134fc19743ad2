"""The runner's side of the lower KV tiers: pages of the pool copied to host memory (L2) and storage (L3), and read
back. The scheduler decides (cache/tiers.py); this holds the pages and does the copies.

    step start (main thread):  drops ─▶ writes: pool slots ─▶ encoded pages ─▶ L2 (and queued for L3)
                                        loads:  L2 pages (held for the request) ─▶ pool slots
    inbox thread:               read-backs from the scheduler, at once (not behind the step in flight)
    background thread:          prefetch: L2 hit? hold it : queued for L3? take it : L3 read ─▶ unseal (checksum)
                                          ─▶ L2, held ─▶ report
    storage thread (idle CPU):  store:    seal ─▶ L3 write
    late writer (nice 19):      store or clear queued longer than STORE_DEADLINE_S

A page queued for storage is read back from the queue until it is written: on a busy machine the storage thread
(idle priority) may not run for seconds, and a request asking for the page meanwhile still finds it. Other servers
sharing the storage cannot, so no write waits for an idle CPU longer than STORE_DEADLINE_S: then the late writer
takes it, at the lowest normal priority (nice 19), which a busy machine still gives a share of its CPUs (beside two
busy processes on two CPUs, the idle thread alone had written 12 of a test's 42 pages by the time it asked).

The pool is touched only by the main thread, between steps; the background thread touches only L2 (under its lock)
and storage. A page from storage is checked before anything uses it (model/kv_storage.unseal): a damaged one is
deleted and counted, and the read stops there (its tokens are recomputed).
"""
from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable

import numpy as np
import torch

from radixserve.model.forward_batch import KVPool
from radixserve.model.kv_pages import HostTier, PageCodec
from radixserve.model.kv_storage import DamagedPage, StorageBackend, seal, unseal
from radixserve.wire.plans import Prefetch, Prefetched, TierOps

log = logging.getLogger(__name__)

READ_BATCH = 8  # pages asked of storage at once
MAX_QUEUED_STORE_BYTES = 256 << 20  # pages waiting for a slow store beyond this are not written (counted)
STORE_DEADLINE_S = 1.0  # the longest a storage write waits for an idle CPU before the late writer takes it


class KVTiers:
    def __init__(self, kv: KVPool, codec: PageCodec, host: HostTier, storage: StorageBackend | None,
                 namespace: bytes, report: Callable[[Prefetched], None],
                 store_deadline_s: float = STORE_DEADLINE_S) -> None:
        self.kv, self.codec, self.host, self.storage = kv, codec, host, storage
        self.namespace = namespace
        self.report = report
        self.counters: Counter[str] = Counter()
        self._stored: OrderedDict[bytes, None] = OrderedDict()  # keys this process wrote to storage lately
        self._queued: dict[bytes, torch.Tensor] = {}  # pages queued for storage, not yet written (under _queued_lock)
        self._queued_bytes = 0  # of those pages (both threads change it: under _queued_lock)
        self._queued_lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # read-backs and flushes: a request may be waiting
        # storage writes and clears, in order: (kind, when queued, job), taken by the idle thread or, once late, the
        # late writer; a clear waits for the writes taken before it, and the writes after it for the clear
        # (_storing: jobs being done, _clearing: one of them a clear; under _store_cv)
        self._store_jobs: deque[tuple[str, float, object]] = deque()
        self._store_cv = threading.Condition()
        self._storing, self._clearing = 0, False
        self.store_deadline_s = store_deadline_s
        threading.Thread(target=self._work, name="kv-tiers", daemon=True).start()
        if storage is not None:
            threading.Thread(target=self._store_work, args=(False,), name="kv-tiers-store", daemon=True).start()
            threading.Thread(target=self._store_work, args=(True,), name="kv-tiers-late", daemon=True).start()
        atexit.register(self.drain)  # a server stopped (SIGTERM) still stores what it has queued

    def listen(self, address: str) -> None:
        """Take read-backs from a PULL socket bound at ``address`` (the scheduler's), in a thread of its own: they
        never wait for the step the runner is in."""
        import zmq

        from radixserve.wire.codec import decoder

        sock = zmq.Context.instance().socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
        decode = decoder(Prefetch).decode

        def receive() -> None:
            while True:
                try:
                    self.prefetch(decode(sock.recv()))
                except Exception:  # a bug here must not end the thread: every later read-back would hang
                    log.exception("KV tiers: a read-back could not be taken")

        threading.Thread(target=receive, name="kv-tiers-inbox", daemon=True).start()

    def prefetch(self, msg: Prefetch) -> None:
        """Queue a read-back (or a flush) for the background thread; any thread may call it."""
        if msg.flush:
            self._jobs.put(("flush", msg))
            if msg.flush >= 3:  # after the writes queued before it
                self._put_store("clear", msg)
            return
        with self.host.lock:
            if msg.fetch in self.host.gone:  # let go before it arrived (the drop came with a plan first)
                return
            self.host.live.add(msg.fetch)
        self._jobs.put(("fetch", msg))

    # -- the main thread: between steps ------------------------------------------------------------------

    @torch.inference_mode()
    def apply(self, ops: TierOps) -> None:
        """A plan's tier work, before its forward (the forward may write into slots written out here)."""
        start = time.perf_counter()
        self._apply(ops)
        self.counters["step_seconds"] += time.perf_counter() - start  # what the tiers add to the steps

    def _apply(self, ops: TierOps) -> None:
        for fid in ops.drops:
            self.host.release(fid)
        if ops.write_keys:
            self._write(ops.write_keys, ops.write_slots)
        for load in ops.loads:
            pages = [self.host.take(k) for k in load.keys]
            self.codec.decode_into(self.kv, pages, load.skip, load.slots)
            self.host.release(load.fetch)
            self.counters["pages_loaded"] += len(pages)

    def _write(self, keys: list[bytes], slots: np.ndarray) -> None:
        page = self.codec.page
        new = [i for i, k in enumerate(keys) if k not in self.host and k not in self._stored]
        if not new:
            return
        pages = self.codec.encode(self.kv, np.concatenate([slots[i * page : (i + 1) * page] for i in new]))
        store = []
        for data, i in zip(pages, new):
            if self.host.budget > 0:
                self.host.put(keys[i], data)
                self.counters["l2_pages_written"] += 1
            if self.storage is not None:
                store.append((keys[i], data))
        if store:
            size = len(store) * self.codec.nbytes
            with self._queued_lock:
                full = self._queued_bytes + size > MAX_QUEUED_STORE_BYTES
                if not full:
                    self._queued_bytes += size
                    self._queued.update(store)
            if full:
                self.counters["l3_pages_not_written"] += len(store)  # storage is slower than the pool fills
                return
            for key, _ in store:
                self._stored[key] = None
                if len(self._stored) > 1 << 16:
                    self._stored.popitem(last=False)
            self._put_store("store", store)

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until the pages queued for storage are written (at most ``timeout_s``); False if some are not."""
        deadline = time.monotonic() + timeout_s
        while self.storage is not None and self._queued_bytes > 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        return self._queued_bytes <= 0

    def stats(self) -> dict[str, float]:
        with self.host.lock:
            held = len(self.host.holds)
            self.counters["l2_pages"], self.counters["l2_bytes"] = len(self.host.pages), self.host.nbytes
        with self._queued_lock:
            queued = len(self._queued)
        return {**self.counters, "l2_pages_held": held, "l2_budget_bytes": self.host.budget,
                "l3_pages_queued": queued}

    # -- the background thread ---------------------------------------------------------------------------
    def _work(self) -> None:
        """The background thread's loop: read-backs and flushes."""
        while True:
            self._run(*self._jobs.get())

    def _store_work(self, late: bool) -> None:
        """A storage writer's loop. Not ``late``: scheduled only on a CPU nothing else wants (SCHED_IDLE): beside
        the model's OpenMP threads, writes at normal priority cost the server far more of its throughput than their
        own CPU time on a workload with no reuse (benchmarks/kv_tiers.py, no_reuse). ``late``: only the jobs that
        have waited past the deadline, at nice 19 (no_reuse's tiers-on / tiers-off ratio, four quick runs of two
        pairs each on the 2-CPU Zen 4: 0.946-1.007 at nice 19, 0.910-0.959 at nice 0, 0.958-0.990 with no late
        writer)."""
        try:
            if late:  # the lowest normal priority (a Linux thread's own nice): it still runs on a busy machine
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            elif hasattr(os, "sched_setscheduler"):
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread (Linux)
        except (OSError, AttributeError) as exc:
            log.info("KV tiers: storage writes at normal priority (%s)", exc)
        while True:
            if late:
                time.sleep(self.store_deadline_s / 4)
            while (taken := self._take_store(late)) is not None:
                kind, job = taken
                try:
                    self._run(kind, job)
                    if late and kind == "store":  # pages the late writer took (l3_pages_written: those that landed)
                        self.counters["l3_pages_late"] += len(job)
                finally:
                    with self._store_cv:
                        self._storing -= 1
                        self._clearing = False  # (a clear is only ever done alone)
                        self._store_cv.notify_all()

    def _put_store(self, kind: str, job: object) -> None:
        if self.storage is None:
            return
        with self._store_cv:
            self._store_jobs.append((kind, time.monotonic(), job))
            self._store_cv.notify_all()

    def _take_store(self, late: bool) -> tuple[str, object] | None:
        """The next storage job in turn: a clear once the writes taken before it are done, nothing while a clear is
        being done. The idle thread waits for one; the late writer takes only a job queued past the deadline, else
        None."""
        with self._store_cv:
            while True:
                if self._store_jobs and not self._clearing:
                    kind, since, job = self._store_jobs[0]
                    late_enough = not late or time.monotonic() - since >= self.store_deadline_s
                    if late_enough and (kind == "store" or self._storing == 0):
                        self._store_jobs.popleft()
                        self._storing += 1
                        self._clearing = kind == "clear"
                        return kind, job
                if late:
                    return None
                self._store_cv.wait()

    def _run(self, kind: str, job) -> None:
        try:
            if kind == "fetch":
                self._fetch(job)
            elif kind == "store":
                self._store(job)
            elif kind == "flush":
                self._flush(job)
            elif kind == "clear":
                self.storage.clear()
        except Exception:  # a bug here must not end the thread: every later read-back would hang
            log.exception("KV tiers: %s failed", kind)
            if kind == "fetch":
                self.report(Prefetched(job.fetch, [], 0.0, self.stats()))

    def _fetch(self, msg: Prefetch) -> None:
        """Hold the read-back's pages in L2, from storage where L2 has none, in order, up to the first page found
        nowhere; then report."""
        start = time.perf_counter()
        tiers: list[int] = []
        keys, fid = msg.keys, msg.fetch
        while len(tiers) < len(keys) and fid in self.host.live:
            i = len(tiers)
            if self.host.hold(keys[i], fid):
                tiers.append(2)
                self.counters["l2_pages_read"] += 1
                continue
            if self.storage is None:
                break
            with self._queued_lock:
                queued = self._queued.get(keys[i])
            if queued is not None:  # on its way to storage: what storage will hold
                if not self.host.put(keys[i], queued, fid):
                    break
                tiers.append(3)
                self.counters["l3_pages_read_queued"] += 1
                continue
            batch = keys[i : i + READ_BATCH]
            with self._queued_lock:  # up to the next page L2 or the queue has
                end = next((j for j, k in enumerate(batch) if j and (k in self.host or k in self._queued)), len(batch))
            batch = batch[:end]
            for key, page in zip(batch, self._read(batch)):
                if not self.host.put(key, page, fid):
                    break
                tiers.append(3)
            if len(tiers) < i + len(batch):  # one was missing or damaged, or the read-back was let go
                break
        self.report(Prefetched(fid, tiers, time.perf_counter() - start, self.stats()))

    def _read(self, keys: list[bytes]) -> list[torch.Tensor]:
        """The leading pages of ``keys`` that storage holds intact (a damaged one is deleted; the list ends
        before it, as before the first one missing)."""
        try:
            blobs = self.storage.get(keys)
        except Exception as exc:
            self.counters["l3_errors"] += 1
            log.warning("KV storage read failed (%s: %s); recomputing instead", type(exc).__name__, exc)
            return []
        out: list[torch.Tensor] = []
        for key, blob in zip(keys, blobs):
            if blob is None:
                break
            try:
                payload = unseal(self.namespace, key, blob)
                if len(payload) != self.codec.nbytes:
                    raise DamagedPage(f"{len(payload)} bytes, a page of this format has {self.codec.nbytes}")
            except DamagedPage as exc:
                self.counters["l3_pages_damaged"] += 1
                log.warning("KV storage: page %s is damaged (%s); dropped, its tokens are recomputed",
                            key.hex()[:12], exc)
                self._delete([key])
                break
            self.counters["l3_pages_read"] += 1
            self.counters["l3_bytes_read"] += len(blob)
            if not isinstance(blob, bytearray):  # bytes (Redis): torch wants memory it could write
                blob = bytearray(blob)
            out.append(torch.frombuffer(blob, dtype=torch.uint8, offset=len(blob) - len(payload)))
        return out

    def _store(self, items: list[tuple[bytes, torch.Tensor]]) -> None:
        start = time.perf_counter()
        blobs = [(key, seal(self.namespace, key, page.numpy().data)) for key, page in items]
        try:
            self.storage.set(blobs)
            self.counters["l3_pages_written"] += len(blobs)
            self.counters["l3_bytes_written"] += sum(len(p) for _, parts in blobs for p in parts)
        except Exception as exc:
            self.counters["l3_errors"] += 1
            log.warning("KV storage write failed (%s: %s); those pages stay in the pool and host memory only",
                        type(exc).__name__, exc)
            for key, _ in items:
                self._stored.pop(key, None)
        finally:
            with self._queued_lock:
                self._queued_bytes -= len(items) * self.codec.nbytes
                for key, _ in items:
                    self._queued.pop(key, None)
            self.counters["l3_write_seconds"] += time.perf_counter() - start

    def _delete(self, keys: list[bytes]) -> None:
        try:
            self.storage.delete(keys)
        except Exception as exc:
            log.warning("KV storage delete failed (%s: %s)", type(exc).__name__, exc)

    def _flush(self, msg: Prefetch) -> None:
        self.host.clear()
        self._stored.clear()
        if msg.flush >= 3:  # storage is cleared after the writes queued: none of them is to be read back
            with self._queued_lock:
                self._queued.clear()


def build_tiers(kv: KVPool, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, args, config,
                report: Callable[[Prefetched], None]) -> KVTiers:
    """The runner's tiers for ``args`` (resolved ServerArgs) and the scheduler's ``config`` (TierConfig)."""
    from radixserve.model.kv_storage import load_storage

    codec = PageCodec(args.hicache_kv_format, dtype, layers, kv_heads, head_dim, config.page_size, kv.codes)
    budget = int(args.hicache_size * 1e9) if args.hicache_size else int(args.hicache_ratio * kv.nbytes)
    backend = args.hicache_storage_backend
    storage = None if backend == "none" else load_storage(backend, args.hicache_extra_config())
    log.info("KV tiers: pages of %d tokens (%s, %.1f MiB each); L2 %.0f MiB of host memory; L3 %s; write %s, "
             "prefetch %s", config.page_size, kv.codes or codec.fmt, codec.nbytes / 2**20, budget / 2**20,
             describe_storage(backend, storage), config.write_policy, config.prefetch_policy)
    return KVTiers(kv, codec, HostTier(budget), storage, config.namespace, report)


def describe_storage(name: str, storage: StorageBackend | None) -> str:
    if storage is None:
        return "off"
    where = getattr(storage, "root", None) or getattr(storage, "url", None)
    return f"{name} ({where})" if where else name
