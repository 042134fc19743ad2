"""Results of a comparison: a table on the terminal, a JSON file, PNG plots (matplotlib)."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any


def fmt_s(v: float) -> str:
    return "-" if v != v else (f"{v * 1000:.0f}ms" if v < 10 else f"{v:.1f}s")


def label(r: dict[str, Any]) -> str:
    """A run's name: its policy pair (and write policy, with KV tiers), and its routing over replicas when it had
    several."""
    pair = f"{r['eviction']}/{r['schedule']}" + (f"/{r['write']}" if r.get("write") else "")
    return pair if r.get("replicas", 1) == 1 else f"{pair} {r['routing']} x{r['replicas']}"


def table(rows: list[dict[str, Any]]) -> str:
    """One line per run; the starvation columns: cold requests' TTFT p99 and the share of all TTFT the slowest
    5% carry."""
    head = f"{'mode':5} {'eviction':16} {'schedule':16} {'routing':>16} {'cache':>7} {'reqs':>6} {'hit rate':>8} " \
           f"{'TTFT p50':>9} {'mean':>9} {'TTFT p99':>9} {'cold p99':>9} {'slow 5%':>7} {'tok/s':>8} {'evicted':>8}"
    tiers = any(r.get("write") for r in rows)
    if tiers:  # simulated KV tiers: the write policy and each tier's share of the prompt tokens
        head += f" {'write':24} {'L1':>6} {'L2':>6} {'L3':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        routing = f"{r['routing']} x{r['replicas']}" if r.get("replicas", 1) > 1 else "-"
        cold, share, avg = r.get("cold_ttft_p99_s"), r.get("slowest5_ttft_share"), r.get("ttft_mean_s")
        lines.append(f"{r['mode']:5} {r['eviction']:16} {r['schedule']:16} {routing:>16} {r['cache_tokens']:>7} "
                     f"{r['requests']:>6} {r['hit_rate']:>8.3f} {fmt_s(r['ttft_p50_s']):>9} "
                     f"{fmt_s(avg if avg is not None else float('nan')):>9} "
                     f"{fmt_s(r['ttft_p99_s']):>9} {fmt_s(cold if cold is not None else float('nan')):>9} "
                     f"{'-' if share is None else f'{share:.0%}':>7} {r['throughput_tokens_per_s']:>8.1f} "
                     f"{r.get('evicted_tokens', '-')!s:>8}"
                     + (f" {r.get('write') or '-':24} " + " ".join(
                         f"{r['tier_hit_rates'][t]:>6.1%}" if r.get("tier_hit_rates") else f"{'-':>6}"
                         for t in ("L1", "L2", "L3")) if tiers else ""))
    return "\n".join(lines)


def ranking(rows: list[dict[str, Any]], key: str = "hit_rate") -> list[str]:
    """Policy pairs from best to worst by ``key`` (higher is better)."""
    return [label(r) for r in sorted(rows, key=lambda r: -r[key])]


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, default=str))


def plot_hit_rate_vs_cache(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in rows:
        series[label(r)].append((r["cache_tokens"], r["hit_rate"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV cache size (tokens)")
    ax.set_ylabel("cache hit rate (cached / prompt tokens)")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ttft(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """TTFT p50 and p99 per policy pair; simulated and live side by side when both are there."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({label(r) for r in rows})
    modes = sorted({r["mode"] for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(max(6, 1.3 * len(names)) * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        by_name = {label(r): r for r in rows if r["mode"] == mode}
        xs = range(len(names))
        p50 = [by_name[n]["ttft_p50_s"] if n in by_name else 0 for n in names]
        p99 = [by_name[n]["ttft_p99_s"] if n in by_name else 0 for n in names]
        ax.bar([x - 0.2 for x in xs], p50, width=0.4, label="p50")
        ax.bar([x + 0.2 for x in xs], p99, width=0.4, label="p99")
        ax.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("time to first token (s)")
        ax.set_title(f"{title} ({mode})")
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
