"""Where a config's host time per step goes beyond its floor's: CPU ops, CUDA runtime calls and
Python functions per step, side by side (one rank, one GPU).

    python -m bucketwise.benchmarks probe host_tax --model llama --layers 16 \
        --configs local,bw-auto,bw-auto@400 --out DIR

``CONFIG@MIB`` builds a config with DDP's ``bucket_cap_mb=MIB`` (the bucket count's share of the
tax). Every config is built once in the same process (``tax``'s ``build``), then timed in
interleaved rounds (``tax``'s ``timed_block``: host issue time and GPU time per step), then
profiled: ``torch.profiler`` (kernels, GPU kernel time, self CPU time and calls per step of every
CPU op and CUDA runtime call), ``cProfile`` (Python functions), and one step under
``torch.cuda.set_sync_debug_mode("warn")`` (device-to-host syncs per step). ``results.json`` has
every figure; ``results.md`` the ops whose host time per step differs most from the first
config's.

Every thread's share (``threads``): ``torch.profiler`` with Python stacks, each event's own time
(less its children's) summed per thread and per part of the step (Python functions by file, ops
by name): one profile per config after each timed block, the median over the rounds. The main
thread runs the forward and, on the CPU, the backward; on a GPU the autograd engine runs the
backward on a thread of its own, whose ops show under their thread and whose Python shows under
``other Python threads`` (the profiler names only the main thread's). The profiler's own cost
inflates Python's share: compare configs with each other, not with the timed steps.

Where there is no GPU, one gloo rank on the CPU (``--threads``: torch's threads): the
reproduction of a host-bound step that needs no GPU, e.g. a small HF Llama, ``--model llama
--layers 8 --d-model 128 --heads 4 --seq 16 --batch 1 --vocab 512 --threads 1``.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import re
import statistics
import warnings
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import bucketwise
from bucketwise.benchmarks.core.meta import run_meta
from bucketwise.benchmarks.core.models import MODELS, SIZE_FLAGS, make_spec
from bucketwise.benchmarks.probes._one_rank import one_rank
from bucketwise.benchmarks.tax.bench import build, kernel_profile, sync, timed_block

STEPS = 5
"""Profiled steps per config (per profile)."""
TOP = 30


def parse_config(name: str) -> tuple[str, float | None]:
    """``bw-auto@400`` -> ``("bw-auto", 400.0)``; ``local`` -> ``("local", None)``."""
    config, _, cap = name.partition("@")
    return config, float(cap) if cap else None


def _activities() -> list[ProfilerActivity]:
    return [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])]


def host_ops(step: Any) -> dict[str, dict[str, float]]:
    """Calls and self CPU microseconds per step of every CPU op and CUDA runtime call."""
    sync()
    with profile(activities=_activities()) as prof:
        for _ in range(STEPS):
            step()
        sync()
    out: dict[str, dict[str, float]] = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            continue
        out[e.key] = {"calls": e.count / STEPS, "self_us": e.self_cpu_time_total / STEPS}
    return out


def python_functions(step: Any) -> dict[str, dict[str, float]]:
    """Calls and own seconds per step of every Python function (cProfile: the main thread's)."""
    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(STEPS):
        step()
    sync()
    prof.disable()
    out = {}
    for (path, line, fn), (_, calls, own, _, _) in pstats.Stats(prof).stats.items():
        out[f"{path.split('site-packages/')[-1]}:{line}({fn})"] = {"calls": calls / STEPS, "self_us": own * 1e6 / STEPS}
    return out


def syncs_per_step(step: Any) -> list[str]:
    """The device-to-host syncs of one step, as ``set_sync_debug_mode("warn")`` reports them."""
    if not torch.cuda.is_available():
        return []
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return [str(w.message)[:200] for w in caught if "synchroniz" in str(w.message)]


_PACKAGE = os.path.dirname(bucketwise.__file__) + os.sep
# The profiler names a file relative to the ``sys.path`` entry it was found under (the package's
# parent, or the package itself when run from its folder): its first part says whose it is.
_OWN = frozenset(os.listdir(_PACKAGE))
_COLLECTIVE_OPS = ("c10d::", "_c10d_functional::", "gloo:", "nccl:", "record_param_comms")
DYNAMO = "Dynamo: frame entry, guards"
AOT = "AOTAutograd's runtime wrappers"
INDUCTOR = "Inductor's compiled graphs' Python"
_PYTHON_PARTS = (
    ("torch/nn/parallel/distributed.py", "DDP's forward wrapper"),
    ("torch/_dynamo/", DYNAMO),
    ("torch/_functorch/", AOT),
    ("torch/_inductor/", INDUCTOR),
    ("torch/autograd/", "autograd"),
    ("torch/distributed/", "torch.distributed's Python"),
    ("torch/optim/", "optimizer"),
    ("torch/nn/modules/", "nn.Module calls"),
    ("nn.Module: ", "nn.Module calls"),
    ("torch/_tensor.py", "autograd"),
    ("torch/_ops.py", "torch ops' Python"),
    ("transformers/", "the model's Python, run eagerly"),
    ("<built-in", "calls into C from Python"),
)
_OP_PARTS = (
    ("TorchDynamo Cache Lookup", DYNAMO),
    ("Torch-Compiled Region", DYNAMO),
    ("## Call CompiledFxGraph", INDUCTOR),
    ("CompiledFunction", AOT),
    ("autograd::engine::evaluate_function: CompiledFunction", AOT),
    ("Optimizer.", "optimizer"),
    ("autograd::engine", "autograd"),
    ("torch::autograd::", "autograd"),
)


# A Python function's event, as the profiler names it: ``file(line): name``, ``<built-in ...>`` or
# ``nn.Module: name``.
_PYTHON_NAME = re.compile(r"^(.+\(\d+\): |<built-in |nn\.Module: )")


def _is_python(event: Any) -> bool:
    """Whether a profiler event is a Python function's (torch before 2.13 has no flag for it)."""
    flag = getattr(event, "is_python_function", None)
    return flag if flag is not None else _PYTHON_NAME.match(event.name) is not None


def _part(event: Any) -> str:
    """Which part of the step an event is: a Python function by its file, an op by its name."""
    name = event.name
    if _is_python(event):
        path = name.split("(")[0]
        parts = path.removeprefix(_PACKAGE).removeprefix("bucketwise/").split("/")
        if path.startswith(_PACKAGE) or (len(parts) > 1 and parts[0] in _OWN):
            return "the benchmark's step" if parts[0] == "benchmarks" else "bucketwise"
        if "torchinductor" in path:  # Inductor's generated output code
            return INDUCTOR
        return next((part for prefix, part in _PYTHON_PARTS if path.startswith(prefix)), "other Python")
    if "wait_tensor" in name or name.startswith("c10d::wait"):
        return "collective waits"
    if name.startswith(_COLLECTIVE_OPS):
        return "collectives"
    if name.startswith("cuda"):
        return "CUDA runtime calls"
    return next((part for prefix, part in _OP_PARTS if name.startswith(prefix)), "ops and kernels")


OTHER_PYTHON = "other Python threads"


def median_parts(runs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per thread and part, the median over ``runs`` of :func:`thread_parts` (0 where one lacks it)."""
    keys = {(t, part) for run in runs for t, parts in run.items() for part in parts}
    out: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for t, part in sorted(keys):
        out[t][part] = statistics.median(run.get(t, {}).get(part, 0.0) for run in runs)
    return dict(out)


def thread_parts(step: Any) -> dict[str, dict[str, float]]:
    """Per thread, per part of the step (:func:`_part`): own microseconds per step of the
    profiler's events (ops and Python functions) less their children's, over ``STEPS`` steps. A
    Python function open for most of the profile (a background thread waiting) is left out."""
    sync()
    with profile(activities=_activities(), with_stack=True) as prof:
        for _ in range(STEPS):
            step()
        sync()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    if not events:
        return {}
    first = min(e.time_range.start for e in events)
    last = max(e.time_range.end for e in events)
    events = [e for e in events if e.time_range.elapsed_us() < 0.9 * (last - first)]
    # The main thread: the one whose Python functions the profiler names (with ops of its own).
    python = collections.Counter(e.thread for e in events if _is_python(e))
    with_ops = {e.thread for e in events if not _is_python(e)}
    main = max((t for t in python if t in with_ops), key=python.__getitem__, default=None)
    out: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    by_thread: dict[int, list[Any]] = collections.defaultdict(list)
    for e in events:
        by_thread[e.thread].append(e)
    for tid, evs in by_thread.items():
        python_only = all(_is_python(e) for e in evs)
        label = "main" if tid == main else OTHER_PYTHON if python_only else f"thread {tid}"
        evs.sort(key=lambda e: (e.time_range.start, -e.time_range.end))
        stack: list[list[Any]] = []  # [event, own time so far]
        for e in evs + [None]:
            # A child lies wholly inside its parent (the Python tracer's and the ops' clocks may
            # overlap by a little: such an event is no one's child).
            while stack and (e is None or e.time_range.end > stack[-1][0].time_range.end):
                done, own = stack.pop()
                out[label][_part(done)] += own / STEPS
            if e is None:
                break
            if stack:
                stack[-1][1] -= e.time_range.elapsed_us()
            stack.append([e, e.time_range.elapsed_us()])
    return {label: dict(parts) for label, parts in out.items()}


def _threads_table(rows: list[dict[str, Any]]) -> list[str]:
    """Own CPU milliseconds per step of every thread and part, one column per config."""
    keys = sorted({(t, part) for r in rows for t, parts in r["threads"].items() for part in parts})
    lines = [
        "### Every thread's own time per step (ms, under the profiler)",
        "",
        "| thread | part | " + " | ".join(f"`{r['config']}`" for r in rows) + " |",
        "| --- | --- |" + " ---: |" * len(rows),
    ]
    for t, part in keys:
        cells = [r["threads"].get(t, {}).get(part, 0.0) / 1e3 for r in rows]
        lines.append(f"| {t} | {part} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    totals = [sum(v for parts in r["threads"].values() for v in parts.values()) / 1e3 for r in rows]
    lines.append("| all | | " + " | ".join(f"{c:.3f}" for c in totals) + " |")
    return lines + [""]


def _diff_table(title: str, base: dict[str, dict[str, float]], other: dict[str, dict[str, float]]) -> list[str]:
    keys = set(base) | set(other)
    zero = {"calls": 0.0, "self_us": 0.0}
    rows = sorted(keys, key=lambda k: -abs(other.get(k, zero)["self_us"] - base.get(k, zero)["self_us"]))[:TOP]
    lines = [
        f"### {title}",
        "",
        "| name | calls | floor calls | self us | floor self us |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for k in rows:
        a, b = base.get(k, zero), other.get(k, zero)
        lines.append(f"| `{k[:110]}` | {b['calls']:.1f} | {a['calls']:.1f} | {b['self_us']:.0f} | {a['self_us']:.0f} |")
    return lines + [""]


def _summary(r: dict[str, Any]) -> str:
    gpu = (
        f"GPU {r['gpu_ms']:.2f} ms (idle {r['gpu_idle_ms']:.2f}), {r['kernels']:.0f} kernels, "
        if r["gpu_ms"] is not None
        else ""
    )
    return (
        f"`{r['config']}`: step {r['step_ms_median']:.2f} ms, issue {r['issue_ms_median']:.2f} ms, "
        f"CPU time {r['process_cpu_ms_median']:.2f} ms, {gpu}buckets {r['buckets']}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama", choices=MODELS)
    for flag in SIZE_FLAGS:
        p.add_argument("--" + flag.replace("_", "-"), type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch's CPU threads (torch.set_num_threads)")
    p.add_argument("--configs", default="local,bw-auto")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per config per round")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    names = args.configs.split(",")
    sizes = {f: getattr(args, f) for f in SIZE_FLAGS if getattr(args, f) is not None}
    spec = make_spec(args.model, sizes)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    with one_rank(p, [parse_config(n)[0] for n in names], port=29541, needs_gpu=False) as device:
        torch.set_float32_matmul_precision("high")
        entries = {}
        for name in names:
            config, cap = parse_config(name)
            entries[name] = build(config, spec, device, "inductor", warmup=3, bucket_cap_mb=cap)
            print(f"built {name}: first step {entries[name]['first_step_s']:.1f} s", flush=True)
        at_rest = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        for name in names:  # the first profile may compile again (compiled autograd sees the profiler)
            thread_parts(entries[name]["step"])
        parts: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                timed_block(entries[name], args.steps, at_rest - entries[name]["rest_bytes"])
                parts[name].append(thread_parts(entries[name]["step"]))
            print(f"round {r + 1}: " + ", ".join(f"{n} {entries[n]['step_ms'][-1]:.2f}" for n in names), flush=True)
        rows = []
        for name in names:
            e = entries[name]
            kernel_profile(e, STEPS)
            row = {
                "config": name,
                "issue_ms": e["issue_ms"],
                "step_ms": e["step_ms"],
                "issue_ms_median": statistics.median(e["issue_ms"]),
                "process_cpu_ms": e["process_cpu_ms"],
                "process_cpu_ms_median": statistics.median(e["process_cpu_ms"]),
                "cpu_ms": e["cpu_ms"],
                "cpu_ms_median": statistics.median(e["cpu_ms"]),
                "step_ms_median": statistics.median(e["step_ms"]),
                "kernels": e["kernels"],
                "gpu_ms": e["gpu_ms"],
                "gpu_idle_ms": e["gpu_idle_ms"],
                "idle_before_ms": e["idle_before_ms"],
                "buckets": len(e["report"].graphs[0].buckets)
                if e["report"] is not None and e["report"].graphs
                else None,
                "syncs": syncs_per_step(e["step"]),
                "ops": host_ops(e["step"]),
                "python": python_functions(e["step"]),
                "threads": median_parts(parts[name]),
            }
            rows.append(row)
            print(f"{_summary(row)}, syncs {len(row['syncs'])}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    meta = {
        **run_meta(),
        "model": spec.describe(),
        "configs": names,
        "rounds": args.rounds,
        "steps": args.steps,
        "device": str(device),
        "threads": torch.get_num_threads(),
    }
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# host time per step: {args.model} {sizes}", ""]
    lines += [f"- {_summary(r)}, syncs {r['syncs'][:2]}" for r in rows]
    lines.append("")
    lines += _threads_table(rows)
    for r in rows[1:]:
        lines += _diff_table(f"`{r['config']}` against `{rows[0]['config']}`: CPU ops", rows[0]["ops"], r["ops"])
        lines += _diff_table(f"`{r['config']}` against `{rows[0]['config']}`: Python", rows[0]["python"], r["python"])
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines), flush=True)
    return 0
