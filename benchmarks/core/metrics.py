"""Measurements: step timing, the allreduce bandwidth probe, cross-rank reduction, and the
communication/compute overlap read from a ``torch.profiler`` chrome trace.

The trace analysis is the package's (``bucketwise.stats.trace_analysis``, which
``bucketwise.profile`` and ``bucketwise launch --profile-steps`` use too); the harness places
each kernel in the CPU-side ``record_function`` range (``bench_step``/``bench_backward``) that
launched it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from bucketwise.stats import trace_analysis
from bucketwise.stats.trace_analysis import (  # noqa: F401 - the harness's names for them
    intersection_length,
    is_nccl,
    kernels,
    launch_times,
    launched_at,
    length,
    load_trace,
    merge,
    ranges,
)

STEP_RANGE = "bench_step"
BACKWARD_RANGE = "bench_backward"


# -- timing -------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# A step's CPU time is the process's (NOTE [a step's CPU time]): the backward's host work runs on
# autograd's thread. Older results have the calling thread's only (``cpu_ms`` without
# ``process_cpu_ms``); the tables mark them.


def process_cpu_s() -> float:
    """CPU seconds this process has used, every thread (NOTE [a step's CPU time])."""
    return time.process_time()


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """What :func:`time_steps` measured: per-step milliseconds, the host time of issuing each
    step, the wall-clock mean, and what each ``step()`` returned (the loss tensors, unread)."""

    per_step_ms: list[float]
    cpu_issue_ms: list[float]
    cpu_time_ms: list[float]
    """The process's CPU time per step, every thread (NOTE [a step's CPU time])."""
    mean_ms: float
    outputs: list[Any]


def time_first_step(step: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Seconds of one step (includes compiling), synchronised on both ends, and its output."""
    sync(device)
    t0 = time.perf_counter()
    out = step()
    sync(device)
    return time.perf_counter() - t0, out


def time_steps(step: Callable[[], Any], n: int, device: torch.device) -> StepTimes:
    """Per-step milliseconds of ``n`` consecutive steps, and the wall-clock mean.

    On CUDA, events recorded between steps (no synchronisation inside the loop, so the CPU can
    run ahead as in training); one ``torch.cuda.synchronize()`` before the events are read.
    ``cpu_issue_ms``: ``perf_counter`` around each ``step()`` call, no sync: the host time spent
    issuing the step (on CUDA, close to the step time when the CPU is the bottleneck or the step
    synchronises; on CPU the step time itself); ``cpu_time_ms``: the process's CPU time over the
    same call (NOTE [a step's CPU time]).
    """
    sync(device)
    cuda = device.type == "cuda"
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)] if cuda else []
    issue, cpu, outputs = [], [], []
    t0 = time.perf_counter()
    if cuda:
        events[0].record()
    for i in range(n):
        t, c = time.perf_counter(), process_cpu_s()
        outputs.append(step())
        issue.append((time.perf_counter() - t) * 1e3)
        cpu.append((process_cpu_s() - c) * 1e3)
        if cuda:
            events[i + 1].record()
    sync(device)
    per_step = [events[i].elapsed_time(events[i + 1]) for i in range(n)] if cuda else list(issue)
    mean_ms = (time.perf_counter() - t0) * 1e3 / n
    return StepTimes(per_step_ms=per_step, cpu_issue_ms=issue, cpu_time_ms=cpu, mean_ms=mean_ms, outputs=outputs)


def read_scalars(tensors: Sequence[torch.Tensor]) -> list[float]:
    """Python floats of 0-d tensors, read with one device-to-host copy (one sync)."""
    if not tensors:
        return []
    return torch.stack([t.detach().float().reshape(()) for t in tensors]).tolist()


def summarize(per_step_ms: Sequence[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(per_step_ms), "min_ms": min(per_step_ms), "max_ms": max(per_step_ms)}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear interpolation between order statistics (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread(per_step_ms: Sequence[float]) -> dict[str, float]:
    """p10/p50/p90 and the (population) standard deviation of per-step times, in ms."""
    return {**{f"p{q}_ms": percentile(per_step_ms, q) for q in (10, 50, 90)}, "std_ms": statistics.pstdev(per_step_ms)}


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` on every rank (a collective: all ranks must call it)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# -- allreduce bandwidth probe ------------------------------------------------------------


def allreduce_probe(numel: int, device: torch.device, iters: int) -> dict[str, Any]:
    """Time ``dist.all_reduce`` of a flat fp32 buffer of ``numel`` elements (the gradient bytes):
    the communication floor of one step. Slowest rank per iteration, median over iterations."""
    buf = torch.rand(numel, dtype=torch.float32, device=device)  # not constant data (METHOD.md)
    for _ in range(2):
        dist.all_reduce(buf)
    times = []
    for _ in range(iters):
        sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    del buf
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    ms = statistics.median(slowest.tolist())
    world = dist.get_world_size()
    nbytes = numel * 4
    busbw = 2 * (world - 1) / world * nbytes / (ms / 1e3) / 1e9 if world > 1 else None
    return {
        "bytes": nbytes,
        "iters": iters,
        "median_ms": ms,
        "min_ms": min(slowest.tolist()),
        "algbw_gbps": nbytes / (ms / 1e3) / 1e9,
        "busbw_gbps": busbw,
    }


def gpu_idle(kernels: Sequence[tuple[float, float, str]], *, top: int = 8) -> dict[str, Any]:
    """Where the GPU waits between kernels: ``kernels`` as (start, end, name), microseconds, from
    one run of steps. Returns the time from the first kernel's start to the last one's end
    (``span_us``), the time some kernel runs (``busy_us``), the rest (``idle_us``), and the
    ``top`` kernels that most idle time comes before (``before``: name -> microseconds), each gap
    charged to the kernel that ends it: what the GPU waited to be given."""
    spans = sorted(kernels)
    if not spans:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "before": {}}
    before: dict[str, float] = {}
    reach = spans[0][0]
    for start, end, name in spans:
        if start > reach:
            before[name] = before.get(name, 0.0) + start - reach
        reach = max(reach, end)
    busy = length(merge((start, end) for start, end, _ in spans))
    span = reach - spans[0][0]
    ranked = sorted(before.items(), key=lambda kv: -kv[1])[:top]
    return {"span_us": span, "busy_us": busy, "idle_us": span - busy, "before": dict(ranked)}


# -- chrome trace -------------------------------------------------------------------------


def _span(k: dict[str, Any]) -> tuple[float, float]:
    return float(k["ts"]), float(k["ts"]) + float(k["dur"])


def overlap_from_events(events: Sequence[dict[str, Any]], steps: int) -> dict[str, Any]:
    """NCCL kernel time, the part of it that overlapped non-NCCL kernels, and the exposed part
    per step, over all kernels of a trace of ``steps`` training steps (times in ms)."""
    nccl, compute = [], []
    for k in kernels(events):
        (nccl if is_nccl(k.get("name", "")) else compute).append(_span(k))
    nccl_m, compute_m = merge(nccl), merge(compute)
    total = length(nccl_m) / 1e3
    overlapped = intersection_length(nccl_m, compute_m) / 1e3
    return {
        "profiled_steps": steps,
        "nccl_kernels": len(nccl),
        "compute_kernels": len(compute),
        "nccl_ms": total,
        "overlapped_ms": overlapped,
        "compute_ms": length(compute_m) / 1e3,
        "nccl_ms_per_step": total / steps,
        "overlapped_ms_per_step": overlapped / steps,
        "exposed_ms_per_step": (total - overlapped) / steps,
    }


def backward_timeline(events: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The kernels launched inside the last ``bench_backward`` range (all kernels where none is
    found), as the timeline plot draws them."""
    ks = kernels(events)
    window = "backward of the last profiled step"
    found = ranges(events, BACKWARD_RANGE)
    launch = launch_times(events)
    picked = []
    if found and launch:
        lo, hi = found[-1]
        picked = [k for k in ks if lo <= launched_at(k, launch) <= hi]
    if picked:
        # And those whose launch the trace lacks (a category kineto did not record), run among them.
        start = min(float(k["ts"]) for k in picked)
        end = max(float(k["ts"]) + float(k["dur"]) for k in picked)
        picked += [k for k in ks if math.isnan(launched_at(k, launch)) and start <= float(k["ts"]) <= end]
    else:
        picked, window = ks, "all profiled kernels (backward range not found in the trace)"
    if not picked:
        return {"window": "no kernels in the trace", "compute": [], "nccl": []}
    compute = [_span(k) for k in picked if not is_nccl(k["name"])]
    comm = [(*_span(k), k["name"][:80]) for k in picked if is_nccl(k["name"])]
    return {"window": window, "kernels": len(picked), **trace_analysis.timeline(compute, comm)}


def profile_trace(step: Callable[[], Any], n: int, device: torch.device, trace_path: str) -> list[dict[str, Any]]:
    """Run ``n`` steps under ``torch.profiler`` (CPU + CUDA activities), export the chrome trace
    to ``trace_path`` and return its events."""
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        sync(device)
    prof.export_chrome_trace(trace_path)
    return load_trace(trace_path)


def host_profile(step: Callable[[], Any], n: int, device: torch.device, path: str, *, enabled: bool) -> None:
    """Run ``n`` steps, under ``cProfile`` when ``enabled`` (every rank must step: the steps hold
    collectives), and write the functions with the most host time, own and cumulative, to
    ``path``: where a host-bound step's CPU time goes."""
    import cProfile
    import io
    import pstats

    sync(device)
    prof = cProfile.Profile() if enabled else None
    if prof is not None:
        prof.enable()
    for _ in range(n):
        step()
    if prof is None:
        sync(device)
        return
    prof.disable()
    sync(device)
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    buf.write(f"# cProfile of {n} training step(s), host time only (no sync inside)\n")
    for order in ("tottime", "cumulative"):
        stats.sort_stats(order).print_stats(40)
    with open(path, "w") as f:
        f.write(buf.getvalue())


def param_spread(params: Iterable[torch.Tensor]) -> float:
    """Largest difference between this rank's parameters and rank 0's: 0.0 when data
    parallelism kept every replica equal (a collective: every rank calls it)."""
    with torch.no_grad():
        flat = torch.cat([p.detach().float().reshape(-1) for p in params])
        ref = flat.clone()
        dist.broadcast(ref, 0)
        spread = (flat - ref).abs().max()
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return spread.item()
