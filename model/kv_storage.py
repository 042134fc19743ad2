"""L3 of the KV cache: pages in storage that outlives the server (``--hicache-storage-backend``).

A backend is a batched key-value store of bytes, found by name in the entry-point group ``radixserve.kv_storage``
and built with the parsed ``--hicache-storage-backend-extra-config`` (a dict)::

    class MyStore:
        def __init__(self, config: dict): ...
        def get(self, keys: list[bytes]) -> list[bytes | bytearray | None]: ...
        def set(self, items: list[tuple[bytes, list[Buffer]]]) -> None: ...  # a value: its buffers back to back
        def exists(self, keys: list[bytes]) -> list[bool]: ...
        def delete(self, keys: list[bytes]) -> None: ...
        def clear(self) -> None: ...

A backend stores whatever it is given: every page is sealed (``seal``) before it is stored and checked
(``unseal``) after it is read, so a torn write, a truncated file, a flipped byte or a page of another model is
found and dropped here, whatever the backend.

Built in: ``file`` (a folder of page files on local disk, its own LRU within ``max_bytes``) and ``redis`` (a Redis or
Valkey server that several servers and machines share).
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import struct
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

MAGIC = b"RSKV"
VERSION = 1
HEADER = struct.Struct("<4sHH16s16sQ16s")  # magic, version, reserved, namespace, key, payload bytes, digest
DEFAULT_DISK_BYTES = 8 << 30
Buffer = bytes | bytearray | memoryview


class StorageBackend(Protocol):
    def get(self, keys: list[bytes]) -> list[bytes | bytearray | None]: ...
    def set(self, items: list[tuple[bytes, list[Buffer]]]) -> None: ...
    def exists(self, keys: list[bytes]) -> list[bool]: ...
    def delete(self, keys: list[bytes]) -> None: ...
    def clear(self) -> None: ...


class DamagedPage(ValueError):
    """A stored page that is not what was written under its key."""


def digest(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def seal(namespace: bytes, key: bytes, payload: Buffer) -> list[Buffer]:
    """A page as stored: a header naming what it is with a checksum of its bytes, then the bytes -- two buffers,
    written back to back (never joined into a copy: the runner's background thread would hold the GIL for it,
    and every step of the runner's own thread would wait)."""
    return [HEADER.pack(MAGIC, VERSION, 0, namespace, key, len(payload), digest(payload)), payload]


def joined(parts: list[Buffer]) -> bytes:
    """One bytes value of a sealed page (for a store that takes nothing else)."""
    return b"".join(parts)


def unseal(namespace: bytes, key: bytes, blob: bytes) -> memoryview:
    """The payload of a stored page; DamagedPage if it is torn, truncated, altered, or not this key's page of this
    namespace."""
    if len(blob) < HEADER.size:
        raise DamagedPage(f"{len(blob)} bytes: shorter than a page header")
    magic, version, _, ns, k, size, want = HEADER.unpack_from(blob)
    if magic != MAGIC or version != VERSION:
        raise DamagedPage("not a page of this format")
    if ns != namespace or k != key:
        raise DamagedPage("a page of another model, format or key")
    payload = memoryview(blob)[HEADER.size :]
    if len(payload) != size:
        raise DamagedPage(f"{len(payload)} payload bytes, the header says {size}")
    if digest(payload) != want:
        raise DamagedPage("checksum mismatch")
    return payload


class FileStore:
    """One file per page under ``path`` (``<key[:1]>/<key>.page``), written to a temporary name and renamed, so a
    reader sees a whole page or none; least recently used pages go first beyond ``max_bytes``. Recency survives a
    restart through the files' modification times (touched on every hit)."""

    def __init__(self, config: dict[str, Any]) -> None:
        from radixserve.trusted_cache import cache_root

        self.root = Path(config.get("path") or cache_root() / "kv-pages")
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(config.get("max_bytes") or default_disk_bytes(self.root))
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recent first
        self.total = 0
        found = []
        for file in self.root.glob("*/*"):
            if file.suffix != ".page":  # a temporary file: of a write under way, or one that never finished
                if not writer_alive(file.name):
                    file.unlink(missing_ok=True)
                continue
            try:
                st = file.stat()
                found.append((st.st_mtime, bytes.fromhex(file.stem), st.st_size))
            except (OSError, ValueError):
                continue
        for _, key, size in sorted(found):
            self._index[key] = size
            self.total += size
        self._trim()

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / f"{name}.page"

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        out = []
        for key in keys:
            path = self._path(key)
            try:
                with open(path, "rb", buffering=0) as f:
                    blob = bytearray(os.fstat(f.fileno()).st_size)  # read into memory the page can then keep
                    del blob[f.readinto(blob) :]  # shorter if the file shrank meanwhile (unseal says so)
                    out.append(blob)
                os.utime(path)
            except OSError:
                out.append(None)
                continue
            with self._lock:
                if key in self._index:
                    self._index.move_to_end(key)
        return out

    def set(self, items: list[tuple[bytes, list[Buffer]]]) -> None:
        for key, parts in items:
            path = self._path(key)
            path.parent.mkdir(exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            size = sum(len(p) for p in parts)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                written = os.writev(fd, parts)  # one syscall, the GIL released
                if written != size:
                    raise OSError(f"wrote {written} of {size} bytes of a page")
            finally:
                os.close(fd)
            os.replace(tmp, path)
            with self._lock:
                self.total += size - self._index.pop(key, 0)
                self._index[key] = size
        self._trim()

    def exists(self, keys: list[bytes]) -> list[bool]:
        return [self._path(k).exists() for k in keys]

    def delete(self, keys: list[bytes]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)
            with self._lock:
                self.total -= self._index.pop(key, 0)

    def clear(self) -> None:
        with self._lock:
            for sub in self.root.iterdir():
                if sub.is_dir():
                    shutil.rmtree(sub, ignore_errors=True)
            self._index.clear()
            self.total = 0

    def _trim(self) -> None:
        with self._lock:
            victims = []
            while self.total > self.max_bytes and self._index:
                key, size = self._index.popitem(last=False)
                self.total -= size
                victims.append(key)
        for key in victims:
            self._path(key).unlink(missing_ok=True)


def writer_alive(name: str) -> bool:
    """Is the process that names a temporary page file (``<key>.<pid>.<thread>.tmp``) still running?"""
    try:
        os.kill(int(name.split(".")[1]), 0)
    except (IndexError, ValueError, ProcessLookupError):
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def default_disk_bytes(root: Path) -> int:
    """8 GiB, or half the free space on the disk holding ``root`` if that is less."""
    return min(DEFAULT_DISK_BYTES, shutil.disk_usage(root).free // 2)


class RedisStore:
    """Pages in a Redis (or Valkey) server that several servers share: ``url`` (default redis://localhost:6379/0),
    keys under ``prefix`` (default ``radixserve:kv:``), an optional ``ttl_s``. Its memory limit and eviction are
    the server's own (maxmemory, maxmemory-policy allkeys-lru)."""

    def __init__(self, config: dict[str, Any]) -> None:
        import redis

        self.url = config.get("url", "redis://localhost:6379/0")
        self.prefix = str(config.get("prefix", "radixserve:kv:")).encode()
        self.ttl_s = config.get("ttl_s")
        self.client = redis.Redis.from_url(self.url, socket_timeout=float(config.get("timeout_s", 5.0)))
        self.client.ping()  # a wrong url fails the start, not the first request

    def _k(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        return self.client.mget([self._k(k) for k in keys]) if keys else []

    def set(self, items: list[tuple[bytes, list[Buffer]]]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for key, parts in items:
            pipe.set(self._k(key), joined(parts), ex=self.ttl_s)
        pipe.execute()

    def exists(self, keys: list[bytes]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self._k(key))
        return [bool(n) for n in pipe.execute()]

    def delete(self, keys: list[bytes]) -> None:
        if keys:
            self.client.delete(*[self._k(k) for k in keys])

    def clear(self) -> None:
        batch = []
        for name in self.client.scan_iter(match=self.prefix + b"*", count=1000):
            batch.append(name)
            if len(batch) >= 1000:
                self.client.delete(*batch)
                batch = []
        if batch:
            self.client.delete(*batch)


def load_storage(name: str, config: dict[str, Any]) -> StorageBackend:
    from radixserve.plugins import load_plugin

    return load_plugin("radixserve.kv_storage", name, "KV storage backend", config,
                       needs=("get", "set", "exists", "delete", "clear"), see="radixserve.model.kv_storage")
