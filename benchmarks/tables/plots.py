"""PNG plots of a benchmark run: ``step_time.png`` and ``timeline.png``.

matplotlib is imported lazily; without it the plots are skipped with a note. Re-plot a finished
run with ``python -m bucketwise.benchmarks plots RESULTS_DIR [--timeline-config NAME]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence

from bucketwise.stats.runtime_view import plot_timeline, pyplot


def pyplot_or_none():
    """matplotlib's pyplot, or ``None`` (and a note that the plots are skipped) without it."""
    plt = pyplot()
    if plt is None:
        print("note: matplotlib is not installed; skipping plots (pip install matplotlib)", flush=True)
    return plt


def _color(config: str) -> str:
    for prefix, color in (("local", "tab:gray"), ("bw-", "tab:blue"), ("torch", "tab:orange")):
        if config.startswith(prefix):
            return color
    return "tab:green"


def plot_step_times(rows: Sequence[dict[str, Any]], path: str, title: str) -> bool:
    """Bar per successful config (median, min-max whiskers), floors as horizontal lines."""
    ok = [r for r in rows if r.get("status") == "ok"]
    plt = pyplot_or_none()
    if plt is None or not ok:
        return False
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(ok) + 2), 4.5))
    xs = range(len(ok))
    medians = [r["median_ms"] for r in ok]
    err = [[m - r["min_ms"] for m, r in zip(medians, ok)], [r["max_ms"] - m for m, r in zip(medians, ok)]]
    ax.bar(xs, medians, yerr=err, color=[_color(r["config"]) for r in ok], capsize=3)
    for x, m, r in zip(xs, medians, ok):
        ax.annotate(
            f"{m:.1f}",
            (x, r["max_ms"]),
            ha="center",
            va="bottom",
            fontsize=8,
            xytext=(0, 2),
            textcoords="offset points",
        )
    for name, style in (("local", "--"), ("local-ro", ":")):
        floor = next((r["median_ms"] for r in ok if r["config"] == name), None)
        if floor is not None:
            ax.axhline(floor, color="black", linestyle=style, linewidth=1, label=f"{name} floor {floor:.1f} ms")
    ax.set_xticks(list(xs), [r["config"] for r in ok], rotation=30, ha="right")
    ax.set_ylabel("median step time (ms), slowest rank")
    ax.set_title(title, fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def pick_timeline_config(rows: Sequence[dict[str, Any]], wanted: str | None, timeline_dir: str) -> str | None:
    """``wanted`` if given, else the first successful bucketwise config with a timeline, else the
    first config with one."""
    from bucketwise.benchmarks.core.output import safe_name

    have = [
        r["config"]
        for r in rows
        if r.get("status") == "ok" and os.path.exists(os.path.join(timeline_dir, safe_name(r["config"]) + ".json"))
    ]
    if wanted is not None:
        return wanted if wanted in have else None
    return next((c for c in have if c.startswith("bw-")), have[0] if have else None)


def make_plots(out_dir: str, meta: dict[str, Any], rows: Sequence[dict[str, Any]], timeline_config: str | None) -> None:
    from bucketwise.benchmarks.core.output import safe_name

    model = meta["model"]["model"]
    title = f"{model} on {meta['world_size']} x {meta['device_name']} ({meta['net']})"
    if plot_step_times(rows, os.path.join(out_dir, "step_time.png"), title):
        print(f"wrote {os.path.join(out_dir, 'step_time.png')}", flush=True)
    if meta["device"] != "cuda":
        print("note: timeline.png needs a CUDA profiler trace; skipped on CPU", flush=True)
        return
    timeline_dir = os.path.join(out_dir, "timeline")
    config = pick_timeline_config(rows, timeline_config, timeline_dir)
    if config is None:
        print(f"note: no profiler timeline for {timeline_config or 'any config'}; timeline.png skipped", flush=True)
        return
    with open(os.path.join(timeline_dir, safe_name(config) + ".json")) as f:
        data = json.load(f)
    if plot_timeline(data, os.path.join(out_dir, "timeline.png"), f"{config}: {title}, rank {data.get('rank', 0)}"):
        print(f"wrote {os.path.join(out_dir, 'timeline.png')} ({config})", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="a results directory written by the ddp harness")
    p.add_argument("--timeline-config", default=None)
    args = p.parse_args(argv)
    with open(os.path.join(args.out, "results.jsonl")) as f:
        objs = [json.loads(line) for line in f if line.strip()]
    meta = next(o for o in objs if o.get("type") == "meta")
    make_plots(args.out, meta, [o for o in objs if o.get("type") == "result"], args.timeline_config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
