"""``bucket_cap_mb`` sweep: one table and one plot from several the ``ddp`` harness runs that differ
only in ``--bucket-cap-mb``.

    python3 -m bucketwise.benchmarks sweep-table OUT_DIR DIR1 DIR2 ...

Each ``DIR`` holds the ``results.jsonl`` of one run; its bucket cap is read from the meta line
(unset: DDP's default, 25 MiB). Writes ``OUT_DIR/sweep.md`` (a row per bucket cap; per config,
the median step of the slowest rank and its ratio to that config's best cap) and
``OUT_DIR/sweep.png`` (median step vs bucket cap, log x axis, a line per config). Runs whose
model, ranks, device, net, compile backend or step counts differ are reported as a warning.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence

DDP_DEFAULT_CAP_MB = 25.0
SAME_KEYS = ("model", "world_size", "device_name", "net", "compile_backend", "steps", "warmup")
"""Meta fields that should agree between the runs of one sweep."""

Sweep = dict[float, dict[str, float]]
"""bucket cap (MiB) -> config -> median ms (successful configs only)."""


def load_run(run_dir: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The meta line and the result rows of ``run_dir/results.jsonl``."""
    with open(os.path.join(run_dir, "results.jsonl")) as f:
        objs = [json.loads(line) for line in f if line.strip()]
    metas = [o for o in objs if o.get("type") == "meta"]
    if not metas:
        raise SystemExit(f"sweep_table.py: error: no meta line in {run_dir}/results.jsonl")
    return metas[0], [o for o in objs if o.get("type") == "result"]


def cap_of(meta: dict[str, Any]) -> float:
    cap = meta.get("bucket_cap_mb")
    return float(cap) if cap is not None else DDP_DEFAULT_CAP_MB


def collect(run_dirs: Sequence[str]) -> tuple[Sweep, list[str], dict[float, str], list[dict[str, Any]]]:
    """The sweep, its configs (first-seen order), the run directory of each cap and the metas."""
    sweep: Sweep = {}
    configs: list[str] = []
    sources: dict[float, str] = {}
    metas = []
    for run_dir in run_dirs:
        meta, rows = load_run(run_dir)
        cap = cap_of(meta)
        if cap in sweep:
            raise SystemExit(f"sweep_table.py: error: bucket cap {cap:g} MiB in both {sources[cap]} and {run_dir}")
        sources[cap], sweep[cap] = run_dir, {}
        metas.append(meta)
        for r in rows:
            if r["config"] not in configs:
                configs.append(r["config"])
            if r.get("status") == "ok":
                sweep[cap][r["config"]] = r["median_ms"]
    return dict(sorted(sweep.items())), configs, sources, metas


def mismatches(metas: Sequence[dict[str, Any]]) -> list[str]:
    """The ``SAME_KEYS`` on which the runs disagree."""
    return [k for k in SAME_KEYS if any(m.get(k) != metas[0].get(k) for m in metas[1:])]


def best(sweep: Sweep, config: str) -> float | None:
    values = [by_config[config] for by_config in sweep.values() if config in by_config]
    return min(values) if values else None


def _cells(sweep: Sweep, cap: float, configs: Sequence[str]) -> list[str]:
    cells = []
    for config in configs:
        ms, floor = sweep[cap].get(config), best(sweep, config)
        cells += ["-", "-"] if ms is None or floor is None else [f"{ms:.2f}", f"{ms / floor:.2f}"]
    return cells


def markdown(sweep: Sweep, configs: Sequence[str], sources: dict[float, str], metas: Sequence[dict[str, Any]]) -> str:
    m = metas[0]
    lines = [
        f"# bucket_cap_mb sweep: {m['model']['model']}, {m['world_size']} x {m['device_name']} ({m['net']})",
        "",
        f"Median step of the slowest rank (ms) and its ratio to the config's best bucket cap (x best); "
        f"{m['steps']} timed steps, compile backend {m['compile_backend']}.",
        "",
        "| bucket_cap_mb | " + " | ".join(f"{c} ms | {c} x best" for c in configs) + " |",
        "|---:|" + "---:|" * (2 * len(configs)),
    ]
    lines += [f"| {cap:g} | " + " | ".join(_cells(sweep, cap, configs)) + " |" for cap in sweep]
    lines += ["", "Runs:", ""] + [f"- {cap:g} MiB: `{src}`" for cap, src in sources.items()]
    differ = mismatches(metas)
    if differ:
        lines += ["", f"**Warning**: the runs differ in {', '.join(differ)}; the rows are not comparable."]
    return "\n".join(lines) + "\n"


def plot(sweep: Sweep, configs: Sequence[str], path: str, title: str) -> bool:
    from bucketwise.benchmarks.tables.plots import pyplot_or_none

    plt = pyplot_or_none()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for config in configs:
        points = [(cap, by_config[config]) for cap, by_config in sweep.items() if config in by_config]
        if points:
            ax.plot(*zip(*points), marker="o", label=config)
    ax.set_xscale("log")
    ax.set_xticks(list(sweep), [f"{cap:g}" for cap in sweep])
    ax.minorticks_off()
    ax.set_xlabel("bucket_cap_mb (MiB, log scale)")
    ax.set_ylabel("median step time (ms), slowest rank")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0].replace("``", ""))
    p.add_argument("out", help="output directory (sweep.md, sweep.png)")
    p.add_argument("runs", nargs="+", help="results directories of the ddp harness, one per --bucket-cap-mb")
    args = p.parse_args(argv)
    sweep, configs, sources, metas = collect(args.runs)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep.md"), "w") as f:
        f.write(markdown(sweep, configs, sources, metas))
    print(f"wrote {os.path.join(args.out, 'sweep.md')}")
    differ = mismatches(metas)
    if differ:
        print(f"warning: the runs differ in {', '.join(differ)}", file=sys.stderr)
    m = metas[0]
    title = f"{m['model']['model']} on {m['world_size']} x {m['device_name']} ({m['net']}): bucket_cap_mb sweep"
    if plot(sweep, configs, os.path.join(args.out, "sweep.png"), title):
        print(f"wrote {os.path.join(args.out, 'sweep.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
