"""``make bench``: every scenario against radixserve (radix cache on and off) and HF transformers on the same
model, dtype and prompts; writes each stage's committed results file, then benchmarks/results/REPORT.md and PNG
plots from those files. See benchmarks/README.md.

    python benchmarks/bench.py [--quick] [--out benchmarks/results] [--tp N]
                               [--only shared,multiturn,unique,forward,overhead,deterministic,grammar,quant,
                                       compile,peer,radix,tp,dp,shadow,sharedcpu,tiers,speculative,shapes,groups]

Each stage's results go to a committed file, benchmarks/results/<stage>/results.json, naming the machine and commit
it ran on; the report is generated from those files, so ``--only`` reruns some stages and the report shows the
others' last committed runs (each section says when, where and at which commit it was measured).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import compile_cost  # noqa: E402
import cpu_peer  # noqa: E402
import deterministic_cost  # noqa: E402
import dp_cost  # noqa: E402
import shadow_cost  # noqa: E402
import shared_cpu  # noqa: E402
import speculative  # noqa: E402
import grammar_cost  # noqa: E402
import kv_tiers  # noqa: E402
import prefix_groups  # noqa: E402
import llama_cpp  # noqa: E402
import machine  # noqa: E402
import quant_cost  # noqa: E402
import radix_speed  # noqa: E402
import real_shapes  # noqa: E402
import report  # noqa: E402
import tp_cost  # noqa: E402
from forward_speed import HF, Ours  # noqa: E402
from harness import load_hf  # noqa: E402
from scenarios import MultiTurn, SeedSmallCase, SharedPrefix, Unique  # noqa: E402
from stage_results import load_stage, machine as machine_info, save_stage  # noqa: E402

from radixserve.actors.tokenizer import TokenizerCore  # noqa: E402
from radixserve.model.config import ModelConfig  # noqa: E402
from radixserve.model.loader import load_configs, resolve_model  # noqa: E402
from radixserve.server_process import ServerProcess  # noqa: E402

STAGES = ("shared", "multiturn", "unique", "forward", "overhead", "deterministic", "grammar", "quant", "compile",
          "peer", "radix", "tp", "dp", "shadow", "sharedcpu", "tiers", "speculative", "shapes", "groups")
STAGE_KEYS = {"shared": ("shared", "seed_small", "shared_best_hf", "llama_cpp"), "multiturn": ("multiturn",),
              "unique": ("unique", "unique_best_hf"), "forward": ("forward", "machine_limits"), "overhead": ("overhead",),
              "deterministic": (), "grammar": ("grammar",), "quant": ("quant",),
              "compile": ("compile",), "peer": ("peer",), "radix": ("radix",), "tp": ("tp",), "dp": ("dp",),
              "shadow": ("shadow",), "sharedcpu": (), "tiers": (), "speculative": (), "shapes": (),
              "groups": ()}  # (): the stage writes its own
# results file (deterministic, sharedcpu, tiers, speculative, shapes, groups); the others' keys go to
# results/<stage>/results.json
SERVE_ROUNDS = 3  # shared-prefix runs of each system, taking turns (a new system prompt each round)
UNIQUE_RUNS = 5  # runs of each system, in the order on, off, off, on, ...; the median run counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a few minutes)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--only", default=",".join(STAGES),
                    help="the stages to run, comma-separated; `report`: none, only REPORT.md from the committed files")
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--tp", type=int, default=None,
                    help="ranks of the tensor-parallelism stage (default: the smallest tp > 1 the model splits)")
    args = ap.parse_args()
    only = set(args.only.split(",")) - {"report"}
    if only - set(STAGES):
        ap.error(f"--only: no stage {', '.join(sorted(only - set(STAGES)))}; the stages are {', '.join(STAGES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    q = args.quick
    files = resolve_model(args.model_path)
    tok = TokenizerCore(files.path)
    cfg = ModelConfig.from_hf(*load_configs(files.path))
    model_name = "SmolLM2-135M-Instruct" if args.model_path is None else Path(args.model_path).stem
    shared_rounds = [SharedPrefix(tok, n=16 if q else 32, max_new=16 if q else 32, seed=i)
                     for i in range(1 if q else SERVE_ROUNDS)]
    shared = shared_rounds[0]
    small = SeedSmallCase(tok)
    unique = Unique(tok, n=16 if q else 32, words=100 if q else 200, max_new=32 if q else 64)
    multi = MultiTurn(conversations=4 if q else 8, rounds=5, max_new=40)
    res: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": q, "threads": torch.get_num_threads(),
                 "model": model_name, "dtype": "bfloat16", "system_prompt_tokens": shared.system_tokens,
                 "machine": machine_info()}
    # Both servers stay up and take turns (an idle server costs no CPU), so drifting machine load hits both alike.
    # LPM: the cache-aware policy that also computes a prefix shared within one step only once.
    serve_args = ["--max-total-tokens", "40000", "--max-running-requests", "64", "--schedule-policy", "lpm"]
    if args.model_path:
        serve_args += ["--model-path", args.model_path]
    systems = {"radixserve, radix cache on": [], "radixserve, radix cache off": ["--disable-radix-cache"]}
    bar = tqdm(total=17, desc="bench", unit="stage")  # one update per stage (sharedcpu and tiers share one)
    hf = load_hf(files.path, torch.bfloat16) if only & {"shared", "unique", "forward"} else None
    pad = cfg.hf_config.pad_token_id or 0
    if only & {"shared", "multiturn", "unique"}:
        servers = {label: ServerProcess(*serve_args, *extra) for label, extra in systems.items()}
        llama = start_llama_cpp(files.path) if only & {"shared", "multiturn"} else None
        if llama is not None:
            res["llama_cpp"] = llama if isinstance(llama, str) else "llama.cpp BF16 (llama-server, 8 slots)"
        try:
            warm = SharedPrefix(tok, n=8, max_new=8, seed=99)  # first requests pay oneDNN's kernel set-up
            for server in servers.values():
                warm.radix(server.url, "warm-up")
            if "unique" in only:  # first, while both servers have the same history: the cache must cost nothing,
                # a claim that needs low noise. Five runs each, in the order on, off, off, on, on, off, ...; HF's
                # two baselines (slow: sequential generation) take a turn every other round
                runs = {label: [] for label in servers}
                for i in tqdm(range(UNIQUE_RUNS), desc="unique on/off", leave=False):
                    for label, server in (servers.items() if i % 2 == 0 else reversed(servers.items())):
                        runs[label].append(unique.radix(server.url, label))
                    for r in unique.hf(hf, pad) if i % 2 == 0 else ():
                        runs.setdefault(r.system, []).append(r)
                res["unique"] = [median_run(r) for r in runs.values()]
                res["unique_best_hf"] = best_system([u for u in res["unique"] if u["system"] not in servers])
            # The serving scenarios with every system taking turns: each shared-prefix round a new system prompt
            # (no system has it cached from a round before: first passes all), each multi-turn round every
            # system's next round, the order rotated round by round; a system's median shared-prefix run counts.
            urls = {label: server.url for label, server in servers.items()}
            if not isinstance(llama, (str, type(None))):  # the CPU peer at the same precision, same prompts
                warm.llama(llama.url, "warm-up")
                urls[res["llama_cpp"]] = llama.url
            names = list(urls)
            shared_runs: dict[str, list] = {name: [] for name in names}
            chats = {name: multi.start() for name in names}
            turns = names + ["HF"]  # HF: its two baselines, one after the other
            for i in tqdm(range(len(shared_rounds) if "shared" in only else 0), desc="shared prefix", leave=False):
                scenario = shared_rounds[i]
                for name in turns[i % len(turns):] + turns[: i % len(turns)]:
                    if name == "HF":
                        for r in scenario.hf(hf, pad):
                            shared_runs.setdefault(r.system, []).append(r)
                    else:
                        run = scenario.radix if name in servers else scenario.llama
                        shared_runs[name].append(run(urls[name], name))
            # after the shared prefix (whose runs flush the radix servers' caches), never between its rounds
            for i in tqdm(range(multi.rounds if "multiturn" in only else 0), desc="multi-turn", leave=False):
                for name in names[i % len(names):] + names[: i % len(names)]:
                    multi.round(urls[name], chats[name], i, model_name, keep_alive=name in servers)
            if "shared" in only:
                res["shared"] = [median_run(runs) for runs in shared_runs.values()]
                res["shared_best_hf"] = best_system([r for r in res["shared"] if r["system"] not in urls])
                res["seed_small"] = [small.radix(url, label) for label, url in urls.items() if label in servers]
            if "multiturn" in only:
                res["multiturn"] = [multi.result(name, chats[name]) for name in names]
        finally:
            for server in servers.values():
                server.stop()
            if not isinstance(llama, (str, type(None))):
                llama.stop()
    save_stages(res, only & {"shared", "multiturn", "unique"}, out)
    bar.update()
    bar.update()
    limits = []  # the machine's limits, measured before and after the forward speed: the higher of the two counts
    if "overhead" in only or "forward" in only:
        limits.append(machine_limits())
    if "forward" in only:
        from radixserve import Engine

        engine = Engine(args.model_path, max_total_tokens=70000, chunked_prefill_size=8192)
        res["forward"] = forward_rows(Ours(engine), HF(hf), (128, 512, 1024, 2048), (1, 8, 32, 64), 2 if q else 5)
        engine.shutdown()
        del engine
        limits.append(machine_limits())
    bar.update()
    if limits:
        res["machine_limits"] = {**{k: max(m[k] for m in limits) for k in limits[0]}, "measured": limits,
                          **machine.model_costs(cfg)}
    if "overhead" in only:
        res["overhead"] = [machine.scheduler_overhead(b) for b in (1, 8, 32, 64)]
    save_stages(res, only & {"forward", "overhead"}, out)
    bar.update()
    if "deterministic" in only:
        # its own committed file, as sharedcpu: the report reads it whatever else was rerun
        deterministic_cost.save(deterministic_cost.measure("bfloat16", 2 if q else 5, q, args.model_path), out)
    bar.update()
    if "grammar" in only:
        res["grammar"] = grammar_cost.measure("bfloat16", 2 if q else 3, q, args.model_path)
        save_stages(res, {"grammar"}, out)  # as each stage ends: a later stage that fails loses nothing
    bar.update()
    if "quant" in only:
        res["quant"] = quant_cost.measure("bfloat16", 2 if q else 3, q, args.model_path)
        save_stages(res, {"quant"}, out)
    bar.update()
    if "compile" in only:
        res["compile"] = compile_cost.measure("bfloat16", 2 if q else 3, q, args.model_path)
        save_stages(res, {"compile"}, out)
    bar.update()
    if "peer" in only:
        res["peer"] = cpu_peer.measure(q, args.model_path)
        save_stages(res, {"peer"}, out)
    bar.update()
    if "radix" in only:
        res["radix"] = radix_speed.measure(5000 if q else 20000, (200000, 50000), 2 if q else 3)
        save_stages(res, {"radix"}, out)
    bar.update()
    if "tp" in only:
        res["tp"] = tp_cost.measure(args.tp or tp_cost.smallest_tp(cfg), 2 if q else 3, q, args.model_path)
        save_stages(res, {"tp"}, out)
    bar.update()
    if "dp" in only:
        res["dp"] = dp_cost.measure(q, args.model_path)
        save_stages(res, {"dp"}, out)
    bar.update()
    if "shadow" in only:
        res["shadow"] = shadow_cost.measure(q, args.model_path)
        save_stages(res, {"shadow"}, out)
    bar.update()
    if "sharedcpu" in only:  # a run of its own, whatever the others' results: the report reads it from its file
        shared_cpu.save(shared_cpu.measure(q, args.model_path), out)
    if "tiers" in only:  # the same: benchmarks/results/kv_tiers/results.json
        kv_tiers.save(kv_tiers.measure(q), out)
    bar.update()
    if "speculative" in only:  # the same: benchmarks/results/speculative/results.json
        speculative.save(speculative.measure(q), out)
    bar.update()
    if "shapes" in only:  # the same: benchmarks/results/shapes/results.json
        shapes = real_shapes.measure(q)
        if "skipped" in shapes:
            print(f"shapes: skipped: {shapes['skipped']}")
        else:
            real_shapes.save(shapes, out)
    bar.update()
    if "groups" in only:  # the same: benchmarks/results/prefix_groups/results.json
        prefix_groups.save(prefix_groups.measure(q), out)
    bar.update()
    bar.close()
    report.write(with_other_stages(res, only, out), out)
    print(f"wrote {out / 'REPORT.md'}")


def start_llama_cpp(hf_folder: Path):
    """llama-server on the BF16 GGUF of the same weights, or why it cannot run here (a string)."""
    try:
        return cpu_peer.LlamaServer(llama_cpp.gguf_files(hf_folder)["bf16"])
    except (llama_cpp.Unavailable, RuntimeError) as exc:
        return f"llama.cpp is not in this run: {exc}"


HEADER = ("started", "machine", "quick", "threads", "model", "dtype", "system_prompt_tokens")  # every stage file has these


def save_stages(res: dict, only: set[str], out: Path) -> None:
    """Each stage measured now into its committed file, benchmarks/results/<stage>/results.json, with the machine
    and commit it ran on (the stages with their own files saved themselves)."""
    for stage in only & set(STAGES):
        keys = [k for k in STAGE_KEYS[stage] if k in res]
        if keys:
            save_stage({**{k: res[k] for k in HEADER}, **{k: res[k] for k in keys}}, out, stage)


def with_other_stages(res: dict, only: set[str], out: Path) -> dict:
    """The report's input: this run's stages and, for the stages not rerun (``--only``), their committed files
    (same model and sizes only); ``stage_runs`` says when, where and at which commit each stage was measured."""
    merged, runs = dict(res), {}
    for stage in STAGES:
        keys = STAGE_KEYS[stage]
        old = None if stage in only or not keys else load_stage(out, stage)
        if stage in only and any(k in res for k in keys):
            runs[stage] = {"started": res["started"], "machine": res["machine"]}
        elif old is not None and (old.get("model"), old.get("quick")) == (res["model"], res["quick"]):
            merged.update({k: old[k] for k in keys if k in old})
            runs[stage] = {"started": old["started"], "machine": old.get("machine", {})}
    return {**merged, "stage_runs": runs}


def machine_limits() -> dict:
    """bf16 and float32 matmul peaks and copy bandwidth, measured now (noise only ever lowers them)."""
    return {"bf16_matmul_flops": machine.matmul_peak(torch.bfloat16),
            "fp32_matmul_flops": machine.matmul_peak(torch.float32),
            "copy_bandwidth_bytes": machine.copy_bandwidth()}


def best_system(rows: list[dict]) -> str:
    """The name of the fastest of ``rows`` (median runs' summaries) by throughput."""
    return max(rows, key=lambda r: r["throughput_tok_s"])["system"]


def median_run(runs) -> dict:
    """Several runs of one system: the one of median throughput, with every run's throughput kept. Two identical
    servers differ by up to ~10% in one run on this shared machine, so one run cannot show a 3% difference."""
    rows = sorted((r.summary() for r in runs), key=lambda r: r["throughput_tok_s"])
    return {**rows[len(rows) // 2], "runs": len(rows), "throughput_all_runs": [r["throughput_tok_s"] for r in rows]}


def forward_rows(ours: Ours, hf: HF, prefill: tuple, batches: tuple, repeats: int) -> list[dict]:
    ours.prefill(64, 0), hf.prefill(64, 0)  # warm-up: oneDNN sets up a kernel per shape on first use
    ours.decode(1, 64, 8, 0), hf.decode(1, 64, 8, 0)
    rows = []
    for kind, size in tqdm([("prefill", n) for n in prefill] + [("decode", b) for b in batches], desc="forward",
                           leave=False):
        o, h = [], []
        for r in range(repeats):  # alternate: drifting load hits both alike
            if kind == "prefill":
                o.append(ours.prefill(size, r))
                h.append(hf.prefill(size, r))
            else:
                o.append(ours.decode(size, 128, 16, 100 * r))
                h.append(hf.decode(size, 128, 16, 100 * r))
        rows.append({"kind": kind, "size": size, "ours_tok_s": size / sorted(o)[len(o) // 2],
                     "hf_tok_s": size / sorted(h)[len(h) // 2]})
    return rows


if __name__ == "__main__":
    main()
