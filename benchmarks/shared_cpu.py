"""One-stream decode on a shared CPU: the default kernel (the native decode step) with the machine to itself, and
with one busy neighbour (``python -c "while True: pass"``, started and killed here), before and after the runner
chose its threads from its CPU budget and told OpenMP to sleep at barriers (radixserve/cpu_budget.py).

Four systems, all up at once and taking turns (an idle one costs no CPU), each in a fresh process:

- the server now (its defaults) and the server as before: libgomp's default spin (``GOMP_SPINCOUNT=300000``, what
  an unset OMP_WAIT_POLICY means; an explicit setting is left alone) and ``--num-threads`` = every CPU in the mask;
- the Engine (in-process runner, no other actors) now and as before, the same way.

Each round measures every system idle, then every system with the neighbour running; the order flips each round.
Decode tokens/s of one greedy stream: completion tokens after the first over the time after the first (prefill out
of it). Results go to ``benchmarks/results/shared_cpu/results.json`` (committed; REPORT.md's section is built
from it).

    python benchmarks/shared_cpu.py [--quick] [--model-path P]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from tqdm import tqdm

from radixserve.server_process import ServerProcess

RESULTS = Path("shared_cpu") / "results.json"  # under benchmarks/results: committed, unlike results.json
PROMPT = "Write a long story about a lighthouse keeper and the sea."
IDLE_TOKENS, BUSY_TOKENS = 96, 48
BEFORE_ENV = {"GOMP_SPINCOUNT": "300000"}  # libgomp's default spin when OMP_WAIT_POLICY is unset
NEIGHBOUR = [sys.executable, "-c", "while True: pass"]
IDLE_TARGET, BUSY_TARGET = 0.95, 0.40  # now / before idle; busy / idle now


def _rate(stamps: list[tuple[float, int]]) -> float:
    """Decode tokens/s from (time, completion tokens so far) of each streamed event."""
    stamps = [s for s in stamps if s[1] > 0]
    (t0, n0), (t1, n1) = stamps[0], stamps[-1]
    return (n1 - n0) / (t1 - t0)


class Server:
    def __init__(self, env: dict[str, str], flags: list[str]) -> None:
        self.proc = ServerProcess("--max-total-tokens", "4096", *flags, env=env)
        runner = httpx.get(self.proc.url + "/get_server_info").json()["actors"]["runner"]
        self.info = {"threads": runner["threads"], "omp_wait": runner["omp_wait"]}

    def rate(self, tokens: int) -> float:
        body = {"text": PROMPT, "stream": True,
                "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
        stamps = []
        with httpx.stream("POST", self.proc.url + "/generate", json=body, timeout=900) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    stamps.append((time.perf_counter(), json.loads(line[6:])["meta_info"]["completion_tokens"]))
        return _rate(stamps)

    def stop(self) -> None:
        self.proc.stop()


class EngineWorker:
    """An Engine in a fresh interpreter (torch not yet loaded there), driven over stdin/stdout by ``worker()``."""

    def __init__(self, env: dict[str, str], kwargs: dict) -> None:
        code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import shared_cpu; shared_cpu.worker()"
        self.proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(kwargs)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env={**os.environ, **env})
        self.info = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):  # anything else a library printed is not ours
                return json.loads(line)
        raise RuntimeError(f"the Engine worker exited with {self.proc.wait()}")

    def rate(self, tokens: int) -> float:
        self.proc.stdin.write(f"{tokens}\n")
        self.proc.stdin.flush()
        return self._read()["tok_s"]

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def worker() -> None:
    """The Engine side of EngineWorker: a JSON line with its threads, then one rate per requested token count."""
    from radixserve import Engine

    engine = Engine(**json.loads(sys.argv[1]))
    import torch  # already loaded by the Engine: asked only for the thread count it runs on

    from radixserve.cpu_budget import wait_policy

    print(json.dumps({"threads": torch.get_num_threads(), "omp_wait": wait_policy(os.environ)}), flush=True)
    params = {"temperature": 0, "ignore_eos": True}
    for line in sys.stdin:
        stamps = [(time.perf_counter(), out["meta_info"]["completion_tokens"])
                  for out in engine.generate(PROMPT, {**params, "max_new_tokens": int(line)}, stream=True)]
        print(json.dumps({"tok_s": _rate(stamps)}), flush=True)
    engine.shutdown()


@contextmanager
def neighbour() -> Iterator[None]:
    proc = subprocess.Popen(NEIGHBOUR)
    time.sleep(0.5)  # running, not starting up
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def machine() -> dict:
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    return {"cpu": model, "cpus_in_mask": len(os.sched_getaffinity(0)), "commit": commit,
            "load_average_at_start": os.getloadavg()[0]}


def measure(quick: bool = False, model_path: str | None = None) -> dict:
    cpus = str(len(os.sched_getaffinity(0)))
    model = ["--model-path", model_path] if model_path else []
    engine = {"model_path": model_path, "max_total_tokens": 4096}
    factories = {
        "server, now": lambda: Server({}, model),
        "server, before": lambda: Server(BEFORE_ENV, [*model, "--num-threads", cpus]),
        "Engine, now": lambda: EngineWorker({}, engine),
        "Engine, before": lambda: EngineWorker(BEFORE_ENV, {**engine, "num_threads": int(cpus)}),
    }
    res = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), "idle_tokens": IDLE_TOKENS,
           "busy_tokens": BUSY_TOKENS, "neighbour": 'python -c "while True: pass"', "rounds": [],
           "systems": {}}
    systems = {}
    try:
        for label, make in tqdm(factories.items(), desc="shared CPU: starting", leave=False):
            systems[label] = make()
            systems[label].rate(8)  # warm-up: first requests set up kernels
            res["systems"][label] = systems[label].info
        for r in tqdm(range(2 if quick else 3), desc="shared CPU rounds", leave=False):
            order = list(systems) if r % 2 == 0 else list(reversed(systems))
            row: dict = {"order": order, "load_average": os.getloadavg()[0], "idle": {}, "busy": {}}
            for label in order:
                row["idle"][label] = systems[label].rate(IDLE_TOKENS)
            with neighbour():
                for label in order:
                    row["busy"][label] = systems[label].rate(BUSY_TOKENS)
            res["rounds"].append(row)
    finally:
        for system in systems.values():
            system.stop()
    res["summary"] = summary(res["rounds"], list(factories))
    return res


def summary(rounds: list[dict], labels: list[str]) -> dict:
    """Medians over rounds of each system's rates and of the ratios taken within a round."""
    med = statistics.median
    out = {label: {"idle_tok_s": med(r["idle"][label] for r in rounds),
                   "busy_tok_s": med(r["busy"][label] for r in rounds),
                   "busy_over_idle": med(r["busy"][label] / r["idle"][label] for r in rounds)} for label in labels}
    for kind in ("server", "Engine"):
        now, before = f"{kind}, now", f"{kind}, before"
        out[now]["idle_now_over_before"] = med(r["idle"][now] / r["idle"][before] for r in rounds)
        out[now]["busy_now_over_before"] = med(r["busy"][now] / r["busy"][before] for r in rounds)
    return out


