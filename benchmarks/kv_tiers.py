"""``make bench`` stage "tiers": the KV tiers below the pool (--enable-hierarchical-cache) on the bundled model, 2
threads, bf16, every system measured in one run on one machine, taking turns.

- multi-turn: C clients x R rounds in SGLang's bench_multiturn shape (each round every client sends its whole chat
  so far plus a new question; at most ``--max-parallel`` requests in flight, TTFT measured from each request's
  send), a working set >= 5x the pool. radixserve with tiers and without, and llama.cpp's server with its host
  prompt cache (--cache-ram); beyond the pool, radixserve's L2 and llama.cpp's cache get the same host memory,
  less than the working set (the case tiers are for: radixserve's L3 is a folder on disk, llama.cpp has no disk
  tier). Targets: >= 2x the throughput and <= 1/3 the mean TTFT of both. A reference row gives llama.cpp host
  memory for the whole working set (no target: there its prompt cache holds every chat).
- warm restart: a returning 4k-token conversation after a restart; target TTFT <= 15% of a cold prefill.
- no reuse: unique prompts only; target throughput with tiers within 3% of tiers off.

    python benchmarks/kv_tiers.py [--quick] [--out benchmarks/results]

Writes benchmarks/results/kv_tiers/results.json (committed) and kv_tiers.png; REPORT.md's section comes from them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import aiohttp
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scenarios import stream_chat  # noqa: E402
from stage_results import load_stage, machine, save_stage  # noqa: E402

from radixserve.server_process import ServerProcess  # noqa: E402

STAGE = "kv_tiers"
HOST_MIB = 128  # host memory beyond the pool, for both (radixserve's --hicache-size, llama.cpp's --cache-ram): ~1/4 of
# the working set
REFERENCE_MIB = 2048  # the reference llama.cpp: host memory for the whole working set
REFERENCE = "llama.cpp, --cache-ram for the whole working set (reference)"
MAX_PARALLEL = 2  # requests in flight (bench_multiturn's --max-parallel): the pool holds that many whole chats
THROUGHPUT_TARGET, TTFT_TARGET, RESTART_TARGET, NO_REUSE_TARGET = 2.0, 1 / 3, 0.15, 0.97
WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more write "
         "go see number no way could people my than first water been call who oil its now find long down day did "
         "get come made may part over new sound take only little work know place year live me back give").split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


class Chats:
    """C clients x R rounds of scripted chats: each turn a question of ``words`` words and a scripted answer (the
    model still generates ``max_new`` tokens, ignore_eos; its text is not kept), so every system sees the very same
    prompts whatever it answers."""

    def __init__(self, clients: int, rounds: int, words: int, max_new: int, seed: int = 5) -> None:
        rng = random.Random(seed)
        self.system = [f"You are assistant number {c}. {text(rng, 30)}" for c in range(clients)]
        self.questions = [[text(rng, words) + "?" for _ in range(rounds)] for _ in range(clients)]
        self.answers = [[text(rng, max_new * 3 // 4) for _ in range(rounds)] for _ in range(clients)]
        self.clients, self.rounds, self.max_new = clients, rounds, max_new

    def messages(self, client: int, round_: int) -> list[dict]:
        out = [{"role": "system", "content": self.system[client]}]
        for r in range(round_ + 1):
            out.append({"role": "user", "content": self.questions[client][r]})
            if r < round_:
                out.append({"role": "assistant", "content": self.answers[client][r]})
        return out


async def turn(session: aiohttp.ClientSession, url: str, messages: list[dict], max_new: int) -> tuple[float, dict]:
    """One streamed chat request, exactly ``max_new`` tokens: (TTFT, usage)."""
    ttft, _, usage = await stream_chat(session, url, {"model": "m", "messages": messages, "max_tokens": max_new,
                                                      "temperature": 0, "ignore_eos": True})
    return ttft, usage or {}


async def round_of(url: str, chats: Chats, r: int, keep_alive: bool, max_parallel: int) -> dict:
    """Round ``r`` of every client, at most ``max_parallel`` in flight, in client order (the same each round, so a
    chat comes back after all the others: the reuse distance is the whole working set)."""
    gate = asyncio.Semaphore(max_parallel)

    async def client(session: aiohttp.ClientSession, c: int) -> tuple[float, dict]:
        async with gate:  # TTFT from the request's send, as bench_multiturn measures it
            return await turn(session, url, chats.messages(c, r), chats.max_new)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(force_close=not keep_alive)) as session:
        start = time.perf_counter()
        outs = await asyncio.gather(*(client(session, c) for c in range(chats.clients)))
        return {"seconds": time.perf_counter() - start, "ttft": [t for t, _ in outs],
                "prompt_tokens": sum(u.get("prompt_tokens", 0) for _, u in outs),
                "completion_tokens": sum(u.get("completion_tokens", 0) for _, u in outs),
                "cached_tokens": sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for _, u in outs)}


class Ours:
    def __init__(self, pool: int, tiers: bool, extra: list[str] = (), pages: Path | None = None) -> None:
        self.pages = pages
        flags = ["--num-threads", "2", "--served-model-name", "m", "--max-total-tokens", str(pool), *extra]
        if tiers:
            flags += ["--enable-hierarchical-cache", "--hicache-storage-backend-extra-config",
                      json.dumps({"path": str(pages)})]
        self.server = ServerProcess(*flags)
        self.url, self.keep_alive = self.server.url, True

    def tier_stats(self) -> dict | None:
        with urllib_open(self.url + "/cache/stats") as resp:
            return json.loads(resp.read()).get("tiers")

    def stop(self) -> None:
        self.server.stop()


def urllib_open(url: str):
    import urllib.request

    return urllib.request.urlopen(url, timeout=60)


class LlamaCpp:
    """llama-server on 2 threads, ``slots`` slots sharing ``pool`` tokens of KV (the memory radixserve's pool has),
    its host prompt cache (--cache-ram) of ``cache_ram_mib`` (None: its default), and ``extra`` flags."""

    def __init__(self, gguf: Path, pool: int, cache_ram_mib: int | None, slots: int, extra: list[str] = ()) -> None:
        import llama_cpp

        port = free_port()
        self.url, self.keep_alive = f"http://127.0.0.1:{port}", False
        self.flags = ["-t", "2", "-tb", "2", "-c", str(pool), "-np", str(slots),
                      *(["--cache-ram", str(cache_ram_mib)] if cache_ram_mib is not None else []), *extra]
        self.proc = subprocess.Popen([str(llama_cpp.binary("llama-server")), "-m", str(gguf), "--port", str(port),
                                      *self.flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(600):
            try:
                with urllib_open(self.url + "/health") as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("llama-server did not start")

    def tier_stats(self) -> None:
        return None

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_gguf() -> tuple[Path | None, str | None]:
    """The bf16 GGUF of our model for llama-server (the precision radixserve serves), or why there is none."""
    try:
        import llama_cpp

        from radixserve.model.loader import resolve_model

        server = llama_cpp.build()
        help_text = subprocess.run([str(server), "--help"], capture_output=True, text=True).stdout
        if "--cache-ram" not in help_text:
            return None, "this llama.cpp has no --cache-ram"
        return llama_cpp.gguf_files(resolve_model(None).path)["bf16"], None
    except Exception as exc:  # llama_cpp.Unavailable, a failed converter: the column is left out, with why
        return None, f"{type(exc).__name__}: {exc}"


def multi_turn(quick: bool, work: Path, peer: bool = True) -> dict:
    # ~140-token questions, 32-token answers: a chat grows ~190 tokens a round, ~1.9k by the last, and the pool holds
    # MAX_PARALLEL of them (llama.cpp's slots the same: -c pool -np MAX_PARALLEL)
    chats = Chats(clients=5 if quick else 12, rounds=4 if quick else 10, words=140, max_new=32)
    pool = 2048 if quick else 4096
    host = f"{HOST_MIB * 2**20 / 1e9:.4f}"
    systems = {"radixserve, tiers": lambda: Ours(pool, True, ["--hicache-size", host], pages=work / "multi-turn"),
               "radixserve, no tiers": lambda: Ours(pool, False)}
    gguf, why_not = llama_gguf() if peer else (None, "left out (--no-peer)")
    if gguf is not None:
        systems["llama.cpp, --cache-ram"] = lambda: LlamaCpp(gguf, pool, HOST_MIB, MAX_PARALLEL)
        systems[REFERENCE] = lambda: LlamaCpp(gguf, pool, REFERENCE_MIB, MAX_PARALLEL)
    running = {name: make() for name, make in tqdm(systems.items(), desc="starting servers")}
    rounds: dict[str, list[dict]] = {name: [] for name in running}
    try:
        for r in tqdm(range(chats.rounds), desc="multi-turn rounds"):
            for name, system in running.items():  # taking turns: load drifting over the run hits all alike
                rounds[name].append(asyncio.run(round_of(system.url, chats, r, system.keep_alive, MAX_PARALLEL)))
        stats = {name: system.tier_stats() for name, system in running.items()}
    finally:
        for system in running.values():
            system.stop()
    out = {"clients": chats.clients, "rounds": chats.rounds, "pool_tokens": pool, "max_new": chats.max_new,
           "max_parallel": MAX_PARALLEL, "host_mib": HOST_MIB, "reference_mib": REFERENCE_MIB,
           "llama_cpp": None if gguf is None else {"flags": running["llama.cpp, --cache-ram"].flags,
                                                   "reference_flags": running[REFERENCE].flags},
           "llama_cpp_missing": why_not, "systems": {}}
    for name, rs in rounds.items():
        seconds = sum(r["seconds"] for r in rs)
        ttft = [t for r in rs for t in r["ttft"]]
        out["systems"][name] = {
            "throughput_tok_s": sum(r["completion_tokens"] for r in rs) / seconds, "seconds": seconds,
            "ttft_mean_s": statistics.mean(ttft), "ttft_per_round_s": [statistics.mean(r["ttft"]) for r in rs],
            "prompt_tokens": sum(r["prompt_tokens"] for r in rs),
            "cached_tokens": sum(r.get("cached_tokens", 0) for r in rs), "tiers": stats[name]}
    last = rounds["radixserve, no tiers"][-1]["prompt_tokens"]
    out["working_set_tokens"] = last
    out["working_set_over_pool"] = last / pool
    return out


def conversation(tokens_wanted: int, seed: int = 9) -> list[dict]:
    rng = random.Random(seed)
    messages = [{"role": "system", "content": "You are a helpful assistant. " + text(rng, 40)}]
    while len(json.dumps(messages)) // 4 < tokens_wanted:  # about 4 characters a token here
        messages += [{"role": "user", "content": text(rng, 120) + "?"},
                     {"role": "assistant", "content": text(rng, 80)}]
    return messages


def warm_restart(quick: bool, work: Path, repeats: int) -> dict:
    """TTFT of a returning 4k-token conversation: served by a server that has never seen it (cold) and by one
    restarted after serving it (warm: its pages are read back from storage)."""
    history = conversation(2000 if quick else 4000)
    back = history + [{"role": "user", "content": "And what does that mean for us?"}]
    cold, warm, tiers = [], [], []
    for i in tqdm(range(repeats), desc="warm restart"):
        folder = work / f"restart-{i}"
        first = Ours(8192, True, pages=folder)
        try:
            asyncio.run(one(first.url, history))
        finally:
            first.stop()
        fresh = Ours(8192, True, pages=work / f"restart-cold-{i}")  # the cold reference: the same flags, no pages
        try:
            cold.append(asyncio.run(one(fresh.url, back))[0])
        finally:
            fresh.stop()
        again = Ours(8192, True, pages=folder)
        try:
            ttft, usage = asyncio.run(one(again.url, back))
            warm.append(ttft)
            tiers.append(usage.get("prompt_tokens_details"))
        finally:
            again.stop()
    return {"cold_ttft_s": cold, "warm_ttft_s": warm,
            "warm_over_cold": statistics.median(warm) / statistics.median(cold), "usage_details": tiers}


async def one(url: str, messages: list[dict]) -> tuple[float, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        return await turn(session, url, messages, 8)


def no_reuse(quick: bool, work: Path, pairs: int) -> dict:
    """Unique prompts only, all at once: with tiers (writing every page below) against without, ``pairs`` runs of
    each in ABBA order (runs spread by +-10% on this machine: the medians need that many)."""
    rng = random.Random(11)
    prompts = [[{"role": "user", "content": f"Request {i}. " + text(rng, 300)}] for i in range(16 if quick else 32)]
    servers = {"tiers": Ours(16384, True, pages=work / "no-reuse"), "no tiers": Ours(16384, False)}
    runs: dict[str, list[float]] = {name: [] for name in servers}
    order = ["tiers", "no tiers", "no tiers", "tiers"]
    try:
        for i in tqdm(range(pairs * 2), desc="no reuse"):
            name = order[i % 4]
            salt = f"run {i}: "  # every run's prompts are new to every tier

            async def all_at_once(url: str) -> float:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
                    start = time.perf_counter()
                    await asyncio.gather(*(turn(session, url, [{"role": "user", "content": salt + p[0]["content"]}],
                                                32) for p in prompts))
                    return len(prompts) * 32 / (time.perf_counter() - start)

            runs[name].append(asyncio.run(all_at_once(servers[name].url)))
        stats = servers["tiers"].tier_stats()
    finally:
        for s in servers.values():
            s.stop()
    med = {name: statistics.median(v) for name, v in runs.items()}
    return {"throughput_tok_s": runs, "median_tok_s": med, "tiers_over_off": med["tiers"] / med["no tiers"],
            "tier_stats": stats}


def measure(quick: bool = False, repeats: int = 3, peer: bool = True) -> dict:
    work = Path(tempfile.mkdtemp(prefix="radixserve-kv-tiers-"))
    try:
        res = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), "quick": quick}
        res["multi_turn"] = multi_turn(quick, work, peer)
        res["warm_restart"] = warm_restart(quick, work, repeats)
        res["no_reuse"] = no_reuse(quick, work, 4 if quick else 8)
        return res
    finally:
        shutil.rmtree(work, ignore_errors=True)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mt = res["multi_turn"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, row in mt["systems"].items():
        a.plot(range(1, len(row["ttft_per_round_s"]) + 1), row["ttft_per_round_s"], marker="o", label=name)
    a.set(xlabel="round", ylabel="mean TTFT (s)", title=f"multi-turn: {mt['clients']} clients, pool "
          f"{mt['pool_tokens']} tokens, working set {mt['working_set_over_pool']:.1f}x")
    a.legend()
    names = list(mt["systems"])
    b.bar([textwrap.fill(n, 22) for n in names], [mt["systems"][n]["throughput_tok_s"] for n in names])
    b.set(ylabel="output tokens / s", title="multi-turn throughput")
    b.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def load(results_dir: Path) -> dict | None:
    return load_stage(results_dir, STAGE)


def save(res: dict, results_dir: Path) -> None:
    save_stage(res, results_dir, STAGE)
    plot(res, results_dir / "kv_tiers.png")


def section(res: dict, targets: list[str], check) -> list[str]:
    mt, wr, nr, m = res["multi_turn"], res["warm_restart"], res["no_reuse"], res["machine"]
    ours = mt["systems"]["radixserve, tiers"]
    for name, row in mt["systems"].items():
        if name in ("radixserve, tiers", REFERENCE):
            continue
        tput = ours["throughput_tok_s"] / row["throughput_tok_s"]
        ttft = ours["ttft_mean_s"] / row["ttft_mean_s"]
        targets.append(check(f"multi-turn, tiers vs {name}: throughput", tput, tput >= THROUGHPUT_TARGET,
                             f">= {THROUGHPUT_TARGET:.1f}x"))
        targets.append(check(f"multi-turn, tiers vs {name}: mean TTFT", ttft, ttft <= TTFT_TARGET,
                             f"<= {TTFT_TARGET:.2f}x"))
    targets.append(check("warm restart: TTFT / cold prefill", wr["warm_over_cold"],
                         wr["warm_over_cold"] <= RESTART_TARGET, f"<= {RESTART_TARGET:.2f}"))
    targets.append(check("no reuse: throughput tiers / off", nr["tiers_over_off"],
                         nr["tiers_over_off"] >= NO_REUSE_TARGET, f">= {NO_REUSE_TARGET:.2f}"))
    rows = []
    for name, row in mt["systems"].items():
        t = row.get("tiers") or {}
        hits = t.get("hit_rate", {})
        rows.append(f"| {name} | {row['throughput_tok_s']:.1f} | {row['ttft_mean_s']:.2f} | "
                    + " | ".join(f"{hits[k]:.0%}" if k in hits else "-" for k in ("L1", "L2", "L3")) + " |")
    L = ["## KV tiers below the pool (--enable-hierarchical-cache)", "",
         f"Measured {res['started']} on commit {m['commit']}, {m['cpu']}, {m['cpus_in_mask']} CPUs "
         f"(`python benchmarks/kv_tiers.py`; bf16, 2 threads, the bundled model; systems take turns round by round).",
         "", f"Multi-turn (SGLang's bench_multiturn shape): {mt['clients']} clients x {mt['rounds']} rounds, each "
         f"turn a ~140-token question and {mt['max_new']} new tokens, at most {mt['max_parallel']} requests in flight "
         f"(TTFT from each request's send), a pool of {mt['pool_tokens']} tokens; the last round's prompts hold "
         f"{mt['working_set_tokens']} tokens ({mt['working_set_over_pool']:.1f}x the pool). Beyond the pool both get "
         f"{mt['host_mib']} MiB of host memory (radixserve's L2, `--hicache-size`; llama.cpp's `--cache-ram`), "
         "less than the working set; radixserve's L3 is a folder on disk (here the OS keeps its files in its page "
         "cache)."
         + (f" llama.cpp: `llama-server {' '.join(mt['llama_cpp']['flags'])}` on the bf16 GGUF of the same weights; "
            f"the reference row has `--cache-ram {mt['reference_mib']}`, room for every chat, and no target."
            if mt.get("llama_cpp") else f" llama.cpp left out: {mt.get('llama_cpp_missing')}."), "",
         "| system | output tok/s | mean TTFT (s) | hit L1 | hit L2 | hit L3 |", "|---|---|---|---|---|---|", *rows, "",
         "![KV tiers](kv_tiers.png)", "",
         f"Warm restart: a returning conversation's TTFT after a restart {statistics.median(wr['warm_ttft_s']):.2f} s "
         f"against {statistics.median(wr['cold_ttft_s']):.2f} s cold (medians of {len(wr['warm_ttft_s'])}; "
         f"{wr['warm_over_cold']:.2f}x).", "",
         f"No reuse: {nr['median_tok_s']['tiers']:.1f} tok/s with tiers (writing every page below), "
         f"{nr['median_tok_s']['no tiers']:.1f} without ({nr['tiers_over_off']:.3f}x; medians, runs alternating).", ""]
    return L


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="warm restarts")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--no-peer", action="store_true", help="leave llama.cpp out")
    args = ap.parse_args()
    out = Path(args.out)
    res = measure(args.quick, args.repeats, not args.no_peer)
    save(res, out)
    print(json.dumps({k: v for k, v in res.items() if k != "machine"}, indent=1)[:4000])


if __name__ == "__main__":
    main()
