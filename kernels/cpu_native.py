"""The native CPU decode step (``kernels/native/``, one translation unit: ``decode.cpp`` and its headers): built
once per machine with the system's C++ compiler, loaded with ctypes, and described to by plain structures of
pointers into the model's own tensors.

Built on first use into the radixserve cache (``kernels/``) by ``cpp_build`` (keyed by the sources, the compiler,
its flags and this CPU), so an edit, another compiler or another machine rebuilds and a restart only loads (~3 s
to compile here). ``-march=native``: the library is built on the machine it runs on, for that machine's vector
units. Loaded after torch, it shares torch's OpenMP runtime (the same ``libgomp.so.1``), so its threads are
torch's threads, never a second pool.

Two instruction sets, one source (``native/simd.h``): AVX-512 with BF16 and VNNI where the compiler's target has
them (``-march=native`` on Zen 4, Sapphire Rapids and later), else AVX2 with FMA and F16C (x86-64-v3: every x86
CPU since Haswell and Zen 1); ``RADIXSERVE_MARCH=x86-64-v3`` builds the AVX2 one on an AVX-512 machine, to test
it. ``isa(lib)`` says which a library was built for.

Where it cannot run (no compiler, a CPU without AVX2/FMA/F16C, float16 weights) ``unavailable_reason`` says why
and ``--decode-kernel auto`` resolves to the next kernel (compiled, then eager); a build that fails at load time
sends auto there too (ModelRunner).
"""
from __future__ import annotations

import ctypes
import platform
from collections.abc import Sequence
from pathlib import Path

from radixserve.kernels.cpp_build import (NativeUnavailable, build_library, compiler, default_cache_dir,  # noqa: F401
                                          native_disabled)

SOURCES = Path(__file__).with_name("native")  # decode.cpp and the headers it includes
SOURCE = SOURCES / "decode.cpp"
FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-std=c++17",
         "-fvisibility=hidden")  # + -march (cpp_build); decode.cpp exports its rs_ functions
CPU_FEATURES = ("avx2", "fma", "f16c")  # what the kernel needs at least (x86-64-v3); AVX-512 BF16/VNNI if present
NATIVE_DTYPES = ("bfloat16", "float32")
ABI_VERSION = 11

DENSE, Q8, Q4, Q8G16, Q4K, Q6K, PARTS, Q5, Q5K, Q8H = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9  # Linear.format
KV_FORMAT = {"int8": 1, "fp8_e4m3": 2, "fp8_e5m2": 3}  # --kv-cache-dtype -> Model.kv_codes (0: the pools hold T)


class Linear(ctypes.Structure):
    _fields_ = [("format", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32), ("parts", ctypes.c_int32),
                ("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("super_scale", ctypes.c_void_p), ("super_zero", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    _fields_ = [("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p), ("qkv", Linear), ("o", Linear),
                ("gate_up", Linear), ("down", Linear), ("k_pool", ctypes.c_void_p), ("v_pool", ctypes.c_void_p),
                ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p)]


