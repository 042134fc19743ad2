"""One-stream decode on a shared CPU: the default kernel (the native decode step) with the machine to itself, and
with one busy neighbour (``python -c "while True: pass"``, started and killed here), before and after the runner
chose its threads from its CPU budget and from the CPUs other processes leave free (radixserve/cpu_budget.py,
radixserve/cpu_load.py).

Four systems (more with ``--wait``), all up at once and taking turns (an idle one costs no CPU), each in a fresh
process:

- the server now (its defaults) and the server as before: libgomp's default spin (``GOMP_SPINCOUNT=300000``, what
  an unset OMP_WAIT_POLICY means; an explicit setting is left alone) and ``--num-threads`` = every CPU in the mask;
- the Engine (in-process runner, no other actors) now and as before, the same way;
- ``--wait NAME=VALUE``: the server and the Engine with their defaults but that OpenMP wait setting (to choose the
  default by measurement: ``--wait OMP_WAIT_POLICY=PASSIVE --wait GOMP_SPINCOUNT=30000``).

Each round measures every system idle, then every system with the neighbour running (then a pause, so that the next
round's idle turns find a machine that has been idle); the order flips each round.
Decode tokens/s of one greedy stream: completion tokens after the first over the time after the first (prefill out
of it). Results go to ``benchmarks/results/shared_cpu/results.json`` (committed; REPORT.md's section is built
from it).

    python benchmarks/shared_cpu.py [--quick | --rounds N] [--model-path P] [--wait NAME=VALUE ...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from tqdm import tqdm

from radixserve import cpu_load
from radixserve.server_process import ServerProcess
from stage_results import load_stage, machine, save_stage

STAGE = "shared_cpu"  # its results: benchmarks/results/shared_cpu/results.json (stage_results.py)
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
        self.info = {"threads": runner["threads"], "adaptive": runner.get("adaptive_threads", False),
                     "omp_wait": runner["omp_wait"]}
        self.threads_at_end: int | None = None  # the runner's count is not visible from here

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
        self.threads_at_end: int | None = None

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):  # anything else a library printed is not ours
                return json.loads(line)
        raise RuntimeError(f"the Engine worker exited with {self.proc.wait()}")

    def rate(self, tokens: int) -> float:
        self.proc.stdin.write(f"{tokens}\n")
        self.proc.stdin.flush()
        out = self._read()
        self.threads_at_end = out["threads"]
        return out["tok_s"]

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def worker() -> None:
    """The Engine side of EngineWorker: a JSON line with its threads, then one rate per requested token count."""
    from radixserve import Engine

    engine = Engine(**json.loads(sys.argv[1]))
    import torch  # already loaded by the Engine: asked only for the thread count it runs on

    from radixserve.cpu_budget import wait_policy

    print(json.dumps({"threads": torch.get_num_threads(), "adaptive": engine.runner.threads.adaptive is not None,
                      "omp_wait": wait_policy(os.environ)}), flush=True)
    params = {"temperature": 0, "ignore_eos": True}
    for line in sys.stdin:
        stamps = [(time.perf_counter(), out["meta_info"]["completion_tokens"])
                  for out in engine.generate(PROMPT, {**params, "max_new_tokens": int(line)}, stream=True)]
        # the steps ran in this thread: its OpenMP count is the one the runner last chose
        print(json.dumps({"tok_s": _rate(stamps), "threads": torch.get_num_threads()}), flush=True)
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
        # the next round's idle turns measure a machine that has been idle, as a user's is: a runner that just saw
        # the neighbour still runs fewer threads until its estimate has asked for more for cpu_load.GROW_AFTER
        # (a neighbour that just left is a different case from an idle machine), or restarts from its cap after
        # cpu_load.STALE without steps
        time.sleep(cpu_load.GROW_AFTER + cpu_load.STALE)


def measure(quick: bool = False, model_path: str | None = None, waits: list[str] = (),
            kinds: tuple[str, ...] = ("server", "Engine"), rounds: int | None = None) -> dict:
    """``waits``: OpenMP wait settings (``NAME=VALUE``) to measure beside the defaults, each as one more 'now'
    system of each kind (the defaults' threads, that wait)."""
    cpus = str(len(os.sched_getaffinity(0)))
    model = ["--model-path", model_path] if model_path else []
    engine = {"model_path": model_path, "max_total_tokens": 4096}
    build = {"server": lambda env, fixed: Server(env, [*model, *(["--num-threads", cpus] if fixed else [])]),
            "Engine": lambda env, fixed: EngineWorker(env, {**engine, **({"num_threads": int(cpus)} if fixed else {})})}
    factories = {}
    for kind in kinds:
        factories[f"{kind}, now"] = lambda kind=kind: build[kind]({}, False)
        factories[f"{kind}, before"] = lambda kind=kind: build[kind](BEFORE_ENV, True)
        for wait in waits:
            name, _, value = wait.partition("=")
            factories[f"{kind}, now with {wait}"] = lambda kind=kind, env={name: value}: build[kind](env, False)
    res = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), "idle_tokens": IDLE_TOKENS,
           "command": " ".join(["python benchmarks/shared_cpu.py", *(["--quick"] if quick else []),
                                *([f"--rounds {rounds}"] if rounds else []),
                                *(f"--wait {w}" for w in waits)]),
           "busy_tokens": BUSY_TOKENS, "neighbour": 'python -c "while True: pass"', "rounds": [],
           "systems": {}}
    systems = {}
    try:
        for label, make in tqdm(factories.items(), desc="shared CPU: starting", leave=False):
            systems[label] = make()
            systems[label].rate(8)  # warm-up: first requests set up kernels
            res["systems"][label] = systems[label].info
        for r in tqdm(range(rounds or (2 if quick else 3)), desc="shared CPU rounds", leave=False):
            order = list(systems) if r % 2 == 0 else list(reversed(systems))
            row: dict = {"order": order, "load_average": os.getloadavg()[0], "idle": {}, "busy": {},
                         "threads_at_end": {"idle": {}, "busy": {}}}
            for label in order:
                row["idle"][label] = systems[label].rate(IDLE_TOKENS)
                row["threads_at_end"]["idle"][label] = systems[label].threads_at_end
            with neighbour():
                for label in order:
                    row["busy"][label] = systems[label].rate(BUSY_TOKENS)
                    row["threads_at_end"]["busy"][label] = systems[label].threads_at_end
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
    for label in labels:
        before = f"{label.split(',')[0]}, before"
        if label != before and before in labels:
            out[label]["idle_now_over_before"] = med(r["idle"][label] / r["idle"][before] for r in rounds)
            out[label]["busy_now_over_before"] = med(r["busy"][label] / r["busy"][before] for r in rounds)
    return out


