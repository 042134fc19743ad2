"""Where every published figure comes from: the committed results files (benchmarks/results/**/results.json, each
naming its machine, commit and start time), their headline figures, and whether they are stale -- measured at a
commit older than the code they measure (a later commit changed code, not only comments or docstrings, under one
of the stage's paths). The docs' performance
page (docs/hooks.py) is generated from here; nothing quotes a figure by hand. Torch-free."""
from __future__ import annotations

import ast
import functools
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

PRODUCT = ["actors", "cache", "kernels", "model", "policies", "radixserve"]  # what a stage measures by default
MEASURES = {  # a stage's figures depend on these paths (besides its own bench script)
    "speculative": PRODUCT,
    "deterministic": ["kernels", "model"],
    "kv_tiers": PRODUCT,
    "shared_cpu": ["kernels", "model", "radixserve/cpu_budget.py", "radixserve/cpu_load.py"],
    "radix": ["cache", "policies"],
    "overhead": ["actors", "radixserve/wire"],
}
SCRIPTS = {"speculative": ["speculative.py"], "deterministic": ["deterministic_cost.py"], "kv_tiers": ["kv_tiers.py"],
           "shared_cpu": ["shared_cpu.py"], "grammar": ["grammar_cost.py"], "quant": ["quant_cost.py"],
           "compile": ["compile_cost.py"], "peer": ["cpu_peer.py", "llama_cpp.py", "decode_score.py"],
           "radix": ["radix_speed.py"], "tp": ["tp_cost.py"], "dp": ["dp_cost.py"], "shadow": ["shadow_cost.py"],
           "overhead": ["machine.py"], "shapes": ["real_shapes.py", "llama_cpp.py", "cpu_peer.py", "machine.py"],
           "prefix_groups": ["prefix_groups.py", "llama_cpp.py", "cpu_peer.py", "harness.py", "scenarios.py"]}
# a stage's own bench code; the others run in bench.py's scenarios
BENCH = ["bench.py", "scenarios.py", "harness.py"]


def measured_paths(stage: str) -> list[str]:
    """The paths whose change makes a stage's figures stale: the code it measures and its own bench script."""
    return MEASURES.get(stage, PRODUCT) + [f"benchmarks/{name}" for name in SCRIPTS.get(stage, BENCH)]


def results_files(base: Path) -> list[tuple[str, Path]]:
    """(stage, file) of every results file under ``base`` (the checkout's benchmarks/results):
    <stage>/results.json, and <run>/<stage>/results.json (a named run of a stage, such as the AVX2 build's)."""
    return sorted((p.parent.name, p) for p in base.glob("**/results.json") if p.parent != base)


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)


def _code(source: str) -> str | None:
    """A Python file's code without its comments and docstrings (None: not Python that parses)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def changes_code(root: Path, commit: str, paths: list[str]) -> bool:
    """Whether ``commit`` changed code under ``paths``: a commit that only rewrites Python comments and docstrings
    (a stale sentence, a typo) measures the same thing; any other change (C++ included) counts."""
    files = _git(root, "diff-tree", "--no-commit-id", "--name-only", "-r", commit, "--", *paths).stdout.split()
    return any(_changes_file_code(root, commit, name) for name in files)


@functools.lru_cache(maxsize=None)
def _changes_file_code(root: Path, commit: str, name: str) -> bool:
    """Whether ``commit`` changed ``name``'s code (remembered: every results file asks about the same commits, and
    parsing both sides of each took most of the docs build's time)."""
    if not name.endswith(".py"):
        return True
    old, new = (_git(root, "show", f"{rev}:{name}") for rev in (f"{commit}^", commit))
    before, after = (_code(r.stdout) if r.returncode == 0 else None for r in (old, new))
    return before is None or after is None or before != after


