"""The machine's own limits, measured in the same run as everything else: bf16 matmul FLOP/s and memory copy
bandwidth; the model's FLOPs per prefill token and weight bytes per decoded token; the scheduler + IPC cost of
a decode step with a runner that computes nothing."""
from __future__ import annotations

import ctypes
import functools
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from ipc_cost import Echo
from radixserve.actors.scheduler import Scheduler, SchedulerConfig
from radixserve.actors.scheduler.actor import take_tokens
from radixserve.cache import CacheManager
from radixserve.kernels import cpu_native
from radixserve.kernels.cpp_build import NativeUnavailable, build_library, default_cache_dir
from radixserve.policies.eviction import LRU
from radixserve.policies.schedule import FCFS
from radixserve.sampling_params import SamplingParams
from radixserve.wire.messages import Delta, TextBatch
from radixserve.wire.plans import ForwardPlan, ForwardResult


def timed(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def matmul_peak(dtype: torch.dtype = torch.bfloat16) -> float:
    """Best FLOP/s of large GEMMs (square, and shaped like the model's prefill)."""
    best = 0.0
    for m, k, n in ((2048, 2048, 2048), (2048, 576, 3072), (2048, 1536, 576)):
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
        best = max(best, 2 * m * k * n / timed(lambda: torch.nn.functional.linear(a, b)))
    return best


def copy_bandwidth() -> float:
    """Bytes read + written per second copying 256 MB (touched memory, no zero-page shortcuts)."""
    x = torch.randn(64 * 2**20)
    y = torch.empty_like(x).normal_()
    return 2 * x.numel() * x.element_size() / timed(lambda: y.copy_(x))


READ_PROBE = Path(__file__).with_name("read_probe") / "read_probe.cpp"
READ_RUNS = (1, 2, 4, 8)  # runs read side by side by each thread of the native reader


@functools.cache
def native_reader():
    """read_probe.cpp's ``rs_read(pointer, bytes, runs)``, built for this machine; None where no C++ builds here."""
    try:
        path = build_library(READ_PROBE, cpu_native.FLAGS, default_cache_dir() / "kernels", "read_probe")  # as the kernels
    except NativeUnavailable:
        return None
    read = ctypes.CDLL(str(path)).rs_read
    read.restype, read.argtypes = ctypes.c_float, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return read


def read_probe() -> str:
    """How read_bandwidth reads, as a report names it."""
    if native_reader() is None:
        return "torch's sum"
    return f"the best of torch's sum and a native reader of {'/'.join(map(str, READ_RUNS))} runs a thread"


def read_bandwidth() -> float:
    """Bytes read per second over 512 MB: a decode step's limit, which reads its weights and writes next to
    nothing (a copy's rate, counting what it reads and writes, is lower on this kind of machine: 26 GB/s against
    33 on a 2-core Zen 3). The best of torch's sum and the native reader (read_probe.cpp) at 1-8 runs a thread:
    torch's sum alone, one run a thread, leaves the memory short of requests (21 GB/s on a 2-core Xeon where 2
    threads x 4 runs read 28), and a decode step reading several blocks of weights at once outran it."""
    x = torch.randn(128 * 2**20)
    nbytes = x.numel() * x.element_size()
    readers = [x.sum]
    if read := native_reader():
        readers += [functools.partial(read, x.data_ptr(), nbytes, runs) for runs in READ_RUNS]
    return max(nbytes / timed(reader) for reader in readers)


def model_costs(cfg, bytes_per_weight: int = 2) -> dict:
    """FLOPs per token of the linear layers (prefill adds attention, see prefill_flops) and weight bytes read
    per decode step."""
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    per_layer = h * (q + 2 * kv) + q * h + h * 2 * i + i * h
    params = cfg.num_layers * per_layer + h * cfg.vocab_size
    return {"linear_params": params, "flops_per_token": 2 * params, "decode_weight_bytes": params * bytes_per_weight,
            "attention_flops_per_token_per_position": 4 * cfg.num_layers * q}


def prefill_flops_per_token(costs: dict, length: int) -> float:
    """Linear FLOPs plus causal attention over on average length/2 earlier positions."""
    return costs["flops_per_token"] + costs["attention_flops_per_token_per_position"] * length / 2


class NullRunner:
    """Answers every plan at once: token 7 for whoever samples."""

    def forward(self, plan: ForwardPlan) -> ForwardResult:
        sample = np.frombuffer(plan.sample, np.uint8)
        return ForwardResult(plan.step, [7] * int(sample.sum()))


def scheduler_overhead(batch: int, prompt: int = 128, steps: int = 200) -> dict:
    """Seconds per decode step spent outside the model: the scheduler core (plan + process) and the IPC hops
    of the step's messages (plan to the runner, result back, tokens to the tokenizer, text to the api)."""
    cfg = SchedulerConfig(context_length=8192, vocab_size=50000, eos_ids=frozenset({2}), max_running_requests=256)
    sched = Scheduler(cfg, CacheManager(batch * (prompt + steps + 8) + 64, LRU()), FCFS())
    runner = NullRunner()
    for i in range(batch):
        sched.add_request(f"r{i}", [100 + i] + [5] * (prompt - 1), SamplingParams(max_new_tokens=steps + 4,
                                                                                  ignore_eos=True))
    while len(sched.running) < batch:
        sched.process(runner.forward(sched.schedule()))
    plan = result = None
    start = time.perf_counter()
    for _ in range(steps):
        plan = sched.schedule()
        result = runner.forward(plan)
        updated = sched.process(result)
        tokens = take_tokens(updated)
    core = (time.perf_counter() - start) / steps
    text = TextBatch([Delta(r.rid, " word", [7], prompt, len(r.output_ids), 0) for r in updated])
    with Echo() as echo:
        hops = {name: echo.hop(msg, 200) for name, msg in
                (("plan", plan), ("result", result), ("tokens", tokens), ("text", text))}
    return {"batch": batch, "scheduler_s": core, **{f"hop_{k}_s": v for k, v in hops.items()},
            "total_s": core + sum(hops.values())}

