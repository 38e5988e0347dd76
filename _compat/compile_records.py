"""Torch's records of this process's latest compiles (``torch._dynamo.utils.get_compilation_metrics``),
read for the report's compile times (``stats/compile_times.py``). Checked on torch 2.13; the
fields are those of 2.11 too, and a record missing one reads as ``None``/0."""

from __future__ import annotations

import dataclasses

import torch
import torch._dynamo.utils


@dataclasses.dataclass(frozen=True)
class CompileRecord:
    """What torch recorded about one frame compile (``forward``) or one lazily compiled backward."""

    compile_id: str
    forward: bool
    start_us: int
    end_us: int | None
    frame_s: float | None
    """Frame: the whole compile (Dynamo, backend call, guards)."""
    backend_s: float | None
    """Frame: the backend call."""
    backward_s: float | None
    """Lazy backward: the whole backward compile."""
    inductor_s: float | None
    """Inductor's compiles within it."""
    fx_hit: int
    fx_miss: int


def compile_records() -> list[CompileRecord]:
    """Oldest first: torch's 64 latest ``CompilationMetrics``, one per frame compile
    (``is_forward=True``) and one per lazily compiled backward (``is_forward=False``)."""
    get = getattr(torch._dynamo.utils, "get_compilation_metrics", None)
    out = []
    for m in get() if get is not None else []:
        cid, start = getattr(m, "compile_id", None), getattr(m, "start_time_us", None)
        if cid is None or start is None:
            continue
        backward_us, inductor_us = (
            getattr(m, "backward_cumulative_compile_time_us", None),
            getattr(m, "inductor_cumulative_compile_time_us", None),
        )
        out.append(
            CompileRecord(
                compile_id=str(cid),
                forward=getattr(m, "is_forward", None) is not False,
                start_us=int(start),
                end_us=getattr(m, "end_time_us", None),
                frame_s=getattr(m, "entire_frame_compile_time_s", None),
                backend_s=getattr(m, "backend_compile_time_s", None),
                backward_s=None if backward_us is None else backward_us / 1e6,
                inductor_s=None if inductor_us is None else inductor_us / 1e6,
                fx_hit=sum(
                    int(getattr(m, f"inductor_fx_{where}_cache_hit_count", 0) or 0) for where in ("local", "remote")
                ),
                fx_miss=sum(
                    int(getattr(m, f"inductor_fx_{where}_cache_miss_count", 0) or 0) for where in ("local", "remote")
                ),
            )
        )
    return out
