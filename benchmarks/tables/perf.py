"""The performance tables of the docs, generated from ``benchmarks/results/``.

    python3 -m bucketwise.benchmarks tables            # rewrite the generated sections
    python3 -m bucketwise.benchmarks tables --check    # exit 1 if they are not what this would write

Every ``results.jsonl`` under ``benchmarks/results/<folder>/`` (at any depth) is one run of
the ``ddp`` harness. A folder holds one run, or several of one experiment in sub-folders (the same
command on several machines, a sweep's bucket caps). For each folder this writes one table: a
row per config, a column per run, each cell the median step of the slowest rank in ms and its
ratio to the run's floor (``local``; ``local-ro`` for the CUDA-graph configs when the run has
it, marked ``ro``), as the ``ddp`` harness recorded them; for a run of several rounds
(``--rounds``) the medians over rounds, then the largest per-round ratio and the spread of the
round medians. The folder's link text is the first heading of its ``README.md``.

- ``docs/performance.md``, between ``<!-- perf-tables:begin -->`` and ``<!-- perf-tables:end -->``:
  every folder, grouped by hardware (ranks x GPU) and date, newest first.
- ``README.md``, between ``<!-- perf-current:begin -->`` and ``<!-- perf-current:end -->``: per
  world size of ``MAIN_WORLD_SIZES``, the newest folder on the default net that ran ``local`` and
  the default, ``bw-auto``;
  between ``<!-- perf-first-step:begin -->`` and ``<!-- perf-first-step:end -->``: the newest cold
  and warm first steps (``tax --restarts``, one GPU, torch's bytecode cached) per model and config.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

from bucketwise.benchmarks.core.output import THREAD_ONLY_MARK, THREAD_ONLY_NOTE, cold_graphs_text, step_cpu
from bucketwise.benchmarks.tables.sweep import load_run

MAIN_WORLD_SIZES = (2, 4)
"""The README's current tables: one per world size, runs on the default net with DDP's default
bucket cap and NCCL untuned."""
MAIN_CONFIGS = ("local", "bw-auto")
"""Configs the README's folder must have run (the floor and ``bucketwise.compile``'s default)."""
SAME = ("world_size", "device_name", "torch", "net")
"""Meta fields every run of one folder must share (with the model)."""

PERF_DOC = "docs/performance.md"
README = "README.md"
ALL_MARKERS = ("<!-- perf-tables:begin -->", "<!-- perf-tables:end -->")
CURRENT_MARKERS = ("<!-- perf-current:begin -->", "<!-- perf-current:end -->")
REPOSITORY_TREE = "https://github.com/bucketwise/bucketwise/tree/main/"
TAX_MARKERS = ("<!-- perf-tax:begin -->", "<!-- perf-tax:end -->")
PROBE_ROW = "all-gradient allreduce"
"""The last row: the ``ddp`` harness's probe, one allreduce of all gradient bytes (the communication floor)."""
NETS = {"default": "NCCL default transport", "socket": "NCCL over loopback TCP sockets"}


@dataclasses.dataclass
class Run:
    label: str
    """Path of the run inside its folder (``run-1``, ``cap-5``), ``""`` for a folder's only run."""
    meta: dict[str, Any]
    rows: list[dict[str, Any]]


@dataclasses.dataclass
class Folder:
    name: str
    title: str
    runs: list[Run]

    @property
    def meta(self) -> dict[str, Any]:
        return self.runs[0].meta

    @property
    def newest(self) -> str:
        return max(r.meta["date"] for r in self.runs)

    @property
    def hardware(self) -> str:
        return f"{self.meta['world_size']} x {self.meta['device_name']}"