class Model(ctypes.Structure):
    _fields_ = [("bf16", ctypes.c_int32), ("layers", ctypes.c_int32), ("hidden", ctypes.c_int32),
                ("heads", ctypes.c_int32), ("kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32),
                ("inter", ctypes.c_int32), ("vocab", ctypes.c_int32), ("amx", ctypes.c_int32),
                ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("layer", ctypes.POINTER(Layer)), ("norm", ctypes.c_void_p),
                ("lm_head", Linear), ("kv_codes", ctypes.c_int32), ("kv_top", ctypes.c_int32),
                ("kv_limit", ctypes.c_float), ("pad", ctypes.c_float), ("kv_values", ctypes.c_void_p)]


class Step(ctypes.Structure):
    _fields_ = [("rows", ctypes.c_int32), ("logit_rows", ctypes.c_int32), ("groups", ctypes.c_int32),
                ("pad", ctypes.c_int32), ("group_rows", ctypes.c_void_p), ("group_start", ctypes.c_void_p),
                ("group_shared", ctypes.c_void_p), ("row_shared", ctypes.c_void_p), ("h", ctypes.c_void_p),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("out_slot", ctypes.c_void_p),
                ("slots", ctypes.c_void_p), ("starts", ctypes.c_void_p), ("lens", ctypes.c_void_p),
                ("logit_row", ctypes.c_void_p),
                ("logits", ctypes.c_void_p), ("scratch", ctypes.c_void_p), ("scratch_bytes", ctypes.c_int64)]


class PrefixGroups:
    """Rows of a step whose contexts start with the same slots, as the kernel takes them (Step.groups): ``members``
    the rows of each group (each row in at most one), ``shared`` each group's run of leading slots (the kernel reads
    them from the group's first member's context, which must hold them all). ``reach``: for each group, how many
    of its run each member sees (default: all of it; fewer where one request's rows score their own earlier slots
    through the group, each its context -- a causal tile; from 1 up to the run)."""

    def __init__(self, rows: int, members: Sequence[Sequence[int]] = (), shared: Sequence[int] = (),
                 reach: Sequence[Sequence[int]] | None = None) -> None:
        import numpy as np

        if len(members) != len(shared) or (reach is not None and len(reach) != len(members)):
            raise ValueError(f"{len(members)} groups with {len(shared)} shared lengths")
        self.rows = np.array([m for group in members for m in group], dtype=np.int32)
        self.start = np.cumsum([0, *map(len, members)], dtype=np.int32)
        self.shared = np.array(shared, dtype=np.int32)
        self.row_shared = np.zeros(rows, dtype=np.int32)
        for i, (group, n) in enumerate(zip(members, shared)):
            seen = n if reach is None else np.asarray(reach[i], dtype=np.int64)
            if np.any(seen < 1) or np.any(seen > n) or np.shape(seen) not in ((), (len(group),)):
                raise ValueError(f"group {i}: its members see {seen} of its {n} shared slots (1 .. {n} each)")
            self.row_shared[list(group)] = seen
        listed = self.rows.tolist()
        if len(set(listed)) != len(listed) or any(not 0 <= m < rows for m in listed):
            raise ValueError(f"group rows {self.rows.tolist()}: each of rows 0..{rows - 1} in one group at most")

    def __len__(self) -> int:
        return len(self.shared)

    def slots(self) -> int:
        """The shared slots of every group together (rs_scratch_bytes)."""
        return int(self.shared.sum())

    def fields(self) -> dict:
        """Step's group fields (pointers into this object's arrays: keep it alive through the call)."""
        return dict(groups=len(self), group_rows=self.rows.ctypes.data, group_start=self.start.ctypes.data,
                    group_shared=self.shared.ctypes.data, row_shared=self.row_shared.ctypes.data)


def cpu_features() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def unavailable_reason(dtype: str) -> str | None:
    """Why the native decode step cannot run this model here, or None. Cheap: nothing is built (no torch)."""
    if native_disabled():
        return native_disabled()
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"it is written for x86-64 Linux, not {platform.system()} {platform.machine()}"
    if dtype not in NATIVE_DTYPES:
        return f"it runs {' and '.join(NATIVE_DTYPES)} weights, not {dtype}"
    missing = [f for f in CPU_FEATURES if f not in cpu_features()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    try:
        compiler()
    except NativeUnavailable as exc:
        return str(exc)
    return None


def build(cache_dir: Path) -> Path:
    """The shared library for this machine, compiled if this source/compiler/flags/CPU combination is new."""
    missing = [f for f in CPU_FEATURES if f not in cpu_features()]
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64") or missing:
        raise NativeUnavailable(unavailable_reason("float32") or "")
    return build_library(SOURCE, FLAGS, cache_dir, "cpu_decode")


def load(cache_dir: Path) -> ctypes.CDLL:
    """Build (if needed) and load the library. torch must be imported first (its OpenMP runtime is shared)."""
    import torch  # noqa: F401  (loads torch's libgomp.so.1, which the library then binds to)

    lib = ctypes.CDLL(str(build(cache_dir)))
    lib.rs_abi_version.restype = ctypes.c_int32
    if lib.rs_abi_version() != ABI_VERSION:
        raise NativeUnavailable(f"{SOURCE.name}: ABI {lib.rs_abi_version()}, expected {ABI_VERSION}")
    lib.rs_isa.restype = ctypes.c_char_p
    lib.rs_request_amx.restype = ctypes.c_int32
    lib.rs_scratch_bytes.restype = ctypes.c_int64
    lib.rs_scratch_bytes.argtypes = [ctypes.POINTER(Model), ctypes.c_int32, ctypes.c_int32, ctypes.c_int64]
    lib.rs_linear.restype = None
    lib.rs_linear.argtypes = [ctypes.POINTER(Linear), ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32,
                              ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p]
    lib.rs_attention.restype = ctypes.c_int32
    lib.rs_attention.argtypes = [ctypes.POINTER(Model), ctypes.c_int32, ctypes.POINTER(Step), ctypes.c_void_p,
                                 ctypes.c_void_p]
    lib.rs_store_codes.restype = None
    lib.rs_store_codes.argtypes = [ctypes.POINTER(Model), ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p,
                                   ctypes.c_void_p]
    lib.rs_check.restype = ctypes.c_int32
    lib.rs_check.argtypes = [ctypes.POINTER(Model)]
    lib.rs_decode_step.restype = ctypes.c_int32
    lib.rs_decode_step.argtypes = [ctypes.POINTER(Model), ctypes.POINTER(Step)]
    return lib


def linear_scratch_bytes(rows: int, k: int) -> int:
    """rs_linear's scratch: x widened to float32 (AVX2's bf16 products), then x quantized with its scales and sums."""
    return rows * (5 * k + k // 32 * 12) + 64


def product(lib: ctypes.CDLL, lin: Linear, x: torch.Tensor) -> torch.Tensor:
    """``x W^T (+ b)`` of one packed linear layer (``lin``), x [rows, k] contiguous in the layer's dtype: the
    native step's own product, its activations quantized per 32 values for a quantized W (as llama.cpp's)."""
    import torch

    rows = x.shape[0]
    y = torch.empty(rows, lin.n, dtype=x.dtype)
    scratch = torch.empty(linear_scratch_bytes(rows, lin.k), dtype=torch.uint8)
    lib.rs_linear(ctypes.byref(lin), int(x.dtype == torch.bfloat16), x.data_ptr(), rows, y.data_ptr(), 0,
                  scratch.data_ptr())
    return y


def isa(lib: ctypes.CDLL) -> str:
    """The vector instructions a loaded library was built for: "avx512" or "avx2"."""
    return lib.rs_isa().decode()
