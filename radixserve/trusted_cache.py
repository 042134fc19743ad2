"""What radixserve loads from its cache folder ($RADIXSERVE_CACHE, default ~/.cache/radixserve) it trusts only when
nobody else could have put it there (torch-free).

The cache holds code and weights the server runs: the C++ kernels' shared libraries (loaded with ctypes: whoever
writes one runs code in the server), torch.compile's inductor output, the dequantized GGUF checkpoints. So:

- **The folder is private**: ``private_dir`` creates it (0700) or checks it -- owned by this user, writable by no
  one else, and no folder above it writable by others without the sticky bit (or they could swap the whole folder).
  A folder that fails is refused with the chmod to run (or: point $RADIXSERVE_CACHE at a folder of your own).
- **Every artifact is verified by the content hash recorded when it was built**: ``record`` writes a manifest of
  each file's sha256 beside what was built, before it is moved into place; ``verify`` recomputes them before it is
  loaded, and an artifact that differs (or has a file the manifest does not list) is rebuilt, never loaded. A
  gigabyte checkpoint is not re-hashed on every start: a file whose inode, size, mtime and ctime are those it had
  when it last matched is taken as unchanged (no other user can write it, and a write moves its ctime, which no
  one but root can set back).

    cache = private_dir(cache_root() / "kernels")    # UntrustedCache (a PermissionError) if it is not private
    record(cache / "k.so.manifest.json", {"k.so": tmp})  # before the build moves tmp to k.so
    reason = verify(cache, "k.so.manifest.json", listed_only=True)  # None: load it; else why not (rebuild)
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

def cache_root() -> Path:
    """radixserve's cache folder: $RADIXSERVE_CACHE, default ~/.cache/radixserve."""
    return Path(os.environ.get("RADIXSERVE_CACHE", Path.home() / ".cache" / "radixserve"))


FOLDER_MANIFEST = ".radixserve-manifest.json"  # inside a built folder (a converted checkpoint), listing its files


class UntrustedCache(PermissionError):
    """A cache folder someone other than this user could write to."""


def private_dir(path: Path) -> Path:
    """``path``, created 0700 if missing (and its missing parents), checked by ``check_private``."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_private(path)
    return path


def check_private(path: Path) -> None:
    """UntrustedCache unless ``path`` belongs to this user, is writable by no one else, and every folder above it
    is either the user's or root's and writable by others only with the sticky bit (like /tmp)."""
    real = path.resolve()
    info = real.stat()
    uid = os.getuid()
    if info.st_uid != uid:
        raise UntrustedCache(f"the cache folder {real} belongs to uid {info.st_uid}, not to this user ({uid}): "
                             "its kernels and weights could be anyone's. Point $RADIXSERVE_CACHE at a folder of "
                             "your own")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedCache(f"the cache folder {real} can be written by other users (mode "
                             f"{stat.S_IMODE(info.st_mode):o}): run `chmod go-w {real}`, or point "
                             "$RADIXSERVE_CACHE at a private folder")
    for parent in real.parents:
        above = parent.stat()
        shared = above.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not above.st_mode & stat.S_ISVTX
        if above.st_uid not in (0, uid) or shared:
            raise UntrustedCache(f"the cache folder {real} sits in {parent}, which another user can write to or "
                                 f"owns (uid {above.st_uid}, mode {stat.S_IMODE(above.st_mode):o}): they could "
                                 "replace the cache. Point $RADIXSERVE_CACHE at a folder under your home")


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _identity(path: Path) -> list[int]:
    info = path.stat()
    return [info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]


def record(manifest: Path, files: dict[str, Path]) -> None:
    """Write ``manifest``: for each name, the sha256 of the file now at ``files[name]`` (built under a temporary
    name, about to be moved to that name beside the manifest) and its identity, so the first ``verify`` need not
    hash it again when the move kept it."""
    _write(manifest, {name: {"sha256": _sha256(built), "seen": _identity(built)} for name, built in files.items()})


def verify(folder: Path, manifest: str, listed_only: bool = False) -> str | None:
    """None when every file the manifest names in ``folder`` has the content recorded at build time (and, unless
    ``listed_only``, ``folder`` holds no other file); else why not. A file re-hashed and found equal gets its new
    identity recorded."""
    path = folder / manifest
    try:
        files = json.loads(path.read_text())
        names = set(files)
    except (OSError, ValueError, TypeError):
        return f"{path} is missing or unreadable: nothing says what was built"
    if not listed_only:
        extra = {p.name for p in folder.iterdir()} - names - {manifest}
        if extra:
            return f"{folder} holds files its build did not make: {', '.join(sorted(extra))}"
    changed = False
    for name, entry in files.items():
        file = folder / name
        try:
            if _identity(file) == entry.get("seen"):
                continue
            if _sha256(file) != entry["sha256"]:
                return f"{file} is not what was built there (its sha256 differs from the one recorded then)"
        except (OSError, KeyError, TypeError):
            return f"{file} is missing or its record is broken"
        entry["seen"] = _identity(file)
        changed = True
    if changed:
        _write(path, files)
    return None


def _write(path: Path, files: dict) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(files, f)
    tmp.replace(path)  # atomic: a reader sees the old manifest or the new one
