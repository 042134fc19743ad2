"""A prefill (extend) step of requests whose new tokens sit on one cached prefix (issue 32): the model's engine
caches a ``--prefix``-token prompt (0: fresh prompts), then each case's requests (``--cases``: requests x new
tokens) add new tokens of their own to it in one step, and that step is timed three ways on the same batch, interleaved:

- torch: the eager model (per-request SDPA, each request gathering the prefix's K/V itself; oneDNN's products);
- native, per row: the native step, every token row scoring its whole context itself;
- native, grouped: the native step, the prefix scored once for every row of the group (``prefix_groups``).

Medians of ``--reps`` rounds. Prints a table, one line per (requests, new tokens) case; the last columns say
whether ``NativeDecode.applies`` would send that step to the native step, and its cost as the budget counts it
(model/prefix_groups.py).

    python benchmarks/shared_extend.py [--prefix 860] [--cases 31x32,8x32,1x128,1x512] [--reps 5]
        [--model-path PATH]  (default: the bundled model; e.g. a real shape's checkpoint, shape_models.py)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from forward_speed import Ours, prompt_ids  # noqa: E402
from radixserve import Engine  # noqa: E402
from radixserve.model.forward_batch import ForwardBatch  # noqa: E402


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", type=int, default=860)
    ap.add_argument("--cases", default="31x32,8x32,4x64,1x128,1x512", help="requests x new tokens, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model-path", default=None, help="default: the bundled model")
    args = ap.parse_args()
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    most = max(r * n for r, n in cases)
    engine = Engine(args.model_path, dtype=args.dtype, max_total_tokens=args.prefix + 2 * most + 4096,
                    chunked_prefill_size=max(8192, most + 64), max_prefill_tokens=max(16384, most + 64))
    native, runner = engine.runner.native, engine.runner
    if native is None:
        sys.exit("the native step does not run here: nothing to compare")
    ours = Ours(engine)
    common = prompt_ids(args.prefix, 99)
    print(f"{args.prefix}-token cached prefix, {native.isa}{', AMX' if native.amx else ''}, {native.dtype}; "
          f"ms per extend step, median of {args.reps}")
    print(f"{'requests x new':>15} {'torch':>9} {'per row':>9} {'grouped':>9} {'torch/grouped':>14} {'takes':>6} "
          f"{'cost':>9}")
    for requests, new in cases:
        if common:
            ours._add(common, 1)  # the prefix cached
        while ours.sched.has_work:
            ours.sched.process(runner.forward(ours.sched.schedule()))
        for i in range(requests):
            ours._add(common + prompt_ids(new, 1000 + i), 1)
        plan = ours.sched.schedule()
        assert plan.batch_size == requests and list(plan.extend_lens) == [new] * requests, plan.extend_lens
        # one batch for all three: with torch's attention metadata (the native step reads the slots alone)
        batch = ForwardBatch.from_plan(plan, runner.kv, runner.rope, runner.attn, runner.dtype, runner.device,
                                       runner._group, runner.table, local_rope=runner.local_rope,
                                       windows=runner.cfg.arch.sliding_windows)
        taken = native.applies(batch)
        slots, first, length = batch.attn.tree_contexts(native.window)
        cost = native.cost(length, native._groups(slots, first, length))  # what the budget is set against
        times: dict[str, list[float]] = {"torch": [], "per row": [], "grouped": []}
        with torch.inference_mode():
            for _ in range(args.reps + 1):
                times["torch"].append(timed(lambda: runner.model(batch)))
                native.shares = False
                times["per row"].append(timed(lambda: native(batch)))
                native.shares = True
                times["grouped"].append(timed(lambda: native(batch)))
        ms = {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}
        print(f"{f'{requests} x {new}':>15} {ms['torch']:9.1f} {ms['per row']:9.1f} {ms['grouped']:9.1f} "
              f"{ms['torch'] / ms['grouped']:13.2f}x {'yes' if taken else 'no':>6} {cost / 1e3:8.0f}k")
        ours.sched.process(runner.forward(plan))
        ours._drain()
    engine.shutdown()


if __name__ == "__main__":
    main()
