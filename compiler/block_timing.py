"""A shared block's call, timed once at compile time: the host's time to issue it, the GPU's to run it.

NOTE [sharing measured at compile time]: a shared block (NOTE [one compile per block]) costs the
host more per call than the same block inside the whole graph (its own launches, allocations and
checks: 1.12x the whole graph's host time per step at 32 layers of an HF Llama, batch 4, on one
H200, results/2026-11-29_1xH200_tax-llama16-32-b4-process-cpu-shared-blocks), and nothing on the
GPU. Where the host issues a block faster than the GPU runs it, that cost hides behind the GPU and
the step keeps its time (batch 12: 0.97x the whole graph's step,
results/2026-11-29_1xH200_tax-llama16-32-b12-shared-blocks); where it does not, the step pays it
(batch 4: 1.16x at 32 layers). Which of the two holds is a fact of the compiled block on this
host and this GPU, so ``share_blocks="auto"`` without CUDA graphs measures it when the block has
compiled, before the graph around it is: the block's forward and backward on tensors of the
shapes it was compiled for, ``CALLS`` times after ``WARMUP`` calls, queued behind a kernel that
holds the stream (``hold_stream``) so the host issues without waiting on the GPU and the GPU then
runs the calls back to back. The host's time per call is the fastest of the timed calls: the
compile's own work beside it (Inductor's compile workers starting, the collector) only adds to a
call's time. Taken as the mean of three calls, the timing of a block of a 32-layer HF Llama
(batch 12) on one H200 came out on either side of the limit in two cold starts of the same job
(25.0 s shared, 62.9 s whole: results/2026-11-29_1xH200_restarts-llama32-b12-default-timing-moves).
The host's seconds per call against the GPU's decide: shared where
the host needs at most ``HOST_SHARE_LIMIT`` of the GPU's time on every rank (one gather on the
rank checks' gloo group, so all ranks decide alike and their collectives match), else the graph
compiles its blocks whole, as before, and the report gives both figures and the reason. The
margin is for what the block's call does not show: the host's other work in a step (the
optimizer, the loss, the graph around the blocks) and its noise between runs. A block that runs
on the CPU is its step's host time: never shared by this rule. The timing costs a few calls of
one block at compile time (milliseconds) and one block's activations, freed after; where the
blocks then stay whole, the block's own compile is spent for nothing, and the note says how
long it took. On one H200 (results/2026-11-29_1xH200_gpu-tests-sharing-timed) a GPT block of
width 2048 on 8 x 1024 tokens took the host 1.67 ms and the GPU 53.2 ms (shared), one of width 64
on 2 x 32 tokens 0.81 ms and 0.17 ms (kept whole). The limit is a margin, not a fitted figure:
one HF Llama step was measured on each side of it before (batch 4 bound by its host, batch 12 by
its GPU, above), not between.

NOTE [block timings kept]: the timing is a fact of the compiled block on this host and GPU, and a
restart that timed it again could decide otherwise, then miss every compile cache the first run
filled (in the run above, the warm restart after the whole-graph cold start took 15.1 s where one
that decided alike took 8.7 s, and a fresh machine 76.3 s). So each timing is kept beside
Inductor's compiled graphs, in its cache folder (``bucketwise/block_timings/``), under the FX-graph
cache keys of the block's forward and backward and the GPU's name: a restart that compiles the same
block (a cache hit or not) reads it instead of timing again, decides alike, and the report's
``timing`` says where it was kept (``kept``). Deleting the file times the block again. Where
torch's FX-graph cache does not key the graphs (caching off), nothing is kept. The compile
artifacts carry them too (NOTE [compile artifacts]), so a new machine restarting the job decides
as the run that saved them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .._compat import aot
from .._compat import cuda as cudac
from ..distributed.rank_check import gather_on_all_ranks, rank_checks_ready
from ..stats.files import atomic_write_json

log = logging.getLogger(__name__)

WARMUP = 2
CALLS = 5
HOLD_CYCLES = 200_000_000
"""About 100 to 140 ms at a data-center GPU's clock: more than the host needs to issue ``CALLS``
calls of a block that would be shared."""

HOST_SHARE_LIMIT = 0.6
"""Share where a block's call costs the host at most this fraction of the GPU's time for it."""


@dataclasses.dataclass(frozen=True)
class BlockTiming:
    """One compiled block's call (forward and backward) on one rank."""

    host_ms: float
    """Host time to issue one call, with the GPU held (no back-pressure): the fastest call."""
    gpu_ms: float
    """GPU time of one call, the calls run back to back."""
    held: bool
    """The host issued every call before the hold ended: otherwise ``gpu_ms`` includes waits for
    the host, and the host is slower than the GPU by more than any margin."""
    kept: str | None = None
    """The file it was read from, timed by an earlier compile of the same block (NOTE [block
    timings kept]); ``None``: timed by this compile."""

    @property
    def ratio(self) -> float:
        if not self.held or self.gpu_ms <= 0:
            return math.inf
        return self.host_ms / self.gpu_ms

    def to_dict(self) -> dict[str, Any]:
        out = {"host_ms": round(self.host_ms, 4), "gpu_ms": round(self.gpu_ms, 4), "held": self.held}
        return out if self.kept is None else {**out, "kept": self.kept}


