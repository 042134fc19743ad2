"""REPORT.md and the PNG plots of ``make bench``, from the committed results files (bench.py merges them)."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

import kv_tiers
import provenance
import shared_cpu
import real_shapes
import prefix_groups
import speculative
from stage_results import load_stage

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def by_system(rows: list[dict], system: str) -> dict:
    return next(r for r in rows if r["system"] == system)


def serving_table(rows: list[dict], best_hf: str) -> list[str]:
    best = by_system(rows, best_hf)["throughput_tok_s"]
    lines = ["| system | throughput (tok/s) | vs best HF | TTFT p50 | TTFT p90 | cache hit rate |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['system']} | {r['throughput_tok_s']:.1f} | {r['throughput_tok_s'] / best:.2f}x | "
                     f"{ms(r['ttft_p50_s'])} | {ms(r['ttft_p90_s'])} | {pct(r['hit_rate'])} |")
    return lines


def check(name: str, value: float, ok: bool, target: str) -> str:
    return f"| {name} | {value:.3g} | {target} | {'met' if ok else '**not met**'} |"


def write(res: dict, out: Path) -> None:
    L = [f"# radixserve benchmark report", "",
         f"{res['model']}, {res['dtype']}, {res['threads']} torch threads{' (--quick sizes)' if res['quick'] else ''}. "
         "Every number in this file is read from the committed results files (`benchmarks/results/<stage>/"
         "results.json`), each naming when, where and at which commit its stage ran; the table at the end lists "
         "them and marks a stage stale where a later commit changed the code it measures. Within a stage the "
         "systems run on the same prompts (token ids), greedy, each request generating exactly its max_new_tokens; "
         "each section says how its systems took turns. llama.cpp is built from source on the machine that "
         "measures, for its instruction sets except AMX (`benchmarks/llama_cpp.py`).", ""]
    targets = ["| target | measured | wanted | |", "|---|---|---|---|"]
    if "shared" in res:
        rows, best = res["shared"], res["shared_best_hf"]
        on = by_system(rows, "radixserve, radix cache on")
        bh = by_system(rows, best)
        L += [f"## Shared prefix", "",
              f"One {res['system_prompt_tokens']}-token system prompt, {on['requests']} different questions, all sent "
              f"at once (a first pass: the radix servers' caches are flushed, and every round brings a new system "
              f"prompt). The systems take turns, the order rotated each round; each row is a system's median run "
              f"of {on.get('runs', 1)}. Best HF baseline: {best}.", "", *serving_table(rows, best), ""]
        ratio = on["throughput_tok_s"] / bh["throughput_tok_s"]
        targets.append(check("shared prefix: throughput / best HF", ratio, ratio >= 8, ">= 8"))
        targets.append(check("shared prefix: TTFT p50 / best HF's", on["ttft_p50_s"] / bh["ttft_p50_s"],
                             on["ttft_p50_s"] < bh["ttft_p50_s"] / 4, "far below 1 (< 0.25)"))
        peer = next((r for r in rows if r["system"] == res.get("llama_cpp")), None)
        if peer:
            ratio = on["throughput_tok_s"] / peer["throughput_tok_s"]
            targets.append(check("shared prefix: throughput / llama.cpp (BF16)", ratio, ratio >= 10, ">= 10"))
        elif "llama_cpp" in res:
            L += [f"{res['llama_cpp']}", ""]
        plot_serving(rows, out / "shared_prefix.png", "shared prefix")
        L += ["![shared prefix](shared_prefix.png)", ""]
        L += ["### The seed's small case", "",
              "A one-line shared system prompt: 3 questions sharing it vs 3 questions with a one-line prompt each, "
              "sent one after another (cache flushed first).", "",
              "| system | latency shared / unique | reduction | TTFT shared / unique | reduction | cached tokens |",
              "|---|---|---|---|---|---|"]
        for r in res["seed_small"]:
            L.append(f"| {r['system']} | {ms(r['shared_latency_s'])} / {ms(r['unique_latency_s'])} | "
                     f"{pct(r['latency_reduction'])} | {ms(r['shared_ttft_s'])} / {ms(r['unique_ttft_s'])} | "
                     f"{pct(r['ttft_reduction'])} | {r['shared_cached_tokens']} |")
        L.append("")
    if "multiturn" in res:
        L += ["## Multi-turn chat", "", "Each round, every conversation sends its whole history plus a new question, "
              "all at once; the server's answers join the history. The systems take turns round by round (each "
              "with its own conversations), the order rotated each round.", "",
              "| round | " + " | ".join(f"TTFT ({r['system']})" for r in res["multiturn"]) + " | " +
              " | ".join(f"hit rate ({r['system']})" for r in res["multiturn"]) + " |",
              "|---" * (1 + 2 * len(res["multiturn"])) + "|"]
        for i in range(len(res["multiturn"][0]["rounds"])):
            rounds = [r["rounds"][i] for r in res["multiturn"]]
            L.append(f"| {i + 1} | " + " | ".join(ms(x["ttft_mean_s"]) for x in rounds) + " | " +
                     " | ".join(pct(x["hit_rate"]) for x in rounds) + " |")
        L.append("| last / first | " + " | ".join(f"{r['ttft_ratio_last_first']:.2f}" for r in res["multiturn"]) +
                 " | |" * len(res["multiturn"]))
        L.append("")
        on = by_system(res["multiturn"], "radixserve, radix cache on")
        targets.append(check("multi-turn: TTFT round 5 / round 1 (radix on)", on["ttft_ratio_last_first"],
                             on["ttft_ratio_last_first"] <= 1.05, "<= 1.05"))
        targets.append(check("multi-turn: round-5 hit rate", on["rounds"][-1]["hit_rate"],
                             on["rounds"][-1]["hit_rate"] >= 0.9, ">= 0.90"))
        plot_multiturn(res["multiturn"], out / "multi_turn.png")
        L += ["![multi-turn](multi_turn.png)", ""]
    if "unique" in res:
        rows, best = res["unique"], res["unique_best_hf"]
        on, off = by_system(rows, "radixserve, radix cache on"), by_system(rows, "radixserve, radix cache off")
        L += ["## Unique prompts", "", f"{on['requests']} prompts sharing nothing, all at once: what the cache costs "
              f"when it cannot help. radixserve ran {on['runs']} times with the cache on and off, in turns "
              "(on, off, off, on, ...) and before the other scenarios, HF's baselines after them each round; the "
              "table shows each system's median run.", "",
              *serving_table(rows, best), "",
              *(f"- {r['system']}, every run (tok/s): " + ", ".join(f"{t:.1f}" for t in r["throughput_all_runs"])
                for r in (on, off)), ""]
        ratio = on["throughput_tok_s"] / by_system(rows, best)["throughput_tok_s"]
        diff = on["throughput_tok_s"] / off["throughput_tok_s"] - 1
        targets.append(check("unique: throughput / best HF", ratio, ratio >= 1.5, ">= 1.5"))
        targets.append(check("unique: radix on vs off throughput", diff, abs(diff) <= 0.03, "within ±3%"))
    if "forward" in res:
        m = res["machine_limits"]
        fp32 = m.get("fp32_matmul_flops", 0.0)
        peak = max(m["bf16_matmul_flops"], fp32)  # the runner multiplies large batches in float32 where that is faster
        L += ["## Forward speed", "", "The model runner vs HF's forward on the same weights. Machine, same run (the "
              f"higher of a measurement before and one after the forward speed; noise only lowers them): bf16 "
              f"matmul peak {m['bf16_matmul_flops'] / 1e9:.0f} GFLOP/s, float32 {fp32 / 1e9:.0f} GFLOP/s (prefill "
              "runs its large products on a float32 copy of the weights where this CPU's float32 GEMM is the faster "
              "one, so prefill is measured against the higher of the two peaks), copy bandwidth "
              f"{m['copy_bandwidth_bytes'] / 1e9:.1f} GB/s (read + write). Weights read per decode step: "
              f"{m['decode_weight_bytes'] / 1e6:.0f} MB, so one sequence cannot decode faster than "
              f"{m['copy_bandwidth_bytes'] / m['decode_weight_bytes']:.0f} tok/s.", "",
              "| | size | radixserve tok/s | HF tok/s | ratio | radixserve GFLOP/s or GB/s | of the machine's limit |",
              "|---|---|---|---|---|---|---|"]
        for r in res["forward"]:
            if r["kind"] == "prefill":
                flops = r["ours_tok_s"] * (m["flops_per_token"] + m["attention_flops_per_token_per_position"] *
                                           r["size"] / 2)
                frac, rate = flops / peak, f"{flops / 1e9:.0f} GFLOP/s"
                r["fraction_of_bf16_peak"] = flops / m["bf16_matmul_flops"]
            else:
                bw = r["ours_tok_s"] / r["size"] * m["decode_weight_bytes"]
                frac, rate = bw / m["copy_bandwidth_bytes"], f"{bw / 1e9:.1f} GB/s"
            r["fraction_of_limit"] = frac
            L.append(f"| {r['kind']} | {r['size']} | {r['ours_tok_s']:.1f} | {r['hf_tok_s']:.1f} | "
                     f"{r['ours_tok_s'] / r['hf_tok_s']:.2f}x | {rate} | {pct(frac)} |")
        L.append("")
        fw = {(r["kind"], r["size"]): r for r in res["forward"]}
        pre = [r for r in res["forward"] if r["kind"] == "prefill"]
        worst = min(pre, key=lambda r: r["ours_tok_s"] / r["hf_tok_s"])
        targets.append(check(f"prefill / HF (worst length: {worst['size']})", worst["ours_tok_s"] / worst["hf_tok_s"],
                             worst["ours_tok_s"] >= worst["hf_tok_s"], ">= 1.0"))
        low = min(pre, key=lambda r: r["fraction_of_limit"])
        targets.append(check(f"prefill, fraction of bf16 matmul peak (lowest: {low['size']})",
                             low["fraction_of_bf16_peak"], low["fraction_of_bf16_peak"] >= 0.6, ">= 0.60"))
        targets.append(check(f"prefill, fraction of the best matmul peak, bf16 or float32 (lowest: {low['size']})",
                             low["fraction_of_limit"], low["fraction_of_limit"] >= 0.6, ">= 0.60"))
        d1, d32 = fw[("decode", 1)], fw[("decode", 32)]
        targets.append(check("decode batch 1 / HF", d1["ours_tok_s"] / d1["hf_tok_s"],
                             d1["ours_tok_s"] >= 1.5 * d1["hf_tok_s"], ">= 1.5"))
        targets.append(check("decode batch 1, fraction of the bandwidth limit", d1["fraction_of_limit"],
                             d1["fraction_of_limit"] >= 0.5, ">= 0.50"))
        targets.append(check("decode batch 32 / HF", d32["ours_tok_s"] / d32["hf_tok_s"],
                             d32["ours_tok_s"] >= d32["hf_tok_s"], ">= 1.0"))
        plot_forward(res["forward"], out / "forward.png")
        L += ["![forward speed](forward.png)", ""]
    if "overhead" in res:
        steps = {r["size"]: r["size"] / r["ours_tok_s"] for r in res.get("forward", []) if r["kind"] == "decode"}
        L += ["## Scheduler + IPC overhead", "", "Per decode step, with a runner that computes nothing: the "
              "scheduler core (plan + process) and one hop each for the plan, the result, the tokens and the text "
              "(msgspec + ZeroMQ ipc, measured against an echo process).", "",
              "| batch | scheduler | IPC hops | total | real decode step | fraction |", "|---|---|---|---|---|---|"]
        for r in res["overhead"]:
            hops = r["total_s"] - r["scheduler_s"]
            step = steps.get(r["batch"])
            r["fraction"] = r["total_s"] / step if step else None
            L.append(f"| {r['batch']} | {r['scheduler_s'] * 1e3:.2f} ms | {hops * 1e3:.2f} ms | "
                     f"{r['total_s'] * 1e3:.2f} ms | {ms(step)} | {pct(r['fraction'])} |")
        L.append("")
        at32 = next((r for r in res["overhead"] if r["batch"] == 32 and r["fraction"] is not None), None)
        if at32:
            targets.append(check("scheduler + IPC / step time at batch 32", at32["fraction"], at32["fraction"] <= 0.05,
                                 "<= 0.05"))
    det = load_stage(out, "deterministic")  # the stage's committed results file, not results.json
    if det is not None:
        L += deterministic_section(det, out)
    if "grammar" in res:
        g = res["grammar"]
        o = g["one_off"]
        L += ["## Structured output: what a grammar costs per decode step", "",
              "The runner's decode step with 0, 1 or all B rows under a grammar (llguidance), side by side "
              f"(alternating, median of repeats; {g['dtype']}). The grammar's own time, measured where it is spent "
              "in the same steps: 'fill' = llguidance computing the masks, on a helper thread while the model "
              "computes the step (overlapped; on 2 cores it competes with torch's threads), 'serial' = applying "
              "the masks to the logits and advancing the matchers, in the step itself. 'slowdown' = constrained "
              "step / free step compares separate runs and carries this machine's noise (several ms either way): "
              "the fill and serial columns are the direct measure. JSON schema: an array of at least 200 integers "
              "(no row ends early); free-text regex: `[a-z ,.]{2000,}`, which allows a large part of the "
              "vocabulary at every step (the costliest mask to fill). One-off costs: llguidance's view of the "
              f"tokenizer {o['tokenizer_s']:.2f} s (once per runner, on the first constrained request), compiling a "
              f"grammar {1e3 * o['compile_s']:.1f} ms (once per distinct grammar), a cached grammar's start "
              f"{1e3 * o['cached_start_s']:.2f} ms.", "",
              "| grammar | batch | constrained rows | free step ms | constrained step ms | fill ms (overlapped) | "
              "serial ms | fill us / row | slowdown |", "|---|---|---|---|---|---|---|---|---|"]
        for r in g["rows"]:
            L.append(f"| {r['grammar']} | {r['batch']} | {r['constrained_rows']} | {r['free_ms']:.2f} | "
                     f"{r['constrained_ms']:.2f} | {r['fill_ms']:.2f} | {r['serial_ms']:.2f} | "
                     f"{r['fill_us_per_row']:.0f} | {r['slowdown']:.2f}x |")
        L += ["", "![grammar cost](grammar.png)", ""]
        plot_grammar(g["rows"], out / "grammar.png")
    if "quant" in res:
        qd = res["quant"]
        L += ["## Quantized weights and KV: speed and accuracy", "",
              "The model runner with bf16 weights and with `--quantization int8` / `int4` (int4: the bundled GGUF's "
              "Q4_1 blocks as they ship; the output projection int8), and with bf16 weights over an 8-bit KV pool "
              "(`--kv-cache-dtype int8 | fp8_e4m3 | fp8_e5m2`: codes with a float32 scale per token and head), "
              "activations in bf16, side by side (alternating, median of repeats); decode through each one's default "
              f"kernel ({', '.join(sorted({r.get('decode_kernel', '?') for r in qd['rows']}))}). KV bytes per token "
              "over all layers; the pool's default size in tokens on this machine (8-bit codes: the bytes of the "
              "default, more tokens). Accuracy: mean log-probability per token of a fixed English text "
              f"({qd['rows'][0]['scored_tokens']} scored tokens, windows of 256 scoring the last 128), through "
              "prefill (the engine's prompt logprobs) and through teacher-forced decode steps (where the native "
              "step quantizes activations to 8 bits per 32 values for quantized weights); perplexity = exp(-mean). "
              "llama.cpp's perplexity at the same quantizations: the section against llama.cpp.", "",
              "| weights, KV | KV bytes / token | default pool, tokens | decode tok/s, batch 1 | decode tok/s, batch 8 "
              "| batch 8 over 1024 tokens | prefill tok/s, 512 | mean logprob | perplexity | perplexity, decode steps "
              "| start-up s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in qd["rows"]:
            dec, long = r.get("decode_perplexity"), r.get("decode_8_1024_tok_s")
            L.append(f"| {r['mode']} | {r.get('kv_bytes_per_token', float('nan')):.0f} | "
                     f"{r.get('default_pool_tokens', '-')} | {r['decode_1_tok_s']:.1f} | {r['decode_8_tok_s']:.1f} | "
                     f"{'-' if long is None else f'{long:.1f}'} | "
                     f"{r['prefill_512_tok_s']:.0f} | {r['mean_logprob']:.4f} | {r['perplexity']:.3f} | "
                     f"{'-' if dec is None else f'{dec:.3f}'} | {r['start_s']:.1f} |")
        L += [""]
    if "compile" in res:
        L += compile_section(res["compile"], out)
    if "peer" in res:
        L += peer_section(res["peer"], targets, out)
    if "radix" in res:
        L += radix_section(res["radix"], targets)
    if "tp" in res:
        L += tp_section(res["tp"], out)
    if "dp" in res:
        L += dp_section(res["dp"], targets, out)
    if "shadow" in res:
        L += shadow_section(res["shadow"], targets, out)
    shared = shared_cpu.load(out)  # the stage's committed results file, not results.json
    if shared is not None:
        L += shared_cpu.section(shared, targets, check)
    tiers = kv_tiers.load(out)  # the same
    if tiers is not None:
        L += kv_tiers.section(tiers, targets, check)
    spec = speculative.load(out)  # the same
    if spec is not None:
        L += speculative.section(spec, targets, check)
    shapes = real_shapes.load(out)  # the same
    if shapes is not None:
        L += real_shapes.section(shapes, targets, check)
    groups = prefix_groups.load(out)  # the same
    if groups is not None:
        L += prefix_groups.section(groups, targets, check)
    L += provenance_section(out)
    L[4:4] = ["## Targets", "", *targets, ""]
    (out / "REPORT.md").write_text("\n".join(L) + "\n")


def shadow_section(s: dict, targets: list[str], out: Path) -> list[str]:
    o, a = s["overhead"], s["auto"]
    slow = 1 - o["throughput_ratio"]
    targets.append(check("shadows (all pairs): serving throughput lost", slow, slow <= 0.02, "<= 2%"))
    best = a["best_fixed"]
    targets.append(check(f"auto-policy mean TTFT / best fixed policy's ({best})", a["auto_vs_best_fixed_ttft"],
                         a["auto_beats_every_fixed"], "< 1 against every fixed policy"))
    L = ["## Shadow policies and --auto-policy", "",
         f"**Overhead.** {o['requests']} requests (unique 256-token prompts, so every round does the same work) sent "
         "at once, "
         f"{o['max_new']} tokens each, against a server without shadows and one with `--shadow-policies all` "
         f"({o['shadow_pairs']} pairs), {o['rounds']} rounds, each round one burst on each (ABBA order), the cache "
         "flushed before every burst. Median of the rounds' ratios (shadow / plain): throughput "
         f"{o['throughput_ratio']:.3f}x, mean latency {o['e2e_ratio']:.3f}x (median throughput "
         f"{o['median']['plain']['throughput_tok_s']:.1f} vs {o['median']['shadow']['throughput_tok_s']:.1f} tok/s). "
         "The shadow process simulates at the lowest CPU priority (SCHED_IDLE), on CPU time "
         "the server leaves idle: "
         f"after each burst it took {', '.join(f'{c:.1f}' for c in o['catch_up_s'])} s to catch up.", "",
         "| round | plain tok/s | shadow tok/s | shadow / plain |", "|---|---|---|---|"]
    L += [f"| {i + 1} | {p['throughput_tok_s']:.1f} | {q['throughput_tok_s']:.1f} | {q['throughput_tok_s'] / p['throughput_tok_s']:.3f} |"
          for i, (p, q) in enumerate(zip(o["runs"]["plain"], o["runs"]["shadow"]))]
    w = a["workload"]
    L += ["", f"**Auto-switching.** The `phase-shift` workload ({w['requests']} requests, {w['prefix_tokens']}-token "
          f"prefixes, pool {a['pool_tokens']} tokens): first a scan over {w['groups']} prefixes at {w['rate']} "
          "requests/s, more than the pool holds (the next prefix is always the least recently used: LRU keeps "
          "nothing, MRU and FILO keep some); then, one request at a time, a drifting hot prefix among one-off "
          "prompts (recency wins; MRU and FILO evict the hot prefix). Each fixed policy on one server (switched, "
          "flushed); auto on a server with `--shadow-policies " + ",".join(p[0] for p in a["pairs"]) +
          " --auto-policy` (hold 3 s, cooldown 10 s, window 15 s, margin 10%, by mean TTFT), starting at lru. "
          "Client-side TTFT. The simulated columns replay the same trace with the cost model the shadow fitted to "
          "the live server.", "",
          "| policy | hit rate | TTFT mean | TTFT p99 | simulated hit rate | simulated TTFT mean |",
          "|---|---|---|---|---|---|"]
    for lr, sr in zip(a["live"], a["simulated"]):
        L.append(f"| {lr['policy']} | {pct(lr['hit_rate'])} | {ms(lr['ttft_mean_s'])} | {ms(lr['ttft_p99_s'])} | "
                 f"{pct(sr['hit_rate'])} | {ms(sr['ttft_mean_s'])} |")
    L += ["", "Switches on the live server (trace time = the scheduler's clock):", ""]
    L += [f"- {sw['from']['eviction']} -> {sw['to']['eviction']}: {sw['reason']}" for sw in a["switches"]] or ["- none"]
    plot_bars([r["policy"] for r in a["live"]], {"TTFT mean ms": [1e3 * r["ttft_mean_s"] for r in a["live"]],
                                                 "hit rate x 1000": [1e3 * r["hit_rate"] for r in a["live"]]},
              "", "phase-shift: fixed policies vs --auto-policy", out / "auto_policy.png")
    return L + ["", "![auto policy](auto_policy.png)", ""]


def dp_section(d: dict, targets: list[str], out: Path) -> list[str]:
    rows = {r["system"]: r for r in d["rows"]}
    one, aware, rr = rows["one replica"], rows["--dp 2, cache-aware"], rows["--dp 2, round-robin"]
    targets.append(check("--dp 2 cache-aware / round-robin hit rate", aware["hit_rate"] / max(rr["hit_rate"], 1e-9),
                         aware["hit_rate"] > rr["hit_rate"], "> 1"))
    targets.append(check("--dp 2 cache-aware / one replica throughput",
                         aware["throughput_tok_s"] / one["throughput_tok_s"],
                         aware["throughput_tok_s"] > one["throughput_tok_s"], "> 1"))
    L = ["## Data parallelism: --dp 2 and the router", "",
         f"{d['groups']} prefix groups (each its own ~530-token system prompt), {d['rounds']} rounds of one question "
         f"per group sent at once, {d['max_new']} tokens each; {d['pool_tokens']} KV tokens per replica, so the "
         f"groups ({d['first_round_prompt_tokens']} prompt tokens a round) do not fit one replica's pool but fit "
         "two. One replica gets both cores (2 threads); two replicas, or two servers behind `radixserve router`, a "
         "thread each. Systems run one after another (each freshly started), not interleaved. Router thresholds: "
         "cache threshold / balance abs / balance rel.", "",
         "| system | hit rate | throughput tok/s | TTFT p50 | TTFT p90 |", "|---|---|---|---|---|"]
    for r in d["rows"]:
        L.append(f"| {r['system']} | {pct(r['hit_rate'])} | {r['throughput_tok_s']:.1f} | {ms(r['ttft_p50_s'])} | "
                 f"{ms(r['ttft_p90_s'])} |")
    plot_bars([r["system"] for r in d["rows"]], {"throughput tok/s": [r["throughput_tok_s"] for r in d["rows"]],
                                                "hit rate x 100": [100 * r["hit_rate"] for r in d["rows"]]},
              "", "data parallelism: 2 replicas vs one", out / "dp.png")
    return L + ["", "![data parallelism](dp.png)", ""]


def tp_section(t: dict, out: Path) -> list[str]:
    n, a = t["tp"], t["agreement"]
    L = [f"## Tensor parallelism: --tp {n} against one rank", "",
         f"The same weights on one rank and on {n} ranks (local processes, gloo), side by side (alternating, median "
         "of repeats; bf16, eager decode steps on both). On one machine the ranks share its cores and every layer "
         "adds two all-reduces over local sockets, so --tp is not a speed-up here: it is for a model that does not "
         "fit one process's memory, or one machine. Start-up: one rank "
         f"{t['start_s']['1']:.1f} s, {n} ranks {t['start_s'][str(n)]:.1f} s.", ""]
    if t.get("substituted"):
        L += [f"The bench's model cannot run at --tp {n}: {t['substituted']}.", ""]
    L += [f"Greedy agreement in float32: {a['identical_prompts']}/{a['prompts']} prompts give exactly one rank's "
          f"tokens; {a['same_prefix_tokens']}/{a['tokens']} tokens agree before any first difference.", "",
          f"| | size | tp 1 tok/s | tp {n} tok/s | tp {n} / tp 1 |", "|---|---|---|---|---|"]
    for r in t["rows"]:
        L.append(f"| {r['kind']} | {r['size']} | {r['tp1_tok_s']:.1f} | {r['tpn_tok_s']:.1f} | {r['ratio']:.2f}x |")
    plot_bars([f"{r['kind']} {r['size']}" for r in t["rows"]],
              {"tp 1": [r["tp1_tok_s"] for r in t["rows"]], f"tp {n}": [r["tpn_tok_s"] for r in t["rows"]]},
              "tokens/s", f"--tp {n} vs one rank (bf16)", out / "tp.png")
    return L + ["", "![tensor parallelism](tp.png)", ""]


def compile_section(c: dict, out: Path) -> list[str]:
    s = c["startup"]
    L = ["## Decode kernels: native, compiled, eager", "",
         "The same engine's decode step through the native step (kernels/native/: the whole step in one C++ "
         "call), the compiled decoder layers (`torch.compile`, model/compiled.py) and eager torch, alternating step "
         f"by step on one running batch of 128-token prompts (median per kernel, then the median of repeats; "
         f"{c['dtype']}). Start-up: the native step builds in {s['native']['cold']['compile_s']:.1f} s with an "
         f"empty cache and loads in {s['native']['warm']['compile_s']:.1f} s on a restart; the compiled graphs "
         f"take {s['compiled']['cold']['compile_s']:.1f} s and {s['compiled']['warm']['compile_s']:.1f} s (both "
         "cached on disk).", "",
         "| batch | eager tok/s | compiled tok/s | native tok/s | compiled / eager | native / eager |",
         "|---|---|---|---|---|---|"]
    for r in c["decode"]:
        L.append(f"| {r['batch']} | {r['eager_tok_s']:.1f} | {r['compiled_tok_s']:.1f} | {r['native_tok_s']:.1f} | "
                 f"{r['compiled_vs_eager']:.2f}x | {r['native_vs_eager']:.2f}x |")
    L += ["", "Greedy tokens against eager's on the same prompts (one at a time, then all as one batch):", "",
          "| dtype | kernel | batch | prompts | tokens each | prompts that differ | first differing positions |",
          "|---|---|---|---|---|---|---|"]
    for dtype, rows in c["flips"].items():
        for r in rows:
            L.append(f"| {dtype} | {r['kernel']} | {r['batch']} | {r['prompts']} | {r['tokens']} | "
                     f"{r['differing_prompts']} | {r['first_flip_positions'] or '-'} |")
    if "vs_float32" in c:
        v = c["vs_float32"]
        L += ["", f"Against the float32 model (same prompts, one at a time, {v['rows'][0]['tokens']} greedy tokens "
              f"each): the {v['dtype']} kernels round in different places, and this says which stays closer.", "",
              "| kernel | prompts identical to float32's | tokens before the first difference |", "|---|---|---|"]
        for r in v["rows"]:
            L.append(f"| {r['kernel']} | {r['identical_prompts']} of {r['prompts']} | "
                     f"{r['tokens_before_difference']} of {r['prompts'] * r['tokens']} |")
    plot_bars([f"batch {r['batch']}" for r in c["decode"]],
              {k: [r[f"{k}_tok_s"] for r in c["decode"]] for k in ("eager", "compiled", "native")},
              "decode tokens / s", "decode kernels (same engine, alternating steps)", out / "compile.png")
    return L + ["", "![decode kernels](compile.png)", ""]


def peer_section(p: dict, targets: list[str], out: Path) -> list[str]:
    if "skipped" in p:
        return ["## Against llama.cpp", "", f"Not in this run: {p['skipped']}", ""]
    L = ["## Against llama.cpp, whole server against whole server", "",
         f"radixserve's server against llama.cpp's `llama-server` on the same weights at the same precision, both "
         f"on 2 threads, side by side (a pair's servers up together, taking turns): one streamed completion of "
         f"{p['tokens']} tokens (tokens/s after the first token), and {p['streams']} different prompts at once "
         f"(output tokens / wall time, prefill included). Perplexity of benchmarks/data/perplexity.txt the way "
         f"`llama-perplexity` computes it (chunks of {p['chunk']} tokens scoring their second half), ours over the "
         "same chunks of our tokenization. Pairs: bf16 / llama.cpp's BF16 GGUF (its own converter, from our "
         "checkpoint); int8 / Q8_0: radixserve serves the very Q8_0 file llama.cpp runs, its blocks as they ship; int4 / "
         "the bundled Q4_1 file, which both read as it ships; gguf / Q4_K_M: llama-quantize's Q4_K_M of the BF16 file, "
         "served with --quantization gguf, every tensor as it ships (SmolLM2's rows of 576 weights do not fill the "
         "256-weight K-quant super-blocks, so most of its tensors are Q5_0 and Q8_0, as llama-quantize writes them "
         "for anyone).", "",
         "| precision | system | one stream tok/s | vs llama.cpp | 8 streams tok/s | vs llama.cpp | perplexity | "
         "perplexity, decode steps |", "|---|---|---|---|---|---|---|---|"]
    for r in p["rows"]:
        dec = r.get("perplexity_decode")
        L.append(f"| {r['precision']} | {r['system']} | {r['one_stream_tok_s']:.1f} | "
                 f"{r['one_stream_vs_llama_cpp']:.2f}x | {r['eight_streams_tok_s']:.1f} | "
                 f"{r['eight_streams_vs_llama_cpp']:.2f}x | {r['perplexity']:.3f} | "
                 f"{'-' if dec is None else f'{dec:.3f}'} |")
    L += ["", "perplexity: radixserve's through prefill (prompt logprobs), llama.cpp's from `llama-perplexity` "
          "(chunks evaluated batched, through the quantized kernels it also decodes with); decode steps: "
          "radixserve's default kernel scoring the same chunks teacher-forced, one decode step a token "
          "(benchmarks/decode_score.py) -- under --quantization the native step quantizes activations to 8 bits "
          "per 32 values there, as llama.cpp does."]
    for r in p["rows"]:
        if r.get("judged"):  # the default configuration of each precision; the alternatives are shown
            targets.append(check(f"one stream / llama.cpp, {r['system']}", r["one_stream_vs_llama_cpp"],
                                 r["one_stream_vs_llama_cpp"] >= 1.0, ">= 1.0"))
            targets.append(check(f"8 streams / llama.cpp, {r['system']}", r["eight_streams_vs_llama_cpp"],
                                 r["eight_streams_vs_llama_cpp"] >= 1.5, ">= 1.5"))
    plot_bars([r["system"].replace("radixserve ", "").replace("llama.cpp ", "llama ") for r in p["rows"]],
              {"one stream": [r["one_stream_tok_s"] for r in p["rows"]],
               "8 streams": [r["eight_streams_tok_s"] for r in p["rows"]]},
              "output tokens / s", "radixserve vs llama.cpp's llama-server (same weights, same precision)",
              out / "llama_cpp.png")
    return L + ["", "![against llama.cpp](llama_cpp.png)", ""]


def radix_section(r: dict, targets: list[str]) -> list[str]:
    L = ["## The prefix cache against SGLang's RadixCache", "",
         f"The cache bookkeeping a scheduler does per request (match, lock, evict for room, allocate, insert prompt + "
         f"output, unlock) on one synthetic trace of {r['requests']} requests ({r['prompt_tokens']} prompt tokens: "
         "prefix groups, questions, continued conversations), radixserve's CacheManager against SGLang 0.5.23's "
         "own `RadixCache`, both LRU, alternating, best of repeats (`benchmarks/radix_speed.py`).", "",
         "| pool capacity (tokens) | radixserve req/s | SGLang req/s | speedup | hit rate (ours / SGLang) |",
         "|---|---|---|---|---|"]
    for row in r["rows"]:
        L.append(f"| {row['capacity']} | {row['radixserve_req_s']:.0f} | {row['sglang_req_s']:.0f} | "
                 f"{row['speedup']:.2f}x | {pct(row['radixserve_hit_rate'])} / {pct(row['sglang_hit_rate'])} |")
        targets.append(check(f"radix tree / SGLang RadixCache at {row['capacity']} tokens", row["speedup"],
                             row["speedup"] >= 3, ">= 3"))
    return L + [""]


def provenance_section(out: Path) -> list[str]:
    """Every committed results file: when, where (CPU, instruction sets, CPUs, kernels' build) and at which commit
    its stage ran, and whether a later commit changed what it measures (benchmarks/provenance.py)."""
    root = Path(__file__).resolve().parents[1]
    L = ["## Where each figure comes from", "", "| stage | file | started | commit | machine | status |",
         "|---|---|---|---|---|---|"]
    for stage, path in provenance.results_files(out):
        d = json.loads(path.read_text())
        m = d.get("machine") or {}
        later = provenance.freshness(root, stage, m)
        status = "unknown commit" if later is None else f"stale ({len(later)} later commits)" if later else "current"
        status += ", uncommitted changes" if m.get("uncommitted_changes") else ""
        where = (f"{m.get('cpu', '?')}, {m.get('cpus_in_mask', '?')} CPUs, "
                 f"{'/'.join(m.get('isa', [])[-3:]) or 'ISA not recorded'}, kernels {m.get('radixserve_march', '?')}"
                 + (f", oneDNN up to {m['onednn_max_cpu_isa']}" if m.get("onednn_max_cpu_isa") else ""))
        L.append(f"| {stage} | `{path.relative_to(out)}` | {d.get('started', '?')} | {m.get('commit', '?')} | "
                 f"{where} | {status} |")
    return L + [""]


def plot_bars(labels: list[str], series: dict[str, list[float]], ylabel: str, title: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))], values, width=width,
               label=name)
    ax.set_xticks(list(range(len(labels))), labels, fontsize=8, rotation=15)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_serving(rows: list[dict], path: Path, title: str) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["system"].replace("radixserve, ", "") for r in rows]
    a.bar(names, [r["throughput_tok_s"] for r in rows], color="tab:blue")
    a.set_ylabel("output tokens / s")
    b.bar(names, [r["ttft_p50_s"] for r in rows], color="tab:orange", label="p50")
    b.set_ylabel("time to first token p50 (s)")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=25, labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_multiturn(runs: list[dict], path: Path) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        rounds = [x["round"] for x in r["rounds"]]
        a.plot(rounds, [x["ttft_mean_s"] for x in r["rounds"]], marker="o", label=r["system"])
        b.plot(rounds, [x["hit_rate"] for x in r["rounds"]], marker="o", label=r["system"])
    a.set_ylabel("mean TTFT (s)")
    b.set_ylabel("cache hit rate")
    b.set_ylim(0, 1.02)
    for ax in (a, b):
        ax.set_xlabel("round")
        ax.set_xticks(rounds)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def deterministic_section(d: dict, out: Path) -> list[str]:
    m = d.get("machine", {})
    kernels = d.get("kernels", {})
    L = ["## Deterministic mode: what it costs", "", "`--deterministic` (batch-invariant: a request's tokens never "
         "depend on the batch) vs the default mode, the same model and weights in "
         f"{d['dtype']}, side by side (alternating, median of repeats); default mode on its "
         f"`{kernels.get('default', '?')}` decode kernel, deterministic mode on its "
         f"`{kernels.get('deterministic', '?')}` batch-invariant kernels. Slowdown = time per token in deterministic "
         f"mode / default mode. Start-up: default {d['start_s']['default']:.1f} s, deterministic "
         f"{d['start_s']['deterministic']:.1f} s (it builds or loads its kernels and checks the loaded model's batch "
         f"invariance). Run {d.get('started', '?')} on {m.get('cpu', '?')} ({m.get('cpus_in_mask', '?')} CPUs, "
         f"commit {m.get('commit', '?')}, load average {m.get('load_average_at_start', float('nan')):.1f} at the "
         "start).", "", "| | size | default tok/s | deterministic tok/s | slowdown |", "|---|---|---|---|---|"]
    for r in d["rows"]:
        L.append(f"| {r['kind']} | {r['size']} | {r['default_tok_s']:.1f} | {r['deterministic_tok_s']:.1f} | "
                 f"{r['slowdown']:.2f}x |")
    plot_deterministic(d["rows"], out / "deterministic.png")
    return L + ["", "![deterministic cost](deterministic.png)", ""]


def plot_deterministic(rows: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['kind']}\n{r['size']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["default_tok_s"] for r in rows], width=0.4, label="default")
    ax.bar([i + 0.2 for i in x], [r["deterministic_tok_s"] for r in rows], width=0.4, label="--deterministic")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("tokens / s")
    ax.set_title("batch-invariant mode vs default (same runner, same weights)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_grammar(rows: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['grammar']}\nB={r['batch']}, {r['constrained_rows']} constrained" for r in rows]
    x = range(len(rows))
    ax.bar(list(x), [r["free_ms"] for r in rows], width=0.6, label="free step", color="tab:blue")
    ax.bar(list(x), [r["constrained_ms"] - r["free_ms"] for r in rows], bottom=[r["free_ms"] for r in rows],
           width=0.6, label="added with the grammar", color="tab:orange")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("ms per decode step")
    ax.set_title("structured output: decode step time, free vs constrained rows")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_forward(rows: list[dict], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kind, xlabel in zip(axes, ("prefill", "decode"), ("prompt tokens", "batch size")):
        sel = [r for r in rows if r["kind"] == kind]
        ax.plot([r["size"] for r in sel], [r["ours_tok_s"] for r in sel], marker="o", label="radixserve")
        ax.plot([r["size"] for r in sel], [r["hf_tok_s"] for r in sel], marker="s", label="HF transformers")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("tokens / s")
        ax.set_title(kind)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
