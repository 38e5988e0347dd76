"""Where in the first steps a config's memory peaks, and what its pools hold at rest: allocated
and reserved per phase of every step, then the allocator's segments by pool (one rank, one GPU).

    python -m bucketwise.benchmarks probe memory_phases --model llama --layers 8 --batch 4 \
        --configs local-ro,bw-fused-cg [--steps 4] [--out DIR]

Each config runs in a process of its own, as ``memory`` runs it (the model built, wrapped, fused
AdamW, ``zero_grad(set_to_none=True)``), the step cut at its phases (``core.step.PHASES``): for
each phase of each step, the highest allocated and reserved MiB during it and what is left at its
end, above the process's start. Under CUDA graphs the allocator sees the warm-up and recording
steps only (a replay allocates nothing), so the peak of ``memory`` is one of these rows. After
the last step, ``torch.cuda.memory_snapshot()`` by pool (the default pool, and each private pool:
CUDA graphs' and their warm-ups'): segments, reserved, allocated, and the largest blocks still
allocated. ``--out`` writes ``results.json``: the run's meta and every config's rows.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys
from typing import Any

import torch

from bucketwise.benchmarks.core import procs
from bucketwise.benchmarks.core.configs import recipe_for
from bucketwise.benchmarks.core.meta import run_meta
from bucketwise.benchmarks.core.models import MODELS, SIZE_FLAGS, make_spec
from bucketwise.benchmarks.core.step import PHASES, make_step, training_step
from bucketwise.benchmarks.probes._one_rank import check, one_rank

MIB = 2**20
LARGEST = 12
"""Blocks still allocated listed per pool, largest first."""


def pools() -> dict[str, dict[str, Any]]:
    """The allocator's segments by pool: count, reserved and allocated MiB, the largest live blocks."""
    out: dict[str, dict[str, Any]] = collections.defaultdict(
        lambda: {"segments": 0, "reserved": 0.0, "allocated": 0.0, "blocks": []}
    )
    for seg in torch.cuda.memory_snapshot():
        pool = tuple(seg.get("segment_pool_id", (0, 0)))
        row = out["default" if pool == (0, 0) else f"private {pool[0]},{pool[1]}"]
        row["segments"] += 1
        row["reserved"] += seg["total_size"] / MIB
        row["allocated"] += seg["allocated_size"] / MIB
        row["blocks"] += [b["size"] / MIB for b in seg["blocks"] if b["state"] == "active_allocated"]
    for row in out.values():
        row["blocks"] = [round(b, 1) for b in sorted(row["blocks"], reverse=True)[:LARGEST]]
    return dict(out)


def phases(config: str, spec: Any, device: torch.device, steps: int) -> dict[str, Any]:
    """One config's rows (one per phase of every step) and its pools after the last step."""
    gc.collect()
    torch.cuda.synchronize()
    start, start_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    recipe = recipe_for(config)
    _, prepared, opt, _ = training_step(recipe, spec, device, "inductor")
    rows: list[dict[str, Any]] = []

    def ended(phase: str) -> None:
        torch.cuda.synchronize()
        rows.append(
            {
                "step": len(rows) // len(PHASES),
                "phase": phase,
                "peak": (torch.cuda.max_memory_allocated() - start) / MIB,
                "end": (torch.cuda.memory_allocated() - start) / MIB,
                "peak_reserved": (torch.cuda.max_memory_reserved() - start_reserved) / MIB,
                "end_reserved": (torch.cuda.memory_reserved() - start_reserved) / MIB,
            }
        )
        torch.cuda.reset_peak_memory_stats()

    batch = spec.make_batch(1, device)
    mark = recipe.mode == "reduce-overhead"
    step = make_step(prepared, spec, opt, batch, device, mark_cudagraph_step=mark, annotate=False, on_phase=ended)
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        step()
    return {"config": config, "rows": rows, "pools": pools()}


def _one(p: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    with one_rank(p, [ns.one], port=29612) as device:
        spec = make_spec(ns.model, {f: getattr(ns, f) for f in SIZE_FLAGS})
        print("MEMORY_PHASES " + json.dumps(phases(ns.one, spec, device, ns.steps)), flush=True)


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['config']}: MiB above the start, per phase (peak during it / at its end)",
        f"{'step':>4} {'phase':<10} {'peak':>9} {'end':>9} {'peak res':>9} {'end res':>9}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['step']:>4} {r['phase']:<10} {r['peak']:>9.1f} {r['end']:>9.1f} "
            f"{r['peak_reserved']:>9.1f} {r['end_reserved']:>9.1f}"
        )
    for name, pool in result["pools"].items():
        lines.append(
            f"  pool {name}: {pool['segments']} segments, {pool['reserved']:.1f} reserved, "
            f"{pool['allocated']:.1f} allocated; largest live blocks {pool['blocks']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama", choices=sorted(MODELS))
    for flag in SIZE_FLAGS:
        p.add_argument("--" + flag.replace("_", "-"), type=int, default=None)
    p.add_argument("--configs", default="local-ro,bw-fused-cg")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", help="a folder to write results.json to: the run's meta and every config's rows")
    p.add_argument("--one", help=argparse.SUPPRESS)  # run one config in this process, print JSON
    ns = p.parse_args(argv)
    configs = ns.configs.split(",")
    if ns.one is not None:
        _one(p, ns)
        return 0
    check(p, configs)
    results = []
    for config in configs:
        done = procs.run(
            [procs.Proc(procs.python("-m", "bucketwise.benchmarks", "probe", "memory_phases", *argv, "--one", config))],
            capture=procs.Capture.ALL,
        )
        line = next((x for x in done.stdout.splitlines() if x.startswith("MEMORY_PHASES ")), None)
        if line is None:
            print(f"memory_phases: {config} failed (exit {done.code}):\n{done.stderr[-3000:]}", file=sys.stderr)
            return 1
        results.append(json.loads(line.removeprefix("MEMORY_PHASES ")))
        print(table(results[-1]), flush=True)
    if ns.out:
        os.makedirs(ns.out, exist_ok=True)
        spec = make_spec(ns.model, {f: getattr(ns, f) for f in SIZE_FLAGS})
        meta = {**run_meta(), "model": spec.describe(), "steps": ns.steps}
        with open(os.path.join(ns.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "configs": results}, f, indent=1)
    return 0