def timing_of(
    forward: Callable[[list[Any]], Any],
    backward: Callable[[list[Any]], Any],
    forward_inputs: Sequence[Any],
    backward_inputs: Sequence[Any],
) -> BlockTiming | None:
    """A compiled block's timing (:func:`time_block`): the one an earlier compile of the same
    graphs kept on this kind of GPU, else timed now and kept (NOTE [block timings kept])."""
    path = kept_path(forward, backward, [*forward_inputs, *backward_inputs])
    kept = read_kept(path) if path is not None else None
    if kept is not None:
        return kept
    timing = time_block(forward, backward, forward_inputs, backward_inputs)
    if timing is not None and path is not None:
        keep(path, timing)
    return timing


def kept_path(forward: Any, backward: Any, inputs: Sequence[Any]) -> Path | None:
    """Where the timing of the block compiled as ``forward`` and ``backward`` is kept, ``None``
    where torch's cache keys neither or the block does not run on one CUDA device."""
    keys = (aot.graph_cache_key(forward), aot.graph_cache_key(backward))
    devices = {t.device for t in inputs if isinstance(t, torch.Tensor)}
    if None in keys or len(devices) != 1 or next(iter(devices)).type != "cuda":
        return None
    folder = kept_dir()
    if folder is None:
        return None
    gpu = torch.cuda.get_device_name(next(iter(devices)))
    name = hashlib.sha256("\0".join((*keys, gpu)).encode()).hexdigest()[:40]
    return folder / f"{name}.json"


def kept_dir() -> Path | None:
    """The folder of kept block timings, in Inductor's cache folder (NOTE [block timings kept]);
    ``None`` where torch does not say where that is."""
    cache = aot.inductor_cache_dir()
    return Path(cache) / "bucketwise" / "block_timings" if cache is not None else None


