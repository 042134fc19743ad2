"""Where a decode step's time goes: the torch profiler over a few decode steps of the model runner, ops sorted by
their own time (the profiler inflates small ops; read shares, not absolute times).

    python benchmarks/profile_decode.py [--batch 1] [--prompt 128] [--steps 10] [--rows 25]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from forward_speed import Ours, prompt_ids  # noqa: E402
from radixserve import Engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args()
    engine = Engine(args.model_path, max_total_tokens=args.batch * (args.prompt + 2 * args.steps + 16) + 4096)
    ours = Ours(engine)
    ours.decode(args.batch, args.prompt, 8, 0)  # warm-up: oneDNN sets up its kernels on first use
    for i in range(args.batch):
        ours._add(prompt_ids(args.prompt, 1000 + i), args.steps + 2)
    while len(ours.sched.running) < args.batch:
        ours.sched.process(ours.runner.forward(ours.sched.schedule()))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            ours.sched.process(ours.runner.forward(ours.sched.schedule()))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    ops = prof.key_averages()
    linear = sum(e.self_cpu_time_total for e in ops if "linear" in e.key or e.key == "aten::mm")
    total = sum(e.self_cpu_time_total for e in ops)
    print(f"per step (batch {args.batch}, {args.prompt}-token prompts): {total / args.steps / 1e3:.1f} ms of op "
          f"time, of which linear layers {linear / args.steps / 1e3:.1f} ms, everything else "
          f"{(total - linear) / args.steps / 1e3:.1f} ms in {sum(e.count for e in ops) // args.steps} profiled op "
          "calls, nested ones included")
    engine.shutdown()


if __name__ == "__main__":
    main()
