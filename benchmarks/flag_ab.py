"""Decode tok/s of the same model served under different flags, the servers taking turns round by round (the order
flipping each round), so both see the same noise: for a change smaller than this machine's run-to-run spread.
Each round is ``real_shapes.decode_rate`` (the extra tokens of a long request over its extra time) at the given
batch. Prints each round, then per variant the median tok/s and the median of its per-round ratio to the first
variant; writes a PNG of the rounds.

    python benchmarks/flag_ab.py [--rounds 12] [--batch 1] [--model-path P] -- VARIANT [VARIANT ...]

each VARIANT the flags of one server, quoted ('' for none), after ``--``, e.g.
``--model-path ~/.cache/radixserve/shapes/llama-3.2-1b/model-q4_k_m.gguf -- '--disable-overlap-schedule' ''``
(a GGUF file is served with ``--quantization gguf``).
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_shapes  # noqa: E402
from cpu_peer import Ours  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="+", help="one server's flags each, quoted ('' for none)")
    ap.add_argument("--model-path", default=None, help="default: the bundled model")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64, help="the extra tokens each round times")
    ap.add_argument("--png", default="benchmarks/results/flag_ab.png")
    args = ap.parse_args()
    base = [] if args.model_path is None else ["--model-path", args.model_path] + (
        ["--quantization", "gguf"] if args.model_path.endswith(".gguf") else [])
    variants = [shlex.split(v) for v in args.variants]
    servers = []
    try:
        for flags in tqdm(variants, desc="starting servers"):
            servers.append(Ours(base + ["--max-total-tokens", "8192"] + flags))
        for s in servers:  # warm-up: the first requests set up kernels and pools
            real_shapes.timed_batch(s, real_shapes.prompts(2, 16, 0), 4)
        rates: list[list[float]] = [[] for _ in servers]
        for r in tqdm(range(args.rounds), desc="rounds"):
            for i in (range(len(servers)) if r % 2 == 0 else reversed(range(len(servers)))):
                rates[i].append(real_shapes.decode_rate(servers[i], args.batch, args.tokens, r))
            tqdm.write(f"round {r}: " + " | ".join(f"{x[-1]:.1f}" for x in rates))
    finally:
        for s in servers:
            s.stop()
    names = [" ".join(v) or "(no flags)" for v in variants]
    print(f"\n| flags | median tok/s (batch {args.batch}) | median of the per-round ratio to the first |")
    print("|---|---|---|")
    for name, rr in zip(names, rates):
        ratio = statistics.median(a / b for a, b in zip(rr, rates[0]))
        print(f"| {name} | {statistics.median(rr):.1f} | {ratio:.3f}x |")
    plot(names, rates, args)


def plot(names: list[str], rates: list[list[float]], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, rr in zip(names, rates):
        ax.plot(range(len(rr)), rr, marker="o", label=name)
    ax.set_xlabel("round (servers taking turns)")
    ax.set_ylabel(f"decode tok/s, batch {args.batch}")
    ax.set_title(Path(args.model_path).name if args.model_path else "the bundled model")
    ax.legend()
    fig.tight_layout()
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