def collect(results: Path) -> list[Folder]:
    """Every folder of ``results`` that holds at least one ``results.jsonl``."""
    folders = []
    for folder in sorted(p for p in results.iterdir() if p.is_dir()):
        runs = []
        for path in sorted(folder.rglob("results.jsonl")):
            meta, rows = load_run(str(path.parent))
            label = "" if path.parent == folder else path.parent.relative_to(folder).as_posix()
            runs.append(Run(label, meta, rows))
        if not runs:
            continue
        runs.sort(key=lambda r: (r.meta["date"], r.label))
        differ = [k for k in (*SAME, "model") if any(_field(r.meta, k) != _field(runs[0].meta, k) for r in runs)]
        if differ:
            raise SystemExit(
                f"tables: error: the runs of {folder} differ in {', '.join(differ)}; "
                "put runs of other hardware, software, model or net in a folder of their own"
            )
        folders.append(Folder(folder.name, _title(folder), runs))
    return folders


def _field(meta: dict[str, Any], key: str) -> Any:
    return meta["model"]["model"] if key == "model" else meta.get(key)


def _title(folder: Path) -> str:
    readme = folder / "README.md"
    if readme.exists():
        for line in readme.read_text().splitlines():
            if line.startswith("# "):
                return line[2:].strip()
    return folder.name


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    if row.get("status") != "ok":
        return str(row.get("status", "-"))
    ratio = row.get("floor_ratio")
    spread = row.get("round_spread")
    rounds = "" if spread is None else f"spread {spread['pct']:.1f}%"
    if ratio is None:
        return f"{row['median_ms']:.2f}" + (f" ({rounds})" if rounds else "")
    mark = " ro" if row.get("floor_config") == "local-ro" else ""
    if rounds:
        rounds = f"; max round {row['max_round_floor_ratio']:.2f}x, {rounds}"
    return f"{row['median_ms']:.2f} ({ratio:.2f}x{mark}{rounds})"


def _configs(runs: Sequence[Run]) -> list[str]:
    """Every config of the runs, in the order they first ran; a repeat (``bw-fused#2``) right
    after its config."""
    seen: list[str] = []
    for run in runs:
        seen += [r["config"] for r in run.rows if r["config"] not in seen]
    bases = [c for c in seen if "#" not in c]
    base_of = lambda c: c.split("#")[0]  # noqa: E731
    return sorted(seen, key=lambda c: (bases.index(base_of(c)) if base_of(c) in bases else len(bases), c))


def _run_header(run: Run, single: bool) -> str:
    cap = run.meta.get("bucket_cap_mb")
    head = "step ms (x floor)" if single else f"`{run.label}`"
    return head + (f", cap {cap:g} MiB" if cap is not None else "")


def folder_table(folder: Folder, link: str) -> list[str]:
    """The caption and table of one folder; ``link`` points at the folder from the page."""
    m = folder.meta
    model = m["model"]
    steps = sorted({r.meta["steps"] for r in folder.runs})
    rounds = sorted({r.meta.get("rounds", 1) for r in folder.runs})
    caption = (
        f"[{folder.title}]({link}): {folder.hardware}, torch {m['torch']}, model `{model['model']}` "
        f"({model['params']:,} parameters), {NETS.get(m['net'], m['net'])}, {folder.newest[:10]}; "
        f"{'/'.join(map(str, steps))} timed steps"
        + (f", {'/'.join(map(str, rounds))} interleaved rounds (medians over rounds)" if rounds != [1] else "")
    )
    single = len(folder.runs) == 1
    lines = [
        caption,
        "",
        "| config | " + " | ".join(_run_header(r, single) for r in folder.runs) + " |",
        "| --- |" + " ---: |" * len(folder.runs),
    ]
    for config in _configs(folder.runs):
        cells = [_cell(next((r for r in run.rows if r["config"] == config), None)) for run in folder.runs]
        lines.append(f"| `{config}` | " + " | ".join(cells) + " |")
    probes = [_probe_ms(r.meta) for r in folder.runs]
    if any(p is not None for p in probes):
        lines.append(f"| {PROBE_ROW} | " + " | ".join("-" if p is None else f"{p:.2f}" for p in probes) + " |")
    return lines


def _probe_ms(meta: dict[str, Any]) -> float | None:
    """The run's allreduce probe: the median over rounds of each round's (``--rounds``), else its one."""
    by_round = [p["median_ms"] for p in meta.get("allreduce_probe_rounds") or []]
    if by_round:
        return statistics.median(by_round)
    return (meta.get("allreduce_probe") or {}).get("median_ms")


