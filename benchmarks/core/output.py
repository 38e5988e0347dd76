"""Result files: ``results.jsonl`` (a meta object, then one object per config) and ``results.md``."""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Sequence

from bucketwise.benchmarks.core.configs import floor_config

MD_COLUMNS = (
    "config",
    "median ms",
    "min ms",
    "max ms",
    "p90 ms",
    "CPU issue ms",
    "CPU time ms",
    "x floor",
    "first step s",
    "warm first step s",
    "compile s",
    "peak MiB",
    "{unit}/s",
    "NCCL ms/step",
    "overlapped ms/step",
    "exposed ms/step",
    "final loss",
    "notes",
)

# Recorded in the meta line (``None`` when unset), never set by the harness.
RECORD_ENV = (
    "NCCL_MAX_NCHANNELS",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_CTAS",
    "NCCL_MIN_CTAS",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "CUDA_VISIBLE_DEVICES",
)


def safe_name(config: str) -> str:
    """A file-name-safe form of a config name (``bw-split#2`` -> ``bw-split_2``)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", config)


def _clean(value: Any) -> Any:
    """JSON-safe: non-finite floats become ``None`` (strict JSON has no NaN/Infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_jsonl(path: str, meta: dict[str, Any], rows: Sequence[dict[str, Any]]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for obj in (meta, *rows):
            f.write(json.dumps(_clean(obj), allow_nan=False) + "\n")
    os.replace(tmp, path)


def read_jsonl(path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The meta object and the result records of a ``results.jsonl``."""
    with open(path) as f:
        objs = [json.loads(line) for line in f if line.strip()]
    if not objs or objs[0].get("type") != "meta":
        raise ValueError(f"{path}: expected a meta line first")
    return objs[0], objs[1:]


def add_floor_ratios(rows: list[dict[str, Any]]) -> None:
    """``floor_ratio`` = median step / median step of the compute floor (``local``, or
    ``local-ro`` for the CUDA-graph configs, ``*-ro`` and ``*-cg``, when it ran). With
    ``--rounds`` (rows with ``rounds``) the medians are those over rounds, each round gets its
    own ``floor_ratio`` (its median over the floor's in the same round) and the row
    ``max_round_floor_ratio``, the largest of them."""
    ok = {r["config"]: r for r in rows if r.get("status") == "ok"}
    medians = {c: r.get("median_ms") for c, r in ok.items()}
    for r in rows:
        if r.get("status") != "ok":
            continue
        floor = floor_config(r["config"])
        if medians.get(floor) is None:
            floor = "local"
        base = medians.get(floor)
        r["floor_config"] = floor if base else None
        r["floor_ratio"] = r["median_ms"] / base if base else None
        if "rounds" in r:
            floor_rounds = ok[floor]["rounds"] if base else []
            ratios = [mine["median_ms"] / theirs["median_ms"] for mine, theirs in zip(r["rounds"], floor_rounds)]
            for mine, ratio in zip(r["rounds"], ratios):
                mine["floor_ratio"] = ratio
            r["max_round_floor_ratio"] = max(ratios) if ratios else None


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


ROUND_COLUMNS = {"p90 ms": ("round medians ms", "round spread"), "x floor": ("max round x floor",)}
"""With ``--rounds``: the columns after each of these."""


def md_columns(rounds: bool) -> list[str]:
    """The table's columns, ``ROUND_COLUMNS`` added for a run of several rounds."""
    if not rounds:
        return list(MD_COLUMNS)
    return [c for column in MD_COLUMNS for c in (column, *ROUND_COLUMNS.get(column, ()))]


def _md_row(r: dict[str, Any], rounds: bool = False) -> list[str]:
    name = r["config"]
    width = len(md_columns(rounds))
    where = f" (round {r['round']})" if r.get("round") else ""
    if r.get("status") == "error":
        return [name] + ["-"] * (width - 2) + [f"error{where}: " + _one_line(r.get("error", ""), 160)]
    if r.get("status") == "skipped":
        return [name] + ["-"] * (width - 2) + ["skipped: " + _one_line(r.get("skipped", ""), 160)]
    ratio = r.get("floor_ratio")
    issue = r.get("per_rank", {}).get("cpu_issue_ms")
    cpu = r.get("per_rank", {}).get("cpu_time_ms")  # absent from runs before NOTE [a step's CPU time]
    spread = r.get("round_spread")
    by_round = (
        [
            "-" if spread is None else f"{spread['min_ms']:,.2f}-{spread['max_ms']:,.2f}",
            "-" if spread is None else f"{spread['pct']:.1f}%",
        ]
        if rounds
        else []
    )
    max_round = r.get("max_round_floor_ratio")
    return [
        name,
        _fmt(r["median_ms"]),
        _fmt(r["min_ms"]),
        _fmt(r["max_ms"]),
        _fmt(r.get("spread", {}).get("p90_ms")),
        *by_round,
        _fmt(max(d["median"] for d in issue) if issue else None),
        _fmt(max(d["median"] for d in cpu) if cpu else None),
        "-" if ratio is None else f"{ratio:.2f}",
        *(["-" if max_round is None else f"{max_round:.2f}"] if rounds else []),
        _fmt(r["first_step_s"]),
        _fmt(r.get("warm_first_step_s")),
        _fmt(r.get("compile_s")),
        _fmt(r.get("peak_mib"), 0),
        _fmt(r.get("throughput_per_s"), 0),
        _fmt(r.get("nccl_ms_per_step")),
        _fmt(r.get("overlapped_ms_per_step")),
        _fmt(r.get("exposed_ms_per_step")),
        _fmt(r.get("losses", {}).get("final_loss"), 4),
        _one_line("; ".join(r.get("notes", [])), 200) or "-",
    ]


def _one_line(text: str, limit: int) -> str:
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _meta_lines(meta: dict[str, Any]) -> list[str]:
    model = meta["model"]
    sizes = ", ".join(f"{k}={model[k]}" for k in model["size_meaning"])
    probe = meta.get("allreduce_probe") or {}
    rounds = meta.get("rounds", 1)
    lines = [
        f"- date: {meta['date']}",
        f"- command: `{meta['command']}`",
        f"- device: {meta['device_name']} x {meta['world_size']} ranks ({meta['dist_backend']}), net: {meta['net']}",
        f"- torch {meta['torch']}"
        + (f", triton {meta['triton']}" if meta.get("triton") else "")
        + f", compile backend: {meta['compile_backend']}, bucket cap: "
        + (f"{meta['bucket_cap_mb']} MiB" if meta["bucket_cap_mb"] else "DDP default (25 MiB)"),
        f"- model: {model['model']} ({sizes}), {model['params']:,} parameters",
        f"- {meta['steps']} timed steps after the first step and {meta['warmup']} warm-up step(s) "
        f"({1 + meta['warmup'] + meta['steps']} training steps per config); step times of the slowest rank",
    ]
    if rounds > 1:
        lines[-1] = (
            f"- {rounds} interleaved rounds (every config, then every config again): each config built and "
            f"compiled once, in round 1 (its first step and {meta['warmup']} warm-up step(s), then "
            f"{meta['steps']} timed steps); each later round {meta['warmup']} warm-up and {meta['steps']} timed "
            f"steps more ({1 + rounds * (meta['warmup'] + meta['steps'])} training steps per config); step "
            "times of the slowest rank in each round, their median over rounds"
        )
    cache = meta.get("compile_cache")
    if cache:
        lines.append(
            "- compile caches (FX graph, AOTAutograd): "
            + (
                "off"
                if cache == "off"
                else "on, a fresh dir per job and config"
                + (", then the job again over them (warm first step)" if meta.get("restart") else "")
            )
        )
    env = {k: v for k, v in (meta.get("env") or {}).items() if k in RECORD_ENV and v is not None}
    if env:
        lines.append("- environment: " + " ".join(f"`{k}={v}`" for k, v in env.items()))
    if probe:
        bus = probe.get("busbw_gbps")
        lines.append(
            f"- allreduce probe ({probe['bytes'] / 2**20:,.1f} MiB fp32, the gradient bytes): "
            f"{probe['median_ms']:.2f} ms" + (f", bus bandwidth {bus:.1f} GB/s" if bus else "")
        )
        by_round = meta.get("allreduce_probe_rounds") or []
        if len(by_round) > 1:
            lines[-1] += " in round 1; per round: " + ", ".join(f"{p['median_ms']:.2f}" for p in by_round) + " ms"
    return lines


def write_markdown(path: str, meta: dict[str, Any], rows: Sequence[dict[str, Any]]) -> None:
    unit = meta["model"]["unit"]
    rounds = meta.get("rounds", 1) > 1
    header = [c.format(unit=unit) for c in md_columns(rounds)]
    lines = [f"# DDP benchmark: {meta['model']['model']}", "", *_meta_lines(meta), ""]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join("---" if i in (0, len(header) - 1) else "---:" for i in range(len(header))) + "|")
    lines.extend("| " + " | ".join(_md_row(r, rounds)) + " |" for r in rows)
    lines += [
        "",
        "p90: 90th percentile of the slowest rank's timed steps. CPU issue: median host time of the "
        "`step()` call (no sync; largest over ranks): near the step time when the CPU is the bottleneck. "
        "CPU time: the median CPU time of the process over that call, every thread (on a GPU the "
        "backward's host work runs on autograd's own thread; largest over ranks). "
        "first step: the first training step of a fresh process, compiling with empty compile caches; "
        "warm first step: the same in a second process over the caches the first one filled (`--restart`). "
        "x floor: median step / median step of `local` (compiled, no DDP: no gradient traffic; "
        "`local-ro` for CUDA-graph configs, `-ro` and `-cg`, when run). final loss: the loss of the "
        "last timed step, mean over ranks. NCCL/overlapped/exposed: from a profiler trace, "
        "NCCL kernel time, the part of it concurrent with compute kernels, and the rest, per step "
        "(an NCCL kernel also runs while it waits for the other ranks: figures of the rank with the "
        "least NCCL time, the one the others waited for; every rank's under `per_rank` in results.jsonl).",
        "",
    ]
    if rounds:
        lines[-2:-1] = [
            lines[-2],
            "",
            "Rounds: median, x floor and the other step figures are the medians over rounds of each round's "
            "median (min/max: the lowest and highest timed step of any round); round medians: the lowest and "
            "highest of them; round spread: (highest - lowest) / median; max round x floor: the largest ratio of "
            "a round's median to the floor's median in the same round. first step and compile s: round 1; peak: "
            "the largest over rounds, above what the other configs held; final loss: after every round. Each "
            "round's figures are under `rounds` in results.jsonl.",
        ]
    if meta.get("compile_cache") == "on":
        lines += _cache_lines(rows)
    with open(path, "w") as f:
        f.write("\n".join(lines))


def _cache_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Compile-cache lookups of rank 0 per bucketwise config, first and restarted job, as its
    report counts them (the other configs have no report)."""
    rows = [r for r in rows if (r.get("bucketwise") or {}).get("compile_times")]
    if not rows:
        return []

    def c(times: dict[str, Any] | None, name: str) -> str:
        return "-" if not times else "{hit}/{miss}/{bypass}".format(**times[name])

    lines = ["| config | FX graph cache h/m/b | warm | AOTAutograd cache h/m/b | warm |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        cold, warm = r["bucketwise"]["compile_times"], r.get("warm_compile_times")
        lines.append(
            f"| {r['config']} | {c(cold, 'fx_graph_cache')} | {c(warm, 'fx_graph_cache')} | "
            f"{c(cold, 'aot_autograd_cache')} | {c(warm, 'aot_autograd_cache')} |"
        )
    return [
        "",
        *lines,
        "",
        "h/m/b: compile-cache hits/misses/bypasses of rank 0 in the compiles of the first step and "
        "warm-up steps (the bucketwise report's); warm: the same in the restarted job.",
        "",
    ]


def cold_graphs_text(row: dict[str, Any]) -> str:
    """A summary row's cold FX graphs and FX-cache hits as ``graphs / hits`` (``-`` for runs that
    did not record them)."""
    graphs, hits = row.get("cold_fx_graphs"), row.get("cold_fx_hits")
    return "-" if graphs is None else f"{graphs:g} / {hits:g}"


THREAD_ONLY_MARK = "†"
THREAD_ONLY_NOTE = (
    "† the issuing thread's CPU time only (the run predates the process's figure): on a GPU it leaves "
    "out the backward's host work, which runs on autograd's own thread (NOTE [a step's CPU time])."
)


def step_cpu(row: dict[str, Any]) -> tuple[float | None, float | None, bool]:
    """A tax row's CPU time per step and its ratio to the floor: the process's (every thread)
    where the run measured it, else the issuing thread's; and whether it is the latter (NOTE [a
    step's CPU time])."""
    if row.get("process_cpu_ms_median") is not None:
        return row["process_cpu_ms_median"], row.get("process_cpu_ratio"), False
    if row.get("cpu_ms_median") is not None:
        return row["cpu_ms_median"], row.get("cpu_ratio"), True
    return None, None, False