def load(results_dir: Path) -> dict | None:
    return load_stage(results_dir, STAGE)


def save(res: dict, results_dir: Path) -> None:
    save_stage(res, results_dir, STAGE)


def section(res: dict, targets: list[str], check) -> list[str]:
    """REPORT.md's section (and its rows of the targets table, through report.check)."""
    s, m = res["summary"], res["machine"]
    now_wait = res["systems"]["Engine, now"]["omp_wait"]
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
         "every CPU in the mask as threads, 'now' = the defaults (up to the CPU budget's threads, fewer while other "
         f"processes keep CPUs busy, `radixserve/cpu_load.py`; OpenMP waits: {now_wait}), 'now with X' = the "
         f"defaults with the wait setting X. {len(res['rounds'])} rounds, all {len(s)} systems up at once and taking "
         "turns, the order flipped each round; medians over rounds (ratios taken within a round). "
         f"`{res.get('command', 'python benchmarks/shared_cpu.py')}`.", "",
         "| system | threads | OpenMP waits | idle tok/s | with neighbour tok/s | with neighbour / idle | "
         "idle now / before |", "|---|---|---|---|---|---|---|"]
    for label, row in s.items():
        info = res["systems"][label]
        vs = f"{row['idle_now_over_before']:.2f}" if "idle_now_over_before" in row else ""
        threads = f"up to {info['threads']}, adaptive" if info.get("adaptive") else info["threads"]
        L.append(f"| {label} | {threads} | {info['omp_wait']} | {row['idle_tok_s']:.1f} | "
                 f"{row['busy_tok_s']:.1f} | {row['busy_over_idle']:.2f} | {vs} |")
    if max(r["load_average"] for r in res["rounds"]) >= m["cpus_in_mask"] / 2:
        L += ["", "Other people's jobs kept this machine's CPUs partly busy (load averages below), so 'idle' was not "
              "a quiet machine: 'before' spun against that load, and the adaptive runner sometimes ran fewer "
              "threads because of it (on a quiet machine both run every thread, spinning). The same system's "
              "rounds differ by 10-30%: read the medians, and the ratios near a target, with that spread."]
    L += ["", "Every round (tok/s, idle / with neighbour; load average before the round; for the Engine the threads "
          "its last step ran on, idle / with neighbour):", ""]
    for i, r in enumerate(res["rounds"]):
        ends = r.get("threads_at_end", {"idle": {}, "busy": {}})

        def threads(label: str) -> str:
            idle, busy = ends["idle"].get(label), ends["busy"].get(label)
            return f" ({idle} / {busy} threads)" if idle is not None else ""
        L.append(f"- round {i + 1} (load {r['load_average']:.1f}): " +
                 ", ".join(f"{label} {r['idle'][label]:.1f} / {r['busy'][label]:.1f}{threads(label)}" for label in s))
    return [*L, ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default: 3, --quick 2)")
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--wait", action="append", default=[], metavar="NAME=VALUE",
                    help="also measure the defaults with this OpenMP wait setting (e.g. GOMP_SPINCOUNT=10000)")
    ap.add_argument("--kinds", default="server,Engine", help="which systems: server, Engine or both")
    args = ap.parse_args()
    res = measure(args.quick, args.model_path, args.wait, tuple(args.kinds.split(",")), args.rounds)
    for label, row in res["summary"].items():
        print(f"{label:40s} idle {row['idle_tok_s']:6.1f}  neighbour {row['busy_tok_s']:6.1f}  "
              f"ratio {row['busy_over_idle']:.2f}  " +
              (f"idle now/before {row['idle_now_over_before']:.2f}" if "idle_now_over_before" in row else ""))
    save(res, Path(args.out))
    print(f"wrote {Path(args.out) / STAGE / 'results.json'}")


if __name__ == "__main__":
    main()