def all_tables(folders: Sequence[Folder], link_root: str) -> str:
    """Every folder, grouped by hardware (fewest ranks first), then date (newest first)."""
    lines: list[str] = []
    by_hw: dict[str, list[Folder]] = {}
    for f in sorted(folders, key=lambda f: (f.meta["world_size"], f.meta["device_name"])):
        by_hw.setdefault(f.hardware, []).append(f)
    for hardware, group in by_hw.items():
        lines += [f"### {hardware}", ""]
        dates = sorted({f.newest[:10] for f in group}, reverse=True)
        for date in dates:
            lines += [f"#### {hardware}, {date}", ""]
            for f in sorted(
                (f for f in group if f.newest[:10] == date), key=lambda f: (f.newest, f.name), reverse=True
            ):
                lines += folder_table(f, f"{link_root}{f.name}/") + [""]
    return "\n".join(lines).rstrip("\n")


def current_folder(folders: Sequence[Folder], world_size: int) -> Folder | None:
    """The newest folder of ``world_size`` ranks on the default net, with the default bucket cap
    and NCCL untuned, that ran ``MAIN_CONFIGS``."""

    def main(f: Folder) -> bool:
        return (
            _field(f.meta, "world_size") == world_size
            and _field(f.meta, "net") == "default"
            and all(r.meta.get("bucket_cap_mb") is None for r in f.runs)
            and not any(_nccl_tuned(r.meta) for r in f.runs)
            and set(MAIN_CONFIGS) <= set(_configs(f.runs))
        )

    candidates = [f for f in folders if main(f)]
    return max(candidates, key=lambda f: f.newest) if candidates else None


def _nccl_tuned(meta: dict[str, Any]) -> bool:
    """A run with NCCL's channels or CTAs set by the environment (a lever measured, not what a
    user runs)."""
    env = meta.get("env") or {}
    return any(env.get(k) for k in ("NCCL_MAX_CTAS", "NCCL_MIN_CTAS", "NCCL_MAX_NCHANNELS", "NCCL_MIN_NCHANNELS"))


def current_table(folders: Sequence[Folder], link_root: str) -> str:
    """The newest folder's table per world size of ``MAIN_WORLD_SIZES``, fewest ranks first."""
    found = [f for f in (current_folder(folders, n) for n in MAIN_WORLD_SIZES) if f is not None]
    if not found:
        return f"(no results on {' or '.join(map(str, MAIN_WORLD_SIZES))} ranks under benchmarks/results/)"
    return "\n\n".join("\n".join(folder_table(f, f"{link_root}{f.name}/")) for f in found)


