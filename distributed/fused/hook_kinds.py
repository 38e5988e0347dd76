"""What each DDP comm hook becomes under ``fused``: the one table of hook kinds.

A kind either reduces each bucket with one traced all-reduce (no hook: DDP's reducer rule;
torch's allreduce, fp16 and bf16 hooks: divide, then sum, in ``comm_dtype``), or with a
``HookProgram`` traced into the backward (PowerSGD, a ``bucketwise.traceable_comm_hook``), or it
is refused with the reason (DDP's reducer then runs the hook under ``split``). Adding a kind is a
row in :func:`hook_kind` here and, for a program, its ``HookProgram`` (docs/design.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ..._compat import ddp_hooks, pieces
from .comm_hooks import HookProgram, TraceableCommHook, TracedHookProgram
from .powersgd_run import PowerSGDRun
from .sync import CommSpec, group_spec, reducer_spec

ProgramFactory = Callable[[Any, Any, CommSpec], HookProgram]
"""(hook, hook state, the buckets' spec) -> the program that reduces every bucket."""


@dataclasses.dataclass(frozen=True)
class HookKind:
    name: str
    comm_dtype: torch.dtype | None = None
    """A plain all-reduce of each bucket, in this dtype (fp16/bf16 compression)."""
    program: ProgramFactory | None = dataclasses.field(default=None, compare=False)
    """The hook's program (``None``: one all-reduce per bucket); the kind's name tells programs apart."""
    unsupported: str | None = None
    """Why ``fused`` cannot reproduce the hook (``None`` where it can)."""
    reducer: bool = False
    """No hook: DDP's reducer's rule (``grad * (1/world)``, then sum)."""

    @property
    def plain(self) -> bool:
        """Each bucket is reduced by one traced all-reduce (``BucketSync``)."""
        return self.program is None and self.unsupported is None

    def spec(self, pg: Any) -> CommSpec:
        """How a bucket is reduced on ``pg``."""
        if self.reducer:
            return reducer_spec(pg)
        return dataclasses.replace(group_spec(pg), comm_dtype=self.comm_dtype)

    def __str__(self) -> str:
        return self.name


REDUCER = HookKind("reducer", reducer=True)


def _powersgd(hook: Any, state: Any, spec: CommSpec) -> HookProgram:
    return PowerSGDRun(state, group_spec(state.process_group), pieces.mark_static_address)


def hook_kind(ddp: Any) -> HookKind:
    """Read at the first forward: comm hooks are registered after construction."""
    registered = ddp_hooks.comm_hook(ddp)
    if registered is None:
        builtin = ddp_hooks.builtin_hook_name(ddp)
        if builtin is not None:
            why = f"DDP's built-in comm hook {builtin} runs in its C++ reducer and cannot be traced"
            return HookKind("unsupported", unsupported=why)
        return REDUCER
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    hook, _state = registered
    known = {
        dh.allreduce_hook: HookKind("allreduce"),
        dh.bf16_compress_hook: HookKind("bf16", comm_dtype=torch.bfloat16),
        dh.fp16_compress_hook: HookKind("fp16", comm_dtype=torch.float16),
        ps.powerSGD_hook: HookKind("powersgd", program=_powersgd),
    }
    if hook in known:
        return known[hook]
    if isinstance(hook, TraceableCommHook):
        return HookKind(f"traceable {hook.__qualname__}", program=TracedHookProgram)
    if hook is ps.batched_powerSGD_hook:
        why = (
            "batched_powerSGD_hook is not reproduced in the graph"
            if ddp_hooks.batched_powersgd_works()
            else f"torch {torch.__version__}'s batched_powerSGD_hook fails at its first compressed step (its "
            "_orthogonalize takes only 3-D batches, the hook passes a 2-D matrix)"
        )
        return HookKind("unsupported", unsupported=why)
    name = getattr(hook, "__qualname__", repr(hook))
    why = (
        f"comm hook {name} cannot be traced into the graph (wrap a hook written with functional "
        "collectives in bucketwise.traceable_comm_hook)"
    )
    return HookKind("unsupported", unsupported=why)
