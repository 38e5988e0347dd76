"""How a compiled object's graphs reduce DDP's gradients: decided once, in one place.

NOTE [one decision]: what graphs do with DDP's gradients depends on the DDP module (comm hook,
``find_unused_parameters``, gradient hooks, process group, bucket caps) and on ``strategy=``. A
compiled DDP module decides at its first call (hooks are registered after construction); its
graph backend reads the :class:`Decision` for every graph's plan (NOTE [one plan per graph]). It
is redone, recompiling if changed, only when an input changes (``hook_watch.py``, a rebuilt
reducer). A compiled function decides when it finds its DDP module while compiling (``split``:
``fused`` needs our DDP forward).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Collection

import torch

from .._compat import ddp as ddpc
from .._compat.capabilities import SHAREABLE
from ..distributed.fused.hook_kinds import REDUCER, HookKind, hook_kind
from ..distributed.fused.policy import hooked_gradients, why_not_fused
from ..distributed.fused.sync import CommSpec
from ..distributed.plan import BucketCaps
from ..distributed.split.stops import ReducerStop, reducer_stop
from .config import CompileConfig


class Strategy(str, enum.Enum):
    """What a graph does with DDP's gradients (``strategy=`` of :func:`bucketwise.compile`)."""

    AUTO = "auto"
    FUSED = "fused"
    SPLIT = "split"
    NONE = "none"

    def __str__(self) -> str:
        return self.value


class Variant(str, enum.Enum):
    """Which of a compiled DDP module's two graph caches a graph belongs to."""

    SYNC = "sync"
    """Steps that reduce gradients."""
    NO_SYNC = "no_sync"
    """``no_sync()`` steps, evaluation and the reducer's steps under ``join()``: no collectives."""


# NOTE [sharing by default]: sharing one compile among identical blocks (NOTE [one compile per
# block]) shortens the first step, but each shared block costs host time every step (extra calls,
# allocations, kernels that no longer fuse across its edges). So ``share_blocks="auto"`` shares
# under bucketwise's CUDA graphs (one replay); without them on a GPU where the call hides behind
# its kernels (NOTE [sharing by cost]); never on the CPU; never under ``split`` (a shared block is
# never cut, so its bucket segments would merge). Decided again once the strategy is chosen; the
# report says why ``"auto"`` left blocks whole.


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSharing:
    """Whether identical blocks share one compile (NOTE [sharing by default])."""

    enabled: bool
    reason: str | None = None
    """Why ``share_blocks="auto"`` left them unshared (``None`` otherwise)."""
    host_time: bool = False
    """Left unshared only for the host time each shared block's call costs every step (``auto``
    without CUDA graphs): where the GPU, not the host, bounds the step, sharing costs nothing
    (NOTE [saying when sharing blocks is free])."""
    by_cost: bool = False
    """Shared in a graph only where the block's call, estimated from its graphs, hides behind its
    kernels (``auto`` without CUDA graphs, NOTE [sharing by cost])."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decision:
    """How the graphs of one compiled object reduce one DDP module's gradients (NOTE [one decision])."""

    strategy: Strategy
    reason: str | None = None
    """Why it is not the requested one (``None`` where it is, or nothing was requested)."""
    comm_hook: HookKind = REDUCER
    """What the DDP module's comm hook becomes under ``fused`` (``hook_kinds.hook_kind``)."""
    hooked: tuple[str, ...] = ()
    """Parameters with gradient hooks (NOTE [gradient hooks before the reduction])."""
    caps: BucketCaps | None = None
    """The bucket caps, DDP's with the user's overrides, or ``fused``'s sized for the overlap
    (NOTE [fused bucket sizes]; ``None`` without a DDP module)."""
    spec: CommSpec | None = None
    """``fused``: how each bucket is reduced (DDP's reducer or its comm hook)."""
    ddp_id: int | None = None
    """``id()`` of the DDP module decided for."""
    sharing: BlockSharing = BlockSharing(enabled=False)
    """Whether identical blocks share one compile under ``strategy`` (NOTE [sharing by default])."""
    stops: ReducerStop | None = None
    """``split``: why DDP's reducer would stop training for good (then refused, NOTE [PowerSGD on gloo])."""

    @property
    def fused(self) -> bool:
        return self.strategy is Strategy.FUSED

    @property
    def plain_buckets(self) -> bool:
        """``fused`` with one traced all-reduce per bucket (no hook program)."""
        return self.fused and self.spec is not None and self.comm_hook.plain

    def same_graphs(self, other: Decision | None) -> bool:
        """Whether graphs compiled under ``other`` are what this decision would compile."""
        if other is None or (self.strategy, self.caps, self.ddp_id) != (other.strategy, other.caps, other.ddp_id):
            return False
        return not self.fused or (self.comm_hook, self.spec) == (other.comm_hook, other.spec)


def decide(
    config: CompileConfig,
    ddp: Any | None,
    *,
    runs_ddp_forward: bool,
    cudagraphs: bool,
    variant: Variant = Variant.SYNC,
    own_hooks: Collection[int] = (),
) -> Decision:
    """``runs_ddp_forward``: bucketwise runs the DDP forward itself (``fused`` needs it);
    ``own_hooks``: handle ids of bucketwise's own gradient hooks, ignored."""
    decision = decide_strategy(config, ddp, runs_ddp_forward=runs_ddp_forward, variant=variant, own_hooks=own_hooks)
    sharing = decide_sharing(config, cudagraphs=cudagraphs, strategy=decision.strategy)
    return dataclasses.replace(decision, sharing=sharing)