def read_kept(path: Path) -> BlockTiming | None:
    """The timing kept at ``path``, ``None`` where there is none (or it cannot be read)."""
    try:
        data = json.loads(path.read_text())
        return BlockTiming(
            host_ms=float(data["host_ms"]), gpu_ms=float(data["gpu_ms"]), held=bool(data["held"]), kept=str(path)
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("bucketwise: a kept block timing could not be read (%s: %s); timing the block again", path, exc)
        return None


def keep(path: Path, timing: BlockTiming) -> None:
    """Write ``timing`` to ``path`` whole (ranks of one machine may write the same file at once);
    a folder that cannot be written keeps nothing."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, dataclasses.replace(timing, kept=None).to_dict())
    except OSError as exc:
        log.warning("bucketwise: could not keep a block's timing at %s (%s); a restart will time it again", path, exc)


def time_block(
    forward: Callable[[list[Any]], Any],
    backward: Callable[[list[Any]], Any],
    forward_inputs: Sequence[Any],
    backward_inputs: Sequence[Any],
) -> BlockTiming | None:
    """Time a compiled block's boxed ``forward`` and ``backward`` on new tensors shaped like their
    example inputs (fake tensors); ``None`` where the block does not run on a CUDA device, or the
    timing ran out of its memory."""
    devices = {t.device for t in (*forward_inputs, *backward_inputs) if isinstance(t, torch.Tensor)}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return None
    device = next(iter(devices))
    try:
        return _time_on(device, forward, backward, forward_inputs, backward_inputs)
    except torch.OutOfMemoryError:
        # Not timed, as on the CPU: every rank still joins the decision, which keeps the blocks
        # whole on all of them (a rank leaving it alone would hang the others).
        log.warning("bucketwise: timing a shared block's call ran out of GPU memory; its blocks stay whole")
        torch.cuda.empty_cache()
        return None


def _time_on(
    device: torch.device,
    forward: Callable[[list[Any]], Any],
    backward: Callable[[list[Any]], Any],
    forward_inputs: Sequence[Any],
    backward_inputs: Sequence[Any],
) -> BlockTiming:
    with torch.cuda.device(device):
        fw = [_like(t) for t in forward_inputs]
        bw = [_like(t) for t in backward_inputs]

        def call() -> None:
            forward(list(fw))  # boxed: each call empties the list it is given
            backward(list(bw))

        for _ in range(WARMUP):
            call()
        torch.cuda.synchronize()
        start, held, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        cudac.hold_stream(HOLD_CYCLES)
        held.record()
        calls_s = []
        t0 = time.perf_counter()
        for _ in range(CALLS):
            t1 = time.perf_counter()
            call()
            calls_s.append(time.perf_counter() - t1)
        host_s = time.perf_counter() - t0
        end.record()
        end.synchronize()
        hold_ms = start.elapsed_time(held)
        return BlockTiming(
            host_ms=min(calls_s) * 1e3,
            gpu_ms=held.elapsed_time(end) / CALLS,
            held=host_s * 1e3 < hold_ms,
        )


def _like(t: Any) -> Any:
    """A real tensor with ``t``'s shape, strides, dtype and device (values that compute: small
    floats, zeros for integers and flags)."""
    if not isinstance(t, torch.Tensor):
        return t
    out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=t.device)
    if t.dtype.is_floating_point:
        return out.uniform_(-1.0, 1.0)
    return out.zero_()


def verdict(timings: Sequence[Sequence[BlockTiming | None]]) -> str | None:
    """Why the blocks stay with the whole graph, from every rank's timings of every compiled
    block (rank order), or ``None``: shared (NOTE [sharing measured at compile time])."""
    rows = [(rank, t) for rank, mine in enumerate(timings) for t in mine]
    timed = [(rank, t) for rank, t in rows if t is not None]
    if len(timed) < len(rows):
        return (
            "share_blocks='auto' shares blocks without CUDA graphs where a compiled block's call, timed on its GPU, "
            "hides behind its kernels; this block could not be timed (it runs on the CPU, whose host time is the "
            "step, compiles with a backend other than Inductor, or its timing ran out of GPU memory). Pass "
            "share_blocks=True for a shorter first step all the same"
        )
    rank, worst = max(timed, key=lambda row: row[1].ratio)
    if worst.ratio <= HOST_SHARE_LIMIT:
        return None
    where = f" on rank {rank}" if len(timings) > 1 else ""
    if not worst.held:
        measured = f"the host took {worst.host_ms:.3f} ms to issue one, longer than the GPU waited for it"
    else:
        measured = (
            f"the host took {worst.host_ms:.3f} ms to issue one and the GPU {worst.gpu_ms:.3f} ms to run it "
            f"({worst.ratio:.2f}x, more than {HOST_SHARE_LIMIT}x)"
        )
    if worst.kept is not None:
        measured += f" (timed by an earlier compile of the same block and kept: delete {worst.kept} to time it again)"
    return (
        f"share_blocks='auto' timed a shared block's call{where}: {measured}, so the step would wait on the host "
        "for every block (NOTE [sharing measured at compile time]). Pass share_blocks=True for a shorter first "
        "step all the same, or cudagraphs=True, whose replays share the blocks at no host cost"
    )


@dataclasses.dataclass(frozen=True)
class TimedSharing:
    """``share_blocks="auto"`` without CUDA graphs, for one graph: share its blocks where their
    timed calls hide behind the GPU on every rank (NOTE [sharing measured at compile time])."""

    report: Any
    """The compiled object's ``Report``: a refusal is noted there, for the host time only."""
    group: Any = None
    """The DDP module's process group, whose ranks decide together; ``None``: one process."""

    def refusal(
        self, container: str, count: int, timings: Sequence[BlockTiming | None], *, spent_s: float
    ) -> str | None:
        """Why ``count`` blocks of ``container`` stay with the whole graph, given this rank's
        ``timings`` (one per compiled block), or ``None``: share them. ``spent_s``: the seconds
        the blocks' compile and timing took, which the whole graph's compile does not reuse."""
        mine = list(timings)
        if self.group is not None and not rank_checks_ready(self.group):
            why = (
                "share_blocks='auto' shares blocks without CUDA graphs where every rank's timing of a block "
                "agrees, which takes bucketwise's rank checks (strategies 'fused' and 'auto'). Pass "
                "share_blocks=True for a shorter first step all the same"
            )
        else:
            # A world of one gathers its own (``gather_on_all_ranks``).
            gathered = (
                [mine]
                if self.group is None
                else gather_on_all_ranks(mine, self.group, what="shared-block timing", context=container)
            )
            why = verdict(gathered)
        if why is None:
            return None
        why = f"{why} (compiling and timing the block took {spent_s:.1f} s of this graph's compile)"
        self.report.blocks_unshared(container, count, reason=why, host_time=True)
        return why