def load(results_dir: Path) -> dict | None:
    path = results_dir / RESULTS
    return json.loads(path.read_text()) if path.exists() else None


def save(res: dict, results_dir: Path) -> None:
    path = results_dir / RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2))


def section(res: dict, targets: list[str], check) -> list[str]:
    """REPORT.md's section (and its rows of the targets table, through report.check)."""
    s, m = res["summary"], res["machine"]
    for kind in ("server", "Engine"):
        now = s[f"{kind}, now"]
        targets.append(check(f"{kind}, one stream with a busy neighbour / idle", now["busy_over_idle"],
                             now["busy_over_idle"] >= BUSY_TARGET, f">= {BUSY_TARGET:.2f}"))
        targets.append(check(f"{kind}, one stream idle: now / before", now["idle_now_over_before"],
                             now["idle_now_over_before"] >= IDLE_TARGET, f">= {IDLE_TARGET:.2f}"))
    L = ["## One stream on a shared CPU", "",
         f"Measured {res['started']} on commit {m['commit']}, {m['cpu']}, {m['cpus_in_mask']} CPUs in the mask "
         f"(load average {m['load_average_at_start']:.1f} at the start: the machine is shared, so 'idle' means "
         "without the neighbour this benchmark adds). Greedy decode tokens/s of one stream with the default "
         f"(native) kernel, {res['idle_tokens']} tokens idle and {res['busy_tokens']} with one busy neighbour "
         f"(`{res['neighbour']}`); 'before' = libgomp's default spin at barriers (`GOMP_SPINCOUNT=300000`) and "
         "every CPU in the mask as threads, 'now' = the defaults (threads from the CPU budget, "
         f"`OMP_WAIT_POLICY=PASSIVE`). {len(res['rounds'])} rounds, all four systems up at once and taking turns, "
         "the order flipped each round; medians over rounds (ratios taken within a round). "
         "`python benchmarks/shared_cpu.py`.", "",
         "| system | threads | OpenMP waits | idle tok/s | with neighbour tok/s | with neighbour / idle | "
         "idle now / before |", "|---|---|---|---|---|---|---|"]
    for label, row in s.items():
        info = res["systems"][label]
        vs = f"{row['idle_now_over_before']:.2f}" if "idle_now_over_before" in row else ""
        L.append(f"| {label} | {info['threads']} | {info['omp_wait']} | {row['idle_tok_s']:.1f} | "
                 f"{row['busy_tok_s']:.1f} | {row['busy_over_idle']:.2f} | {vs} |")
    if m["load_average_at_start"] >= m["cpus_in_mask"]:
        L += ["", "The machine was busy with other work throughout (load average at or above its CPUs), so 'before' "
              "had collapsed even without the neighbour and 'idle now / before' says nothing about a quiet machine, "
              "where sleeping at barriers costs a wake-up that spinning does not: run this again on a quiet one."]
    L += ["", "Every round (tok/s, idle / with neighbour; load average before the round):", ""]
    for i, r in enumerate(res["rounds"]):
        L.append(f"- round {i + 1} (load {r['load_average']:.1f}): " +
                 ", ".join(f"{label} {r['idle'][label]:.1f} / {r['busy'][label]:.1f}" for label in s))
    return [*L, ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    res = measure(args.quick, args.model_path)
    for label, row in res["summary"].items():
        print(f"{label:16s} idle {row['idle_tok_s']:6.1f}  neighbour {row['busy_tok_s']:6.1f}  "
              f"ratio {row['busy_over_idle']:.2f}  " +
              (f"idle now/before {row['idle_now_over_before']:.2f}" if "idle_now_over_before" in row else ""))
    save(res, Path(args.out))
    print(f"wrote {Path(args.out) / RESULTS}")


if __name__ == "__main__":
    main()