def decide_strategy(
    config: CompileConfig,
    ddp: Any | None,
    *,
    runs_ddp_forward: bool,
    variant: Variant = Variant.SYNC,
    own_hooks: Collection[int] = (),
) -> Decision:
    """``decide`` without block sharing (what ``refusal`` reads)."""
    requested = Strategy(config.strategy)
    if ddp is None:
        reason = "no DDP module: no gradient buckets" if requested in (Strategy.SPLIT, Strategy.FUSED) else None
        return Decision(strategy=Strategy.NONE, reason=reason)
    caps = BucketCaps.from_ddp(ddp, bucket_cap_mb=config.bucket_cap_mb, first_bucket_cap_mb=config.first_bucket_cap_mb)
    common = {"caps": caps, "ddp_id": id(ddp)}
    if variant is Variant.NO_SYNC:
        return Decision(strategy=Strategy.NONE, reason="no_sync(): no gradient communication", **common)
    if requested is Strategy.NONE:
        return Decision(strategy=Strategy.NONE, **common)
    if ddpc.uses_python_reducer(ddp):
        return Decision(
            strategy=Strategy.NONE, reason="DDP's python reducer (compiled autograd) does its own bucketing", **common
        )
    kind = hook_kind(ddp)
    hooked = tuple(hooked_gradients(ddp, own=own_hooks))
    common.update(comm_hook=kind, hooked=hooked)
    blocker = why_not_fused(ddp, requested.value, comm_hook=kind, hooked=hooked)
    if blocker is None and not runs_ddp_forward:
        blocker = "fused needs bucketwise to run the DDP forward: compile the DDP module itself"
    if requested is Strategy.SPLIT or blocker is not None:
        reason = None if requested is Strategy.SPLIT else blocker
        return Decision(
            strategy=Strategy.SPLIT, reason=reason, stops=reducer_stop(ddp, fused_applies=blocker is None), **common
        )
    overridden = config.bucket_cap_mb is not None or config.first_bucket_cap_mb is not None
    common["caps"] = caps.for_fused(ddp, overridden=overridden, plain=kind.plain)
    return Decision(strategy=Strategy.FUSED, spec=kind.spec(ddpc.process_group(ddp)), **common)


# NOTE [explicit strategies]: ``"auto"`` falls back where ``fused`` cannot apply, with the reason
# in the report. An explicit ``"fused"``/``"split"`` that cannot apply raises instead, naming why
# and what to pass, before anything is built: at ``compile`` what is known then
# (``api.check_strategy``), later hooks at the deciding call (``DDPForward``), a compiled
# function's DDP module when its graph compiles. ``find_unused_parameters=True`` does not stop an
# explicit ``fused`` (NOTE [fused and unused parameters]). A ``split`` that would stop training
# for good (NOTE [PowerSGD on gloo]) raises the same way, chosen by ``auto`` too.


def refusal(config: CompileConfig, decision: Decision, *, target: str) -> str | None:
    """The error message where an explicit strategy cannot run (NOTE [explicit strategies]), or
    where ``split`` would stop training for good (NOTE [PowerSGD on gloo])."""
    requested = Strategy(config.strategy)
    stops = decision.stops if decision.strategy is Strategy.SPLIT else None
    if stops is not None and requested is not Strategy.FUSED:
        chosen = "strategy='split'"
        if requested is not Strategy.SPLIT:
            chosen = f"'split', which strategy={requested.value!r} chose ({decision.reason}),"
        return f"{chosen} cannot train {target}: {stops}. {stops.fix}"
    if requested not in (Strategy.FUSED, Strategy.SPLIT) or decision.strategy is requested:
        return None
    if decision.ddp_id is None:
        return (
            f"strategy={requested.value!r} needs a DistributedDataParallel module, and {target} is not one: it has "
            "no gradient buckets to reduce. Compile DDP(model) for bucketwise's strategies, or pass strategy='auto' "
            "(or 'none') to compile it whole"
        )
    if stops is not None:
        return f"strategy='fused' cannot apply to {target}: {decision.reason}. Nor can 'split': {stops}. {stops.fix}"
    fallback = decision.strategy.value
    return (
        f"strategy={requested.value!r} cannot apply to {target}: {decision.reason}. Pass strategy='auto', which "
        f"runs {fallback!r} here (the report's strategy_reason says why), or strategy={fallback!r}"
    )


def decide_sharing(config: CompileConfig, *, cudagraphs: bool, strategy: Strategy | None = None) -> BlockSharing:
    """``config.share_blocks`` resolved (NOTE [sharing by default]); ``strategy=None``: the
    requested one stands in until chosen."""
    if config.share_blocks is False:
        return BlockSharing(enabled=False)
    if not config.capabilities.shares_blocks:
        return BlockSharing(
            enabled=False,
            reason=f"blocks are shared with the backends {list(SHAREABLE)}, not {config.backend_name!r}",
        )
    if config.share_blocks is True:
        return BlockSharing(enabled=True)
    chosen = strategy if strategy is not None else Strategy(config.strategy)
    if chosen is Strategy.SPLIT:
        under = "strategy='split'"
        if config.strategy != Strategy.SPLIT.value:
            under = f"'split', which strategy={config.strategy!r} chose"
        return BlockSharing(
            enabled=False,
            reason=f"share_blocks='auto' does not share blocks under {under} (a shared block is never cut, so its "
            "bucket segments would merge). Pass share_blocks=True to share them all the same",
        )
    if cudagraphs:
        return BlockSharing(enabled=True)
    if not torch.cuda.is_available():
        return BlockSharing(
            enabled=False,
            host_time=True,
            reason="share_blocks='auto' leaves identical blocks to the whole graph: on the CPU each call costs host "
            "time every step. Pass share_blocks=True for a shorter first step all the same",
        )
    return BlockSharing(enabled=True, by_cost=True)