def _ratio(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


def tax_tables(results: Path, link_root: str) -> str:
    """One table per ``tax`` folder (``<folder>/<model>/results.json``): per model and
    config, peak memory, CPU issue and GPU time over the config's floor."""
    out = []
    for folder in sorted(p for p in results.iterdir() if p.is_dir()):
        found = [{**json.loads(f.read_text()), "run": f.parent.name} for f in sorted(folder.glob("*/results.json"))]
        found = [r for r in found if "pairs" in r.get("meta", {})]
        runs = [r for r in found if r["rows"]]
        restarts = [r for r in found if r.get("restarts")]
        if not runs and not restarts:
            continue
        meta = (runs or restarts)[0]["meta"]
        out += [
            f"### [{folder.name}]({link_root}{folder.name}/)",
            "",
            f"{meta['gpu'] or meta['device']}, world size {meta['world_size']}, torch {meta['torch']}"
            + (f", Python bytecode for torch {meta['python_bytecode']}" if "python_bytecode" in meta else "")
            + (f"; configs side by side in one process, {meta['pairs']} interleaved rounds." if runs else "."),
            "",
        ]
        if runs:
            out += [
                "| model | config | floor | peak MiB | peak x floor | CPU issue ms | issue x floor | CPU time ms "
                "| CPU time x floor | step ms | step x floor | GPU ms | GPU x floor | host us/launch |",
                "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            ]
        marked = False  # a row with the issuing thread's CPU time only (NOTE [a step's CPU time])
        labels = [_model(run["meta"]) for run in runs]
        for run, label in zip(runs, labels):
            if labels.count(label) > 1:  # the same model run several ways: name each run
                label = f"{label}, `{run['run']}`"
            rows = [r for r in run["rows"] if "error" not in r]
            peaks = {r["config"]: r["first_peak_mib"] for r in rows}
            for r in rows:
                peak_ratio = r["first_peak_mib"] / peaks[r["floor"]] if peaks.get(r["floor"]) else None
                gpu = "-" if r.get("gpu_ms") is None else f"{r['gpu_ms']:.2f}"
                launch = "-" if r.get("host_us_per_launch") is None else f"{r['host_us_per_launch']:.1f}"
                step = "-" if r.get("step_ms_median") is None else f"{r['step_ms_median']:.2f}"
                cpu_ms, cpu_ratio, thread_only = step_cpu(r)
                cpu = "-" if cpu_ms is None else f"{cpu_ms:.2f}" + (THREAD_ONLY_MARK if thread_only else "")
                marked |= thread_only
                out.append(
                    f"| {label} | `{r['config']}` | `{r['floor']}` | {r['first_peak_mib']:,.0f} "
                    f"| {_ratio(peak_ratio)} | {r['issue_ms_median']:.2f} | {_ratio(r.get('issue_ratio'))} "
                    f"| {cpu} | {_ratio(cpu_ratio)} | {step} | {_ratio(r.get('step_ratio'))} "
                    f"| {gpu} | {_ratio(r.get('gpu_ratio'))} | {launch} |"
                )
            for r in run["rows"]:
                if "error" in r:
                    out.append(f"| {label} | `{r['config']}` | failed | | | | | | | | | | | |")
        if marked:
            out += ["", THREAD_ONLY_NOTE]
        out += ["", *restart_table(restarts)] if runs else restart_table(restarts)
    return "\n".join(out).rstrip("\n")


def _layers(meta: dict[str, Any]) -> int | None:
    """The model's depth, where the run recorded it."""
    return (meta.get("sizes") or {}).get("layers")


def _model(meta: dict[str, Any]) -> str:
    """The model and its depth (``llama, 32 layers``) where the run recorded it."""
    layers = _layers(meta)
    return meta["model"] if layers is None else f"{meta['model']}, {layers} layers"


def restart_table(runs: Sequence[dict[str, Any]]) -> list[str]:
    """First steps in new processes (``tax --restarts``): cold and warm, per model and
    config, with the ratios the DDP-tax goals name."""
    if not runs:
        return []
    rounds = runs[0]["restarts"]["rounds"]
    fresh = any("fresh_restart_s" in r for run in runs for r in run["restarts"]["summary"].values())
    out = [
        f"First steps, each in a new process over its own compile caches, {rounds} interleaved rounds (medians"
        + (
            "; a fresh machine restart builds and compiles the model over empty caches from the cold run's "
            "compiled artifacts, then takes its first step, against the same in the warm process):"
            if fresh
            else "):"
        ),
        "",
        "| model | config | cold first step s | cold x `torch` | warm first step s | warm x non-graphed "
        "| first step accounted | cold FX graphs / cache hits |"
        + (" fresh machine restart s | x warm restart |" if fresh else ""),
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if fresh else ""),
    ]
    seen = collections.Counter((_model(run["meta"]), c) for run in runs for c in run["restarts"]["summary"])
    for run in runs:
        for config, r in run["restarts"]["summary"].items():
            accounted = r.get("first_step_accounted")
            model = _model(run["meta"])
            if seen[model, config] > 1:  # the same model and config in several runs of the folder: name the run
                model += f" (`{run['run']}/`)"
            out.append(
                f"| {model} | `{config}` | {_ratio(r['cold_s'])} | {_ratio(r.get('cold_over_torch'))} "
                f"| {_ratio(r['warm_s'])} | {_ratio(r.get('warm_over_uncaptured'))} "
                f"| {'-' if accounted is None else f'{accounted:.1%}'} | {cold_graphs_text(r)} |"
                + (f" {_ratio(r.get('fresh_restart_s'))} | {_ratio(r.get('fresh_over_warm'))} |" if fresh else "")
            )
    return [*out, ""]


FIRST_STEP_MARKERS = ("<!-- perf-first-step:begin -->", "<!-- perf-first-step:end -->")
FIRST_STEP_CONFIGS = (
    "local",
    "torch",
    "regional",
    "bw-fused",
    "bw-fused-cg",
    "bw-fused-blocks",
    "bw-fused-blocks-cg",
)
"""The README's first-step table: these configs, in this order, where a run has them."""


def first_step_table(results: Path, link_root: str) -> str:
    """The README's first-step table: per model and config, the newest ``tax --restarts`` run
    over a Python that ran torch from cached bytecode (as after a pip install: NOTE [compiled
    bytecode]), cold and warm first steps and the fresh-machine restart, with its folder."""
    newest: dict[tuple[str, str], tuple[str, str, dict[str, Any], dict[str, Any]]] = {}
    for path in sorted(results.glob("*/*/results.json")):
        run = json.loads(path.read_text())
        meta = run.get("meta", {})
        if not run.get("restarts") or meta.get("python_bytecode") != "cached" or meta.get("world_size") != 1:
            continue
        for config, row in run["restarts"]["summary"].items():
            key = (_model(meta), config)
            if config in FIRST_STEP_CONFIGS and (key not in newest or meta["date"] > newest[key][0]):
                newest[key] = (meta["date"], path.parent.parent.name, meta, row)
    if not newest:
        return "No first-step runs with torch's bytecode cached yet."
    out = [
        "| model | config | cold first step s | warm first step s | fresh machine / warm restart | GPU, torch | run |",
        "| --- | --- | ---: | ---: | ---: | --- | --- |",
    ]
    order = {c: i for i, c in enumerate(FIRST_STEP_CONFIGS)}

    def by_model_depth_config(item: tuple) -> tuple:
        (_, config), (_, _, meta, _) = item
        return meta["model"], _layers(meta) or 0, order[config]

    for (model, config), (_, folder, meta, row) in sorted(newest.items(), key=by_model_depth_config):
        out.append(
            f"| {model} | `{config}` | {_ratio(row['cold_s'])} | {_ratio(row['warm_s'])} "
            f"| {_ratio(row.get('fresh_over_warm'))} | {meta['gpu']}, {meta['torch']} "
            f"| [{folder}]({link_root}{folder}/) |"
        )
    return "\n".join(out)


def replace_between(text: str, markers: tuple[str, str], body: str, where: str) -> str:
    begin, end = markers
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise SystemExit(f"tables: error: {where} needs one {begin} line, then one {end} line")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def generated(root: Path) -> dict[Path, str]:
    """The new text of each generated file."""
    folders = collect(root / "benchmarks" / "results")
    out = {}
    for name, markers, body in (
        (PERF_DOC, ALL_MARKERS, all_tables(folders, "../benchmarks/results/")),
        # Absolute: a package index shows README.md away from the repository.
        (README, CURRENT_MARKERS, current_table(folders, REPOSITORY_TREE + "benchmarks/results/")),
        (PERF_DOC, TAX_MARKERS, tax_tables(root / "benchmarks" / "results", "../benchmarks/results/")),
        (
            README,
            FIRST_STEP_MARKERS,
            first_step_table(root / "benchmarks" / "results", REPOSITORY_TREE + "benchmarks/results/"),
        ),
    ):
        path = root / name
        out[path] = replace_between(out.get(path, path.read_text()), markers, body, name)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0].replace("``", ""))
    p.add_argument("--check", action="store_true", help="exit 1 if a generated section is not current; write nothing")
    p.add_argument(
        "--root",
        default=str(Path(__file__).resolve().parents[2]),
        help="repository root (default: the one holding this script)",
    )
    args = p.parse_args(argv)
    stale = []
    for path, text in generated(Path(args.root)).items():
        if path.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(text)
            print(f"wrote {path}")
    if args.check and stale:
        print(
            "not current: " + ", ".join(map(str, stale)) + "; run python3 -m bucketwise.benchmarks tables",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
