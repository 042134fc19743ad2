"""``--decode-kernel auto`` means "the best that works here": a native step that fails to build (no compiler, a
compiler that fails, an unwritable cache) or refuses the model is logged with its reason and the server serves with
the next kernel; only an explicit ``--decode-kernel native`` fails. The C++ libraries are cached per CPU, so a
home folder shared by two machines never hands one the other's build."""
from __future__ import annotations

import httpx
import pytest

from radixserve.kernels import cpp_build, invariant
from radixserve.kernels.cpu_native import unavailable_reason
from radixserve.model.config import ModelConfig
from radixserve.model.loader import load_configs
from radixserve.model.runner import ModelRunner
from radixserve.server_args import ServerArgs


def test_auto_resolves_native_with_a_fallback_and_explicit_native_without(monkeypatch):
    monkeypatch.delenv("RADIXSERVE_DISABLE_COMPILE", raising=False)
    if unavailable_reason("float32") is not None:
        pytest.skip(f"no native step here: {unavailable_reason('float32')}")

    def resolved(**kw) -> ServerArgs:
        return ServerArgs(device="cpu", **kw).resolved(kv_values_per_token=2 * 2 * 64, model_context=2048)

    auto = resolved()
    assert (auto.decode_kernel, auto.decode_fallback) == ("native", ("compiled", "eager"))
    explicit = resolved(decode_kernel="native")
    assert (explicit.decode_kernel, explicit.decode_fallback) == ("native", ())
    assert resolved(decode_kernel="compiled").decode_fallback == ()
    monkeypatch.setenv("RADIXSERVE_NATIVE", "0")  # no C++ kernels: the compiled path (torch's own compiler) next
    assert (resolved().decode_kernel, resolved().decode_fallback) == ("compiled", ("eager",))
    monkeypatch.setenv("PATH", "/nonexistent")  # no compiler at all: torch.compile cannot build either
    monkeypatch.delenv("CXX", raising=False)
    assert (resolved().decode_kernel, resolved().decode_fallback) == ("eager", ())


def _runner(path, **kw) -> ModelRunner:
    cfg = ModelConfig.from_hf(*load_configs(path))
    return ModelRunner(cfg, path, dtype="float32", num_slots=256, decode_kernel="native", **kw)


def test_a_native_step_that_fails_to_build_falls_back_under_auto_only(tiny_models, monkeypatch, tmp_path):
    if unavailable_reason("float32") is not None:
        pytest.skip(f"no native step here: {unavailable_reason('float32')}")
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that fails: what a missing omp.h or -march looks like
    runner = _runner(tiny_models["llama"], decode_fallback=("eager",))
    assert runner.decode_kernel == "eager" and runner.native is None
    assert "compiling decode.cpp with false failed" in runner.decode_refused["native"]
    with pytest.raises(RuntimeError, match="cannot run here .*compiling decode.cpp"):
        _runner(tiny_models["llama"])  # --decode-kernel native, asked for by name


def test_the_server_serves_when_the_native_build_fails(tiny_models, monkeypatch, tmp_path):
    from radixserve.server_process import ServerProcess

    if unavailable_reason("float32") is not None:
        pytest.skip(f"no native step here: {unavailable_reason('float32')}")
    monkeypatch.delenv("RADIXSERVE_DISABLE_COMPILE", raising=False)
    monkeypatch.setenv("CXX", "false")  # what a missing omp.h, a refused -march or a broken toolchain look like
    server = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32")
    try:
        runner = httpx.get(server.url + "/get_server_info").json()["actors"]["runner"]
        # the compiler fails torch.compile too: the server serves eager, and says why
        assert runner["decode_kernel"] == "eager", runner
        assert "compiling decode.cpp" in runner["decode_refused"]["native"] and "compiled" in runner["decode_refused"]
        out = httpx.post(server.url + "/generate", json={"text": "Hello", "sampling_params": {
            "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}, timeout=120).json()
        assert out["meta_info"]["completion_tokens"] == 4
    finally:
        server.stop()


def test_libraries_are_cached_per_cpu(tmp_path, monkeypatch):
    here = cpp_build.build_library(invariant.SOURCE, invariant.FLAGS, tmp_path, "probe")
    assert cpp_build.build_library(invariant.SOURCE, invariant.FLAGS, tmp_path, "probe") == here
    monkeypatch.setattr(cpp_build, "cpu_identity", lambda: "model name: another CPU\nflags: sse2 avx2")
    other = cpp_build.build_library(invariant.SOURCE, invariant.FLAGS, tmp_path, "probe")
    assert other != here and other.exists(), "another CPU gets a library of its own"


def test_a_build_that_cannot_be_cached_says_why(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(cpp_build.NativeUnavailable, match=r"cannot use .*file/kernels for the C\+\+ kernels"):
        cpp_build.build_library(invariant.SOURCE, invariant.FLAGS, blocker / "kernels", "probe")


def test_the_switch_turns_every_cpp_kernel_off(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_NATIVE", "0")
    assert "RADIXSERVE_NATIVE=0" in unavailable_reason("float32")
    with pytest.raises(cpp_build.NativeUnavailable, match="RADIXSERVE_NATIVE=0"):
        cpp_build.build_library(invariant.SOURCE, invariant.FLAGS, cpp_build.default_cache_dir(), "probe")
