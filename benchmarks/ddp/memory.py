"""What a compiled model holds on the GPU: at rest between steps, at its peak, and after it is dropped.

    python -m bucketwise.benchmarks memory --model mlp --layers 8 --d-model 3072 \
        --configs local,bw-fused,local-ro,bw-fused-cg --rounds 2 --out DIR

Each config runs in a process of its own (one rank, NCCL world size 1 on CUDA, gloo on CPU):
the model is built, wrapped (``bench_configs``), trained ``--steps`` steps with fused AdamW and
``zero_grad(set_to_none=True)``, then the model, its optimizer and the compiled object are
dropped. Memory allocated above what the process held before the model was built, in MiB:

- ``rest``: after the last step (parameters, optimizer state, whatever the compile keeps);
  ``rest_reserved``: the allocator's reserved memory then (CUDA-graph pools included);
- ``peak``: ``torch.cuda.max_memory_allocated`` over the whole run (first step included),
  ``peak_reserved``: ``torch.cuda.max_memory_reserved`` likewise (above the reserved memory at
  the start), and ``steady_peak``: allocated, over the steps after the first two;
- ``after_gc``: after the drop and one ``gc.collect()``; ``after_reset``: after
  ``torch.compiler.reset()`` and ``gc.collect()`` too. Both include cuBLAS's per-stream
  workspaces, which torch keeps for the process from a stream's first matmul on (32 MiB on an
  H100), after plain ``torch.compile`` too: compare a config with ``local``.

``--rounds`` repeats every config in new processes, interleaved (A B C, then A B C again).
``--bucket-cap-mb`` sets DDP's ``bucket_cap_mb`` (so ``fused`` takes DDP's bucket sizes instead of
its own, NOTE [fused bucket sizes]), to see what the buckets' sizes do to memory; each process
reports the cap its DDP module holds (``ddp_bucket_cap_mb``, ``None`` without DDP).
Writes ``results.json`` (every process's figures) and ``results.md`` (the median per config).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
from typing import Any

import torch

from bucketwise.benchmarks.core import procs
from bucketwise.benchmarks.core.configs import recipe_for
from bucketwise.benchmarks.core.meta import run_meta
from bucketwise.benchmarks.core.models import MODELS, SIZE_FLAGS, make_spec
from bucketwise.benchmarks.core.step import training_step

MIB = 2**20
FIGURES = ("rest", "rest_reserved", "peak", "peak_reserved", "steady_peak", "after_gc", "after_reset")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp", choices=MODELS)
    for flag in SIZE_FLAGS:
        p.add_argument("--" + flag.replace("_", "-"), type=int, default=None)
    p.add_argument("--configs", default="local,bw-fused,local-ro,bw-fused-cg")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--backend", default="inductor")
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="DDP's bucket_cap_mb (default: DDP's own); any value given, 25 too, "
        "makes fused keep DDP's buckets instead of sizing its own",
    )
    p.add_argument("--one", help=argparse.SUPPRESS)  # run one config in this process, print JSON
    p.add_argument("--out")
    ns = p.parse_args(argv)
    ns.configs = ns.configs.split(",")
    for config in ns.configs:
        recipe_for(config)
    if ns.one is None and ns.out is None:
        p.error("--out is required")
    if ns.bucket_cap_mb is not None and not ns.bucket_cap_mb > 0:
        p.error(f"--bucket-cap-mb must be positive, got {ns.bucket_cap_mb}")
    if ns.steps < 3:
        p.error(f"--steps must be >= 3 (the steady peak is over the steps after the first two), got {ns.steps}")
    return ns


def _allocated(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def measure(
    config: str, spec: Any, device: torch.device, backend: str, steps: int, bucket_cap_mb: float | None = None
) -> dict[str, float]:
    """One config in this process (NOTE on each figure in the module docstring)."""
    cuda = device.type == "cuda"
    gc.collect()
    start = _allocated(device)
    start_reserved = torch.cuda.memory_reserved() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model, prepared, opt, step = training_step(recipe_for(config), spec, device, backend, bucket_cap_mb=bucket_cap_mb)
    # The cap the DDP module holds (None without DDP): what the run asked for reached it.
    cap = getattr(prepared.module, "bucket_bytes_cap", None)
    out: dict[str, float] = {}
    for i in range(steps):
        if i == 2 and cuda:
            torch.cuda.synchronize()
            out["peak"] = torch.cuda.max_memory_allocated() - start
            out["peak_reserved"] = torch.cuda.max_memory_reserved() - start_reserved
            torch.cuda.reset_peak_memory_stats()
        step()
    rest = _allocated(device) - start
    out["steady_peak"] = (torch.cuda.max_memory_allocated() - start) if cuda else 0
    out["peak"] = max(out.get("peak", 0), out["steady_peak"])
    reserved_peak = (torch.cuda.max_memory_reserved() - start_reserved) if cuda else 0
    out["peak_reserved"] = max(out.get("peak_reserved", 0), reserved_peak)
    out["rest"] = rest
    out["rest_reserved"] = (torch.cuda.memory_reserved() - start_reserved) if cuda else 0
    del model, prepared, opt, step
    gc.collect()
    out["after_gc"] = _allocated(device) - start
    torch.compiler.reset()
    gc.collect()
    out["after_reset"] = _allocated(device) - start
    return {**{k: v / MIB for k, v in out.items()}, "ddp_bucket_cap_mb": cap / MIB if cap is not None else None}


def _one(ns: argparse.Namespace) -> None:
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:  # a file store: processes run at once share no port
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"file://{tmp}/store",
            rank=0,
            world_size=1,
            device_id=device if cuda else None,
        )
        spec = make_spec(ns.model, {f: getattr(ns, f) for f in SIZE_FLAGS})
        figures = measure(ns.one, spec, device, ns.backend, ns.steps, ns.bucket_cap_mb)
        print("MEMORY_BENCH " + json.dumps(figures), flush=True)
        dist.destroy_process_group()


def _child(ns: argparse.Namespace, config: str, argv: list[str]) -> dict[str, float]:
    done = procs.run(
        [procs.Proc(procs.python("-m", "bucketwise.benchmarks", "memory", *argv, "--one", config))],
        capture=procs.Capture.ALL,
    )
    for line in done.stdout.splitlines():
        if line.startswith("MEMORY_BENCH "):
            return json.loads(line.removeprefix("MEMORY_BENCH "))
    raise RuntimeError(f"memory: {config} failed (exit {done.code}):\n{done.stderr[-3000:]}")


def markdown(meta: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    configs = list(dict.fromkeys(r["config"] for r in runs))
    lines = [
        f"# Memory at rest, at the peak and after the drop: {meta['model']['model']}",
        "",
        f"{meta['gpu']}, torch {meta['torch']}, {meta['date']}; MiB allocated above the process's start, "
        f"median of {meta['rounds']} process(es) per config; `{meta['command']}`",
        "",
        "| config | at rest | reserved at rest | peak | peak reserved | steady-step peak | after `gc.collect()` "
        "| after `torch.compiler.reset()` too |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for config in configs:
        mine = [r for r in runs if r["config"] == config]
        cells = [f"{statistics.median(r[f] for r in mine):,.1f}" if f in mine[0] else "-" for f in FIGURES]
        lines.append(f"| `{config}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = _parse(argv)
    if ns.one is not None:
        _one(ns)
        return 0
    child_argv = [a for a in argv]
    runs = []
    for round_no in range(ns.rounds):
        for config in ns.configs:
            figures = _child(ns, config, child_argv)
            runs.append({"config": config, "round": round_no, **figures})
            print(config, json.dumps({k: v if v is None else round(v, 1) for k, v in figures.items()}), flush=True)
    spec = make_spec(ns.model, {f: getattr(ns, f) for f in SIZE_FLAGS})
    meta = run_meta(argv=["python", "-m", "bucketwise.benchmarks.ddp.memory", *argv])
    meta.update(model=spec.describe(), rounds=ns.rounds, steps=ns.steps, bucket_cap_mb=ns.bucket_cap_mb)
    os.makedirs(ns.out, exist_ok=True)
    with open(os.path.join(ns.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "runs": runs}, f, indent=1)
    with open(os.path.join(ns.out, "results.md"), "w") as f:
        f.write(markdown(meta, runs))
    print(markdown(meta, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
