"""Inductor's raise pass before bucketwise's late-waits pass, or the late-waits pass alone
(NOTE [late waits] in ``_compat/collectives.py``): cold first step, step time and peak memory.

    python3 -m bucketwise.benchmarks.probes.comm_passes cold llama 32 sink 0
    python3 -m bucketwise.benchmarks.probes.comm_passes steady llama 16

``cold MODEL LAYERS {raise,sink} SHARE``: a new process over an empty compile cache (or
``BUCKETWISE_PROBE_CACHE``'s; with ``BUCKETWISE_COMPILE_ARTIFACTS`` a second step saves them), ``fused``,
``share_blocks=SHARE``; prints ``COLD`` and the report's compile-time breakdown. ``steady MODEL
LAYERS``: both pass lists built in one process, 6 rounds of 10 steps, the order alternating;
prints ``STEADY`` (per round: CUDA-event ms per step, host ms to issue one, peak MiB above the
two models at rest) and ``MEDIANS``. One rank (NCCL, world size 1), started without torchrun.
Result: ``results/2026-11-26_1xH100_comm-pass-cold-start``.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

PASSES = ("raise", "sink")


def _options(passes: str) -> dict[str, Any]:
    from bucketwise._compat.collectives import SinkWaitsPass
    from bucketwise.distributed.fused.cache_keys import comm_pass_key

    raise_pass = ["reorder_communication_preserving_peak_memory"] if passes == "raise" else []
    return {"reorder_for_compute_comm_overlap_passes": [*raise_pass, SinkWaitsPass(comm_pass_key())]}


def _build(model: str, layers: int, passes: str, share: bool) -> tuple[Any, Callable[[], Any]]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bucketwise
    from bucketwise.benchmarks.core.configs import Prepared
    from bucketwise.benchmarks.core.models import make_spec
    from bucketwise.benchmarks.core.step import LR, make_step

    device = torch.device("cuda", 0)
    spec = make_spec(model, {"layers": layers})
    torch.manual_seed(0)
    module = spec.build().to(device)
    compiled = bucketwise.compile(
        DDP(module, device_ids=[0]), strategy="fused", share_blocks=share, options=_options(passes)
    )
    opt = torch.optim.AdamW(module.parameters(), lr=LR, fused=True)
    prepared = Prepared(module=compiled, step_context=contextlib.nullcontext, report=bucketwise.report(compiled))
    step = make_step(prepared, spec, opt, spec.make_batch(1, device), device, mark_cudagraph_step=False, annotate=False)
    return prepared, step


def cold(model: str, layers: int, passes: str, share: bool) -> dict[str, Any]:
    import torch

    prepared, step = _build(model, layers, passes, share)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    times = prepared.report.totals.get("compile_times")
    if os.environ.get("BUCKETWISE_COMPILE_ARTIFACTS"):
        step()  # the artifacts are saved at the second call (NOTE [compile artifacts])
    return {
        "model": model,
        "layers": layers,
        "passes": passes,
        "share": share,
        "first_s": round(time.perf_counter() - t0, 2),
        "compile": {k: times[k] for k in ("dynamo_s", "aot_autograd_s", "backend_s", "total_s")},
        "shared_blocks": [g.get("shared_blocks") for g in prepared.report.to_dict()["graphs"]],
        "artifacts": [n for n in prepared.report.to_dict()["notes"] if n.startswith("compile artifacts")],
        "caches": {k: times[k] for k in ("fx_graph_cache", "aot_autograd_cache")},
    }


def steady(model: str, layers: int, rounds: int = 6, steps: int = 10) -> dict[str, Any]:
    import torch

    entries = {}
    for passes in PASSES:
        _, step = _build(model, layers, passes, False)
        for _ in range(4):
            step()
        entries[passes] = step
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    res: dict[str, dict[str, list[float]]] = {p: {"step_ms": [], "issue_ms": [], "peak_mib": []} for p in PASSES}
    for r in range(rounds):
        for passes in PASSES if r % 2 == 0 else PASSES[::-1]:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            for _ in range(steps):
                entries[passes]()
            end.record()
            issue = (time.perf_counter() - t0) * 1000 / steps
            torch.cuda.synchronize()
            res[passes]["step_ms"].append(round(start.elapsed_time(end) / steps, 3))
            res[passes]["issue_ms"].append(round(issue, 3))
            res[passes]["peak_mib"].append(round((torch.cuda.max_memory_allocated() - base) / 2**20, 1))
    return res


def main(argv: list[str]) -> int:
    # A cache of the caller's (a warm restart, or a fresh one with BUCKETWISE_COMPILE_ARTIFACTS),
    # else a new empty one.
    cache = os.environ.get("BUCKETWISE_PROBE_CACHE") or tempfile.mkdtemp()
    os.environ.update(
        TORCHINDUCTOR_CACHE_DIR=cache,
        TRITON_CACHE_DIR=os.path.join(cache, "triton"),
        BUCKETWISE_PROGRESS="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(29700 + os.getpid() % 200),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    try:
        if argv[0] == "cold":
            print("COLD", json.dumps(cold(argv[1], int(argv[2]), argv[3], argv[4] == "1")), flush=True)
        else:
            res = steady(argv[1], int(argv[2]))
            print("STEADY", argv[1], argv[2], json.dumps(res), flush=True)
            print("MEDIANS", {p: {k: statistics.median(v) for k, v in d.items()} for p, d in res.items()}, flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
