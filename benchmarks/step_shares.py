"""Where a decode step's time goes at 32 rows on a shared prefix (issue 32): the bundled model's engine decodes 32
requests on one cached ~860-token prompt, and each part is timed on the same shapes:

- scheduler: ``schedule()`` + ``process()`` of a step (Python);
- runner outside the native call: ``forward()`` minus the native step (embedding lookup, Step structure, sampling);
- projections: every layer's qkv / o / gate_up / down product and the output projection of the 32 rows, each alone
  through the kernel (``rs_linear``, the step's own product) on random inputs;
- attention: one layer's attention of the 32 rows over their contexts (the prefix scored once for the group),
  alone (``rs_attention``) on a pool laid out as the engine's, times the layers;
- the rest of the native step: the whole step minus those two -- norms, RoPE, KV stores, SiLU, barriers, and what
  the parts alone do not pay: inside the step each layer's weights and the pool come from memory, not from the
  cache a part timed alone over and over keeps them in (``perf record`` of the step divides it by function).

Medians of the steps (``--steps``), best of 5 for the parts. Prints a table.

    python benchmarks/step_shares.py [--rows 32] [--prefix 860] [--steps 30]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from forward_speed import Ours, prompt_ids  # noqa: E402
from radixserve import Engine  # noqa: E402
from radixserve.kernels import cpu_native  # noqa: E402
from radixserve.model.native_decode import NativeDecode  # noqa: E402


def best(run, reps: int = 10) -> float:
    run()
    out = 1e9
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            run()
        out = min(out, (time.perf_counter() - start) / reps)
    return out


def products(native: NativeDecode, rows: int) -> float:
    """Seconds of every product of a step of ``rows`` rows, each alone through the kernel."""
    lib, desc, dtype = native.lib, native.desc, native.dtype
    layer = desc.layer[0]
    total = 0.0
    for lin, times in ((layer.qkv, desc.layers), (layer.o, desc.layers), (layer.gate_up, desc.layers),
                       (layer.down, desc.layers), (desc.lm_head, 1)):
        x = torch.randn(rows, lin.k).to(dtype)
        y = torch.empty(rows, lin.n, dtype=dtype)
        scratch = torch.empty(cpu_native.linear_scratch_bytes(rows, lin.k), dtype=torch.uint8)
        total += times * best(lambda: lib.rs_linear(ctypes.byref(lin), int(dtype == torch.bfloat16), x.data_ptr(),
                                                    rows, y.data_ptr(), int(desc.amx), scratch.data_ptr()))
    return total


def attention(native: NativeDecode, rows: int, prefix: int, own: int) -> float:
    """Seconds of a step's attention: one layer's, the rows sharing ``prefix`` slots plus ``own`` each, times the
    layers (slots in runs, as the pool hands them out)."""
    lib, desc, dtype = native.lib, native.desc, native.dtype
    kv, d = desc.kv_heads, desc.head_dim
    total = prefix + rows * own + 1
    g = torch.Generator().manual_seed(0)
    k_pool = torch.randn(total, kv, d, generator=g).to(dtype)
    v_pool = torch.randn(total, kv, d, generator=g).to(dtype)
    shared = torch.arange(1, prefix + 1)
    slots = torch.cat([torch.cat([shared, prefix + 1 + m * own + torch.arange(own)]) for m in range(rows)])
    lengths = torch.full((rows,), prefix + own, dtype=torch.int64)
    starts = lengths.cumsum(0) - lengths
    qkv = torch.randn(rows, (desc.heads + 2 * kv) * d, generator=g).to(dtype)
    layers = (cpu_native.Layer * 1)(cpu_native.Layer(k_pool=k_pool.data_ptr(), v_pool=v_pool.data_ptr()))
    model = cpu_native.Model(bf16=desc.bf16, layers=1, hidden=desc.hidden, heads=desc.heads, kv_heads=kv,
                             head_dim=d, inter=desc.inter, vocab=desc.vocab, amx=desc.amx, eps=desc.eps,
                             scale=desc.scale, layer=layers)
    groups = cpu_native.PrefixGroups(rows, [list(range(rows))] if native.shares else [],
                                     [prefix] if native.shares else [])
    scratch = torch.empty(lib.rs_scratch_bytes(ctypes.byref(model), rows, len(groups), groups.slots()),
                          dtype=torch.uint8)
    step = cpu_native.Step(rows=rows, **groups.fields(), slots=slots.data_ptr(), starts=starts.data_ptr(),
                           lens=lengths.data_ptr(), scratch=scratch.data_ptr(), scratch_bytes=scratch.numel())
    out = torch.empty(rows, desc.heads * d, dtype=dtype)
    if lib.rs_attention(ctypes.byref(model), 0, ctypes.byref(step), qkv.data_ptr(), out.data_ptr()) != 0:
        raise RuntimeError("the attention refused its scratch")
    return desc.layers * best(lambda: lib.rs_attention(ctypes.byref(model), 0, ctypes.byref(step), qkv.data_ptr(),
                                                       out.data_ptr()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=860)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--model-path", default=None, help="the bundled model unless given (a GGUF file takes "
                    "--quantization gguf)")
    ap.add_argument("--quantization", default=None)
    args = ap.parse_args()
    engine = Engine(args.model_path, quantization=args.quantization,
                    max_total_tokens=args.rows * (args.steps + 64) + args.prefix + 4096)
    native = engine.runner.native
    if native is None:
        sys.exit("the native decode step does not run here: nothing to divide")
    ours = Ours(engine)
    ours.decode(args.rows, 16, 4, 0, shared_prefix=args.prefix)  # warm-up
    native_times: list[float] = []
    call = NativeDecode.__call__

    def timed(self, batch):
        start = time.perf_counter()
        out = call(self, batch)
        native_times.append(time.perf_counter() - start)
        return out

    NativeDecode.__call__ = timed
    common = prompt_ids(args.prefix, 99)
    for i in range(args.rows):
        ours._add(common + prompt_ids(16, 100 + i), args.steps + 4)
    while len(ours.sched.running) < args.rows:
        ours.sched.process(ours.runner.forward(ours.sched.schedule()))
    native_times.clear()
    sched, fwd = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        plan = ours.sched.schedule()
        t1 = time.perf_counter()
        result = ours.runner.forward(plan)
        t2 = time.perf_counter()
        ours.sched.process(result)
        sched.append(t1 - t0 + time.perf_counter() - t2)
        fwd.append(t2 - t1)
    NativeDecode.__call__ = call
    steps_shared = native.shared_steps
    ours._drain()
    step, whole = statistics.median(fwd), statistics.median(native_times)
    prod, attn = products(native, args.rows), attention(native, args.rows, args.prefix, 16 + args.steps // 2)
    engine.shutdown()
    parts = [("projections (rs_linear, each alone)", prod), ("attention (rs_attention, one layer x layers)", attn),
             ("rest of the native step (and memory the parts alone skip)", whole - prod - attn), ("runner outside the native step", step - whole),
             ("scheduler (schedule + process)", statistics.median(sched))]
    total = step + statistics.median(sched)
    print(f"{args.rows} rows on a {args.prefix}-token shared prefix, {native.isa}{', AMX' if native.amx else ''}, "
          f"{native.dtype}; shared-prefix steps {steps_shared}; a step: {total * 1e3:.1f} ms")
    for name, seconds in parts:
        print(f"  {name:58s} {seconds * 1e3:7.1f} ms  {seconds / total:6.1%}")


if __name__ == "__main__":
    main()
