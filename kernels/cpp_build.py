"""Building the project's C++ kernels where they run: the native decode step (``native/``) and the batch-invariant
kernels of ``--deterministic`` (``invariant/``). One builder for both: the system's C++ compiler, ``-march`` for
this machine, the shared library cached under the radixserve cache and loaded with ctypes -- only from a private
folder, and only when its sha256 is the one recorded when it was built (radixserve/trusted_cache.py).

The cache key is everything the bytes depend on -- the sources, the compiler and its version, the flags, and this
CPU (its model name and feature flags) -- so a home folder shared by two machines never hands one the other's
library (an AVX-512 build on an AVX2 machine dies with SIGILL). Two switches, read per build:

- ``RADIXSERVE_NATIVE=0``: no C++ at all (as on a machine without a compiler): ``--decode-kernel auto`` serves
  with torch and ``--deterministic`` with its row-by-row torch kernels.
- ``RADIXSERVE_MARCH=x86-64-v3`` (any ``-march`` value; default ``native``): build for another target, e.g. to
  run the C++ kernels as an AVX2-only machine would (the decode step then takes its AVX2 code, ``simd.h``).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

from radixserve.trusted_cache import UntrustedCache, cache_root, private_dir, record, verify

log = logging.getLogger(__name__)


class NativeUnavailable(RuntimeError):
    """A C++ kernel cannot run on this machine; the message says why."""


def default_cache_dir() -> Path:
    return cache_root() / "kernels"


def native_disabled() -> str | None:
    """Why no C++ kernel is built here (the switch), or None."""
    if os.environ.get("RADIXSERVE_NATIVE", "1") == "0":
        return "RADIXSERVE_NATIVE=0 turns the C++ kernels off"
    return None


def march() -> str:
    return os.environ.get("RADIXSERVE_MARCH", "native")


def compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise NativeUnavailable("no C++ compiler (g++/c++/clang++) on PATH to build the C++ kernels")


def cpu_identity() -> str:
    """This CPU's model name and feature flags, as the kernel sees them (empty where /proc/cpuinfo is not)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")  # x86, then aarch64's names
    first = {}
    for line in lines:
        name, _, value = line.partition(":")
        first.setdefault(name.strip(), value.strip())
    return "\n".join(f"{k}: {first[k]}" for k in wanted if k in first)


def build_library(source: Path, flags: tuple[str, ...], cache_dir: Path, stem: str) -> Path:
    """The shared library of ``source`` (and the headers beside it) for this machine, compiled if this combination
    of sources, compiler, flags and CPU is new. NativeUnavailable (the reason) when it cannot be built or cached."""
    why = native_disabled()
    if why:
        raise NativeUnavailable(why)
    cxx = compiler()
    flags = (*flags, f"-march={march()}")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    texts = [f.read_text() for f in sorted(source.parent.iterdir()) if f.suffix in (".cpp", ".h")]
    key = hashlib.sha256("\0".join([*texts, cxx, version, *flags, cpu_identity()]).encode()).hexdigest()[:16]
    out = cache_dir / f"{stem}-{key}.so"
    manifest = f"{out.name}.manifest.json"
    try:
        private_dir(cache_dir)
    except UntrustedCache as exc:  # a library anyone could have written is never loaded
        raise NativeUnavailable(str(exc)) from exc
    except OSError as exc:
        raise NativeUnavailable(f"cannot use {cache_dir} for the C++ kernels: {exc}") from exc
    if out.exists():
        why = verify(cache_dir, manifest, listed_only=True)
        if why is None:
            return out
        log.warning("rebuilding %s: %s", out.name, why)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    try:
        proc = subprocess.run([cxx, *flags, str(source), "-o", str(tmp)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise NativeUnavailable(f"compiling {source.name} with {Path(cxx).name} failed: "
                                    f"{proc.stderr.strip()[-800:]}")
        record(cache_dir / manifest, {out.name: tmp})  # the hash of what was built, before it can be loaded
        tmp.replace(out)  # atomic: a concurrent build of the same key writes the same bytes
    except OSError as exc:  # an unwritable cache folder, a full disk
        raise NativeUnavailable(f"cannot build {source.name} into {cache_dir}: {exc}") from exc
    finally:
        with contextlib.suppress(OSError):  # nothing half-written is left for the next start to load
            tmp.unlink(missing_ok=True)
    return out
