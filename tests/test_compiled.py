"""Compiled decode (model/compiled.py): the same greedy tokens as eager in float32 at batch 1 and in batches, a shape
without a graph falls back to eager instead of compiling on a request's path, and the server reports it.
(HF parity on the compiled path: tests/test_engine_parity.py, ``decode=compiled``.)"""
from __future__ import annotations

import random

import httpx
import pytest
import torch

from radixserve import Engine
from radixserve.kernels.cpu_native import unavailable_reason
from radixserve.server_args import ServerArgs

PARAMS = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Unrelated prompts of different lengths: the batch takes the plain decode path (no shared prefix)."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


@pytest.fixture()
def compiled_engine(tiny_models, monkeypatch):
    monkeypatch.delenv("RADIXSERVE_DISABLE_COMPILE", raising=False)
    engine = Engine(str(tiny_models["llama"]), dtype="float32", check_invariants=True, decode_kernel="compiled")
    # its graphs are guarded on the thread count they were compiled at: it never adapts (or they would be missed)
    assert engine.runner.threads is not None and engine.runner.threads.adaptive is None
    yield engine
    engine.shutdown()


class _Spy:
    """Stands in for the runner's CompiledDecode and records the size of every batch it runs."""

    def __init__(self, compiled) -> None:
        self.compiled, self.sizes = compiled, []

    def applies(self, batch) -> bool:
        return self.compiled.applies(batch)

    def __call__(self, batch):
        self.sizes.append(len(batch.input_ids))
        return self.compiled(batch)


def test_compiled_batches_match_eager(compiled_engine, tiny_models):
    prompts = _prompts(6)
    eager = Engine(str(tiny_models["llama"]), dtype="float32", disable_compile=True)
    assert eager.runner.compiled is None
    want = [r["output_ids"] for r in eager.generate(input_ids=prompts, sampling_params=PARAMS)]
    eager.shutdown()
    compiled = compiled_engine.runner.compiled
    assert compiled.compile_seconds > 0
    spy = compiled_engine.runner.compiled = _Spy(compiled)
    got = [r["output_ids"] for r in compiled_engine.generate(input_ids=prompts, sampling_params=PARAMS)]
    assert got == want
    assert max(spy.sizes) == len(prompts), "the batch decoded through the compiled layers"
    alone = compiled_engine.generate(input_ids=prompts[0], sampling_params=PARAMS)["output_ids"]
    assert alone == want[0] and 1 in spy.sizes
    assert not compiled.eager_sizes


def test_a_missing_graph_runs_eager_and_is_never_compiled_on_the_request_path(compiled_engine, tiny_models):
    prompts = _prompts(3, seed=1)
    want = [r["output_ids"] for r in compiled_engine.generate(input_ids=prompts, sampling_params=PARAMS)]
    compiled = compiled_engine.runner.compiled
    steps = compiled.steps
    torch._dynamo.reset()  # every graph gone: a step would have to compile
    again = [r["output_ids"] for r in compiled_engine.generate(input_ids=prompts, sampling_params=PARAMS)]
    assert again == want
    assert compiled.eager_sizes, "the batch sizes without a graph are recorded and run eager"
    assert compiled.steps == steps, "nothing compiled while serving"


def test_compile_is_resolved_off_where_it_does_not_apply(monkeypatch):
    monkeypatch.delenv("RADIXSERVE_DISABLE_COMPILE", raising=False)

    def kernel(**kw) -> str:
        args = ServerArgs(**kw).resolved(kv_values_per_token=2 * 2 * 64, model_context=2048)
        assert args.disable_compile is (args.decode_kernel == "eager")
        return args.decode_kernel

    native = unavailable_reason("bfloat16") is None
    assert kernel(device="cpu") == ("native" if native else "compiled")
    assert kernel(device="cpu", decode_kernel="compiled") == "compiled"
    assert kernel(device="cpu", dtype="float16") == "compiled"  # the native step runs bf16 and fp32 weights
    assert kernel(device="cpu", quantization="int8") == ("native" if native else "compiled")
    assert kernel(device="cpu", disable_compile=True) == "eager"
    assert kernel(device="cpu", deterministic=True) == "eager"  # its own invariant kernels are the promise
    assert kernel(device="cuda", max_total_tokens=1024) == "eager"  # CPU kernels only
    for bad, message in (({"decode_kernel": "native", "dtype": "float16"}, "runs bfloat16 and float32"),
                         ({"decode_kernel": "native", "disable_compile": True}, "contradicts"),
                         ({"decode_kernel": "compiled", "deterministic": True}, "cannot be combined"),
                         ({"decode_kernel": "fast"}, "is not one of")):
        with pytest.raises(ValueError, match=message):
            kernel(device="cpu", **bad)
    monkeypatch.setenv("RADIXSERVE_DISABLE_COMPILE", "1")  # test runs: no torch.compile, the native step stays
    assert kernel(device="cpu") == ("native" if native else "eager")
    assert kernel(device="cpu", dtype="float16") == "eager"
    with pytest.raises(ValueError, match="RADIXSERVE_DISABLE_COMPILE=1"):
        kernel(device="cpu", decode_kernel="compiled")
    monkeypatch.setenv("RADIXSERVE_DECODE_KERNEL", "eager")  # the default of --decode-kernel
    assert kernel(device="cpu") == "eager"


def test_server_reports_its_decode_kernel(tiny_models, monkeypatch):
    from radixserve.server_process import ServerProcess

    monkeypatch.delenv("RADIXSERVE_DISABLE_COMPILE", raising=False)
    native = "native" if unavailable_reason("float32") is None else "compiled"
    for flags, expected in (([], native), (["--disable-compile"], "eager")):
        server = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32", *flags)
        try:
            info = httpx.get(server.url + "/get_server_info").json()
            assert info["actors"]["runner"]["decode_kernel"] == expected
            out = httpx.post(server.url + "/generate", json={"text": "Hello", "sampling_params": PARAMS}).json()
            assert out["meta_info"]["completion_tokens"] == PARAMS["max_new_tokens"]
        finally:
            server.stop()


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "qwen3"])
def test_compiled_decode_of_windowed_softcapped_models_equals_eager(kind, arch_models, monkeypatch):
    """Sliding and global layers (one graph each), soft-capped scores, Gemma 3's second RoPE table: the compiled
    decode steps give eager's greedy tokens (which equal HF's: test_architectures.py), alone and batched, and no
    batch size falls back to eager."""
    monkeypatch.delenv("RADIXSERVE_DISABLE_COMPILE", raising=False)
    prompts = _prompts(3, seed=2)
    with Engine(str(arch_models[kind]), dtype="float32", disable_compile=True) as eager:
        want = [r["output_ids"] for r in eager.generate(input_ids=prompts, sampling_params=PARAMS)]
    with Engine(str(arch_models[kind]), dtype="float32", decode_kernel="compiled") as engine:
        got = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=PARAMS)]
        alone = engine.generate(input_ids=prompts[0], sampling_params=PARAMS)["output_ids"]
        compiled = engine.runner.compiled
    assert got == want and alone == want[0]
    assert compiled.steps >= 2 * PARAMS["max_new_tokens"] - 2 and not compiled.eager_sizes