def later_commits(root: Path, commit: str, paths: list[str]) -> list[str] | None:
    """The commits after ``commit`` that changed the code under ``paths`` (hash and date), or None where ``commit``
    is not in this history (a shallow clone, a rewritten branch)."""
    if _git(root, "cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        return None
    log = _git(root, "log", "--format=%h %cs", f"{commit}..HEAD", "--", *paths).stdout.splitlines()
    return [line for line in log if changes_code(root, line.split()[0], paths)]


def freshness(root: Path, stage: str, machine: dict) -> list[str] | None:
    """The later commits that changed what a stage's results (measured on ``machine``) measure: [] current, a
    list stale, None unknown (no commit recorded, or one not in this history)."""
    return later_commits(root, machine["commit"], measured_paths(stage)) if machine.get("commit") else None


def _speculative(d: dict) -> list[tuple[str, str]]:
    med, rows = d["median_tok_s"], []
    none = med.get("radixserve, none", {})
    for name in ("radixserve, suffix", "radixserve, ngram"):
        if name in med:
            rows.append((f"{name.split(', ')[1]} drafts vs none, one stream",
                         ", ".join(f"{w} {med[name][w] / none[w]:.2f}x" for w in none if none[w])))
    llama = {n: v for n, v in med.items() if n.startswith("llama.cpp") and n != "llama.cpp, none"}
    if llama and "radixserve, suffix" in med:
        drafting = [w for w, pays in d.get("drafting", {}).items() if pays]
        rows.append(("suffix vs llama.cpp's best n-gram, one stream", ", ".join(
            f"{w} {med['radixserve, suffix'][w] / max(v[w] for v in llama.values()):.2f}x" for w in drafting)))
    b8 = d.get("batch8_tok_s", {})
    if "radixserve, suffix" in b8 and "radixserve, none" in b8:
        ratios = [b8["radixserve, suffix"][w] / b8["radixserve, none"][w] for w in b8["radixserve, none"]]
        rows.append(("suffix vs none, 8 at once", f"{min(ratios):.2f}-{max(ratios):.2f}x"))
    return rows


def _deterministic(d: dict) -> list[tuple[str, str]]:
    return [(f"--deterministic slowdown, {r['kind']} {r['size']}", f"{r['slowdown']:.2f}x") for r in d["rows"]]


def _kv_tiers(d: dict) -> list[tuple[str, str]]:
    rows = []
    systems = d.get("multi_turn", {}).get("systems", {})
    for name, s in systems.items():
        rows.append((f"multi-turn, {name}", f"{s['throughput_tok_s']:.1f} tok/s, mean TTFT {s['ttft_mean_s']:.2f} s"))
    warm = d.get("warm_restart")
    if warm:
        rows.append(("warm restart TTFT / cold", f"{warm['warm_over_cold']:.2f}"))
    if "no_reuse" in d:
        rows.append(("tiers on / off, nothing to reuse", f"{d['no_reuse']['tiers_over_off']:.2f}x"))
    return rows


def _shared_cpu(d: dict) -> list[tuple[str, str]]:
    return [(f"{name}: busy / idle decode", f"{s['busy_over_idle']:.2f}") for name, s in d["summary"].items()]


def _rows(d: dict, key: str) -> dict[str, dict]:
    return {r["system"]: r for r in d.get(key, [])}


def _vs_peers(d: dict, key: str, best_key: str) -> list[tuple[str, str]]:
    """A serving scenario's throughput, radix cache on against each other system."""
    rows = _rows(d, key)
    on = rows.get("radixserve, radix cache on")
    if on is None:
        return []
    return [(f"throughput, radix cache on / {name}{' (best HF)' if name == d.get(best_key) else ''}",
             f"{on['throughput_tok_s'] / r['throughput_tok_s']:.2f}x") for name, r in rows.items() if r is not on]


def _shared(d: dict) -> list[tuple[str, str]]:
    return _vs_peers(d, "shared", "shared_best_hf")


def _unique(d: dict) -> list[tuple[str, str]]:
    return _vs_peers(d, "unique", "unique_best_hf")


def _multiturn(d: dict) -> list[tuple[str, str]]:
    return [(f"{r['system']}: TTFT last round / first, last round's hit rate",
             f"{r['ttft_ratio_last_first']:.2f}, " + ("-" if r["rounds"][-1]["hit_rate"] is None
                                                      else f"{r['rounds'][-1]['hit_rate']:.0%}"))
            for r in d.get("multiturn", [])]


def _forward(d: dict) -> list[tuple[str, str]]:
    return [(f"{r['kind']} {r['size']}: radixserve / HF forward", f"{r['ours_tok_s'] / r['hf_tok_s']:.2f}x")
            for r in d.get("forward", [])]


def _overhead(d: dict) -> list[tuple[str, str]]:
    return [(f"scheduler + IPC per decode step, batch {r['batch']}", f"{r['total_s'] * 1e3:.2f} ms")
            for r in d["overhead"]]


def _grammar(d: dict) -> list[tuple[str, str]]:
    return [(f"{r['grammar']}, batch {r['batch']}, {r['constrained_rows']} rows constrained: step / free step",
             f"{r['slowdown']:.2f}x") for r in d["grammar"]["rows"]]


def _quant(d: dict) -> list[tuple[str, str]]:
    return [(f"{r['mode']}{'' if ',' in r['mode'] else ' weights'}: decode tok/s at batch 1 and 8, perplexity",
             f"{r['decode_1_tok_s']:.1f}, {r['decode_8_tok_s']:.1f}, {r['perplexity']:.3f}") for r in d["quant"]["rows"]]


def _compile(d: dict) -> list[tuple[str, str]]:
    return [(f"decode at batch {r['batch']}: native / eager, compiled / eager",
             f"{r['native_vs_eager']:.2f}x, {r['compiled_vs_eager']:.2f}x") for r in d["compile"]["decode"]]


def _peer(d: dict) -> list[tuple[str, str]]:
    p = d["peer"]
    if "skipped" in p:
        return [("against llama.cpp", f"not measured: {p['skipped']}")]
    return [(f"{r['system']} / llama.cpp ({r['precision']}): one stream, 8 streams",
             f"{r['one_stream_vs_llama_cpp']:.2f}x, {r['eight_streams_vs_llama_cpp']:.2f}x")
            for r in p["rows"] if r["system"].startswith("radixserve")]


def _radix(d: dict) -> list[tuple[str, str]]:
    return [(f"cache bookkeeping / SGLang's RadixCache, pool of {r['capacity']} tokens", f"{r['speedup']:.2f}x")
            for r in d["radix"]["rows"]]


def _tp(d: dict) -> list[tuple[str, str]]:
    t = d["tp"]
    a = t["agreement"]
    return [(f"--tp {t['tp']} / one rank, {r['kind']} {r['size']}", f"{r['ratio']:.2f}x") for r in t["rows"]] + [
        ("float32 prompts with exactly one rank's tokens", f"{a['identical_prompts']} of {a['prompts']}")]


def _dp(d: dict) -> list[tuple[str, str]]:
    return [(r["system"], f"{r['throughput_tok_s']:.1f} tok/s, hit rate {r['hit_rate']:.0%}") for r in d["dp"]["rows"]]


def _shadow(d: dict) -> list[tuple[str, str]]:
    o, a = d["shadow"]["overhead"], d["shadow"]["auto"]
    return [("serving throughput with every shadow pair / without", f"{o['throughput_ratio']:.3f}x"),
            (f"--auto-policy mean TTFT / the best fixed policy's ({a['best_fixed']})",
             f"{a['auto_vs_best_fixed_ttft']:.2f}")]


def _shapes(d: dict) -> list[tuple[str, str]]:
    rows = []
    for name, shape in d["shapes"].items():
        for precision in ("bf16", "q8_0", "q4_k_m"):
            pair = {r["system"]: r for r in shape["rows"] if r["precision"] == precision}
            if len(pair) == 2:
                ours, theirs = pair["radixserve"], pair["llama.cpp"]
                rows.append((f"{name} {precision} vs llama.cpp: batch 1, 8, 32; prefill 512, 2048", ", ".join(
                    f"{ours[k] / theirs[k]:.2f}x" for k in ("decode_1", "decode_8", "decode_32", "prefill_512",
                                                           "prefill_2048"))))
    return rows + [(name, f"not run: {why}") for name, why in d.get("skipped_shapes", {}).items()]


def _prefix_groups(d: dict) -> list[tuple[str, str]]:
    rows = []
    for g, systems in d["median_tok_s"].items():
        if "llama.cpp" in systems:
            ours, theirs = systems["radixserve"], systems["llama.cpp"]
            rows.append((f"{g} shared prefix group(s), 32 requests: first pass, repeat vs llama.cpp",
                         f"{ours['first'] / theirs['first']:.2f}x, {ours['repeat'] / theirs['repeat']:.2f}x"))
    return rows


HEADLINES: dict[str, Callable[[dict], list[tuple[str, str]]]] = {
    "speculative": _speculative, "deterministic": _deterministic, "kv_tiers": _kv_tiers, "shared_cpu": _shared_cpu,
    "shared": _shared, "unique": _unique, "multiturn": _multiturn, "forward": _forward, "overhead": _overhead,
    "grammar": _grammar, "quant": _quant, "compile": _compile, "peer": _peer, "radix": _radix, "tp": _tp,
    "dp": _dp, "shadow": _shadow, "shapes": _shapes, "prefix_groups": _prefix_groups}


def figures_markdown(root: Path) -> tuple[str, list[str]]:
    """The performance page's figures and the problems found (a results file without its machine or commit, no
    results files at all): (markdown, problems)."""
    out, problems, files = [], [], results_files(root / "benchmarks" / "results")
    for stage, path in files:
        d = json.loads(path.read_text())
        rel = path.relative_to(root)
        m = d.get("machine") or {}
        if not m.get("commit") or not d.get("started"):
            problems.append(f"{rel} names no machine commit or start time")
            continue
        later = freshness(root, stage, m)
        if later is None:
            status = f"**unknown**: commit {m['commit']} is not in this checkout's history"
        elif later:
            status = (f"**stale**: {len(later)} later commit{'s' if len(later) > 1 else ''} changed what it "
                      f"measures (the newest: `{later[0]}`)")
        else:
            status = "current: no later commit changed what it measures"
        if m.get("uncommitted_changes"):
            status += " (measured with uncommitted changes in the checkout)"
        build = m.get("radixserve_march", "native")
        if m.get("onednn_max_cpu_isa"):
            build += f" (torch's oneDNN held to {m['onednn_max_cpu_isa']})"
        out += [f"### {stage}" + (f" ({path.parent.parent.name})" if path.parent.parent.name != "results" else ""),
                "", f"- file: `{rel}`",
                f"- measured: {d['started']} at commit `{m['commit']}` on {m.get('cpu', '?')}, "
                f"{m.get('cpus_in_mask', '?')} CPUs, C++ kernels built for {build}, load average "
                f"{m.get('load_average_at_start', float('nan')):.1f} at the start",
                f"- status: {status}", ""]
        headline = HEADLINES.get(stage)
        if headline is None:
            problems.append(f"{rel}: benchmarks/provenance.py has no headline for stage {stage!r}")
            continue
        out += ["| figure | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in headline(d)] + [""]
    if not files:
        problems.append("no committed results files under benchmarks/results")
    return "\n".join(out), problems
