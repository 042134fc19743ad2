"""CPU time each of the server's processes spends per generated token at batch 1: the runner's, and what the
api, tokenizer and scheduler take from the same cores.

    python benchmarks/actor_cpu.py [--tokens N] [--rounds R] [-- SERVER FLAGS...]

e.g. ``-- --model-path ~/.cache/radixserve/shapes/llama-3.2-1b/model-q4_k_m.gguf --quantization gguf`` (default:
the default model). One request at a time, a whole (non-streamed) result and a stream of the same length, taking
turns; per process its user + system CPU seconds (all threads: zmq's I/O thread too) from /proc over the request,
divided by the tokens generated. When the runner has as many threads as the machine has cores (2 threads on 2
cores here), every millisecond another process runs during a step is taken from one of the runner's threads,
which the other then waits for at the step's next barrier.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_peer import Ours, stream_rate  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid``, all its threads (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def processes(server: Ours) -> dict[str, int]:
    """The api (the launcher's own process) and every actor, by name."""
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    return {"api": server.server.proc.pid, **{name: a["pid"] for name, a in info["actors"].items()}}


def one(server: Ours, pids: dict[str, int], tokens: int, stream: bool) -> dict[str, float]:
    """CPU milliseconds per token of each process over one request of ``tokens`` tokens, and its tok/s."""
    body = server.body("The history of the printing press", tokens, stream)
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    start = time.perf_counter()
    if stream:
        stream_rate(server.url, body, server.path)
    else:
        httpx.post(server.url + server.path, json=body, timeout=1800).raise_for_status()
    wall = time.perf_counter() - start
    return {**{name: 1e3 * (cpu_seconds(pid) - before[name]) / tokens for name, pid in pids.items()},
            "tok/s": tokens / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("flags", nargs="*", help="the server's flags (after --)")
    args = ap.parse_args()
    server = Ours(args.flags)
    try:
        pids = processes(server)
        one(server, pids, 16, False)  # warm
        runs: dict[str, list[dict[str, float]]] = {"whole": [], "stream": []}
        for _ in range(args.rounds):
            for mode in runs:
                runs[mode].append(one(server, pids, args.tokens, mode == "stream"))
    finally:
        server.stop()
    columns = [*pids, "others", "tok/s"]
    print(f"CPU ms per token, batch 1, {args.tokens} tokens, median of {args.rounds} (others: all but the runner)")
    print(f"{'':8s}" + "".join(f"{c:>11s}" for c in columns))
    for mode, rows in runs.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        med["others"] = sum(v for k, v in med.items() if k not in ("tok/s",) and not k.startswith("runner"))
        print(f"{mode:8s}" + "".join(f"{med[c]:11.3f}" for c in columns))


if __name__ == "__main__":
    main()
