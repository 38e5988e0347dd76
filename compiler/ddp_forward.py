"""DDP's pre/post forward run eagerly around the compiled frame, so the reducer sees what it
sees in eager mode. Under ``fused`` the reducer stays idle and its buffers are released (NOTE
[released reducer]); under ``split`` and ``none`` it reduces."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable

import torch

from .._compat import c10d, ddp_hooks
from .._compat import ddp as ddpc
from .._compat import dynamo as dc
from .._compat import released_reducer as rr
from ..distributed.fused import FusedState
from ..distributed.fused.runtime import FusedRuntime
from ..distributed.rank_check import check_same_on_all_ranks, rank_checks_ready
from ..distributed.split.alignment import AlignmentPoll
from .blocks.calls import BlockCalls
from .decision import Decision, Variant, decide, refusal
from .hook_watch import HookWatch

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False, kw_only=True)
class DDPForward:
    """The DDP side of one compiled DDP module (``state.CompiledState.ddp``)."""

    ddp: Any
    config: Any
    """The compiled object's ``CompileConfig``."""
    report: Any
    """The compiled object's ``Report``."""
    backend: Any
    """The graph backend of the synced frame."""
    code: Any
    """The compiled frame's code object (``CompiledState.code``)."""
    call: Callable[..., Any]
    """The frame compiled for synced steps."""
    nosync_backend: Any
    call_nosync: Callable[..., Any]
    """The frame compiled for ``no_sync()`` steps: a second cache without collectives."""
    blocks: BlockCalls | None
    """The blocks Dynamo meets as one call each while the decision shares them (NOTE [Dynamo
    calls a block]); else Dynamo traces every block."""
    hooks: HookWatch
    buffers: ddpc.BufferBroadcast
    """DDP's buffer broadcast before a synced forward (NOTE [buffer broadcast])."""
    decision: Decision | None = None
    """``None``: decide at the next call (NOTE [one decision])."""
    fused: FusedState | None = None
    """While the decision is ``fused``: its runtime and the layouts checked across ranks."""
    comm_hooks: int = 0
    """Comm hooks the DDP module had when the decision was made."""
    alignment: AlignmentPoll | None = None
    unfrozen: set[Variant] = dataclasses.field(default_factory=lambda: {Variant.NO_SYNC})
    """Variants whose next call may compile although the object is frozen: the ``no_sync()``
    variant's first call, and both after a recompile the hooks asked for."""
    said: set[str] = dataclasses.field(default_factory=set)
    refused: str | None = None
    """What changed when an explicit strategy was last refused (NOTE [explicit strategies]): the next
    call decides again, and compiles the frames again once it applies."""

    def __post_init__(self) -> None:
        wrap = self.blocks.wrap if self.blocks is not None else (lambda call: call)
        self._calling_blocks = {Variant.SYNC: wrap(self.call), Variant.NO_SYNC: wrap(self.call_nosync)}

    def current(self) -> tuple[Decision | None, FusedState | None]:
        """The decision the synced frame's graphs compile under, and its fused runtime's state."""
        return self.decision, self.fused

    def _frame(self, variant: Variant) -> Callable[..., Any]:
        """The compiled frame of ``variant``, calling its blocks as one op each where they are shared."""
        if self.decision is not None and self.decision.sharing.enabled:
            return self._calling_blocks[variant]
        return self.call if variant is Variant.SYNC else self.call_nosync

    @property
    def runtime(self) -> FusedRuntime | None:
        return self.fused.runtime if self.fused is not None else None

    def own_hook_ids(self) -> set[int]:
        return self.fused.runtime.own_hook_ids() if self.fused is not None else set()

    # -- the decision ----------------------------------------------------------------------

    def check(self) -> None:
        """Before every call (NOTE [one decision], NOTE [hooks registered after compile])."""
        if self.decision is None:
            self._decide()
            return
        if self.refused is not None:
            changed = self.hooks.changed()  # the watch takes the hooks as they are now
            self._decide(changed or self.refused, recompile=True)
            return
        ddp = self.ddp
        hooks = self.hooks.changed()
        if hooks is not None:
            self._decide(hooks, recompile=True)
        elif ddp_hooks.comm_hook_count(ddp) != self.comm_hooks:
            self._decide("a comm hook was registered")
        elif self.fused is not None and rr.wants_released_reducer(ddp) and not rr.reducer_released(ddp):
            if not ddpc.join_enabled(ddp):
                self._decide("DDP's reducer was rebuilt (a built-in comm hook?)")

    def _decide(self, why: str | None = None, *, recompile: bool = False) -> None:
        """Decide; recompile the frames if ``recompile`` or the new decision's graphs differ."""
        old = self.decision
        new = decide(
            self.config,
            self.ddp,
            runs_ddp_forward=True,
            cudagraphs=self.backend.cudagraphs is not None,
            own_hooks=self.own_hook_ids(),
        )
        report = self.report
        self._check_across_ranks(new, why)
        problem = refusal(self.config, new, target=report.target)
        if problem is not None:
            # Nothing is applied; the next call decides again (NOTE [explicit strategies]).
            self.refused = why or "the first call"
            raise ValueError(problem)
        self.refused = None
        self.decision, self.comm_hooks = new, ddp_hooks.comm_hook_count(self.ddp)
        if old is None:
            self.hooks.start()
        elif recompile or not new.same_graphs(old):
            self._recompile()
            report.note(f"{why} after compile: the frames compiled before are compiled again (NOTE [one decision])")
            log.warning("bucketwise: %s: %s after compile; compiling its frames again", report.target, why)
        if old is not None and new.strategy is not old.strategy:
            report.note(
                f"strategy {old.strategy} -> {new.strategy}: {new.reason or 'what was asked for applies again'}"
            )
        self._apply(new)

    def _check_across_ranks(self, new: Decision, why: str | None) -> None:
        # NOTE [one decision across ranks]: the inputs of the decision (hooks, DDP's flags) are
        # per rank; a rank running ``split`` beside ``fused`` ones would hang in mismatched
        # collectives. So each ``auto``/``fused`` decision is compared on the gloo side group and
        # every rank raises RankMismatchError naming the difference; a rank deciding again alone
        # times out and says why it decided again.
        pg = ddpc.process_group(self.ddp)
        if not rank_checks_ready(pg):
            return  # strategy 'split'/'none': no hook changes what they run
        hooked = ", ".join(new.hooked) or "no parameter"
        signature = [
            f"comm hook: {new.comm_hook}",
            f"gradient hooks on: {hooked}",
            f"find_unused_parameters: {ddpc.find_unused_parameters(self.ddp)}",
            f"strategy: {new.strategy} ({new.reason or 'as asked'})",
        ]
        check_same_on_all_ranks(
            signature,
            pg,
            what="the DDP module's gradient-reduction decision",
            context=f"this rank decided again: {why}" if why else "the first call",
            fix="every rank's DDP module needs the same comm hook, gradient hooks and flags: register hooks "
            "on every rank, before or after bucketwise.compile alike",
        )

    def _apply(self, new: Decision) -> None:
        ddp, report, backend = self.ddp, self.report, self.backend
        if new.fused and self.fused is None:
            self.fused = FusedState(runtime=FusedRuntime(ddp))
            report.set_alignment_source(_fused_alignment)
            self.alignment = None
        elif not new.fused and self.fused is not None:
            self.fused.runtime.remove_hooks()
            self.fused = None
            rr.rebuild_reducer(ddp, why=f"strategy {new.strategy}: DDP's reducer reduces")
        if new.fused and new.caps is not None and new.caps.for_overlap:
            report.note(
                f"fused buckets {new.caps.describe()} (NOTE [fused bucket sizes]): fewer collectives than DDP's "
                "25 MiB buckets; pass bucket_cap_mb for fixed caps"
            )
        if not new.fused:
            report.set_alignment_source(backend.alignment)
            if self.alignment is None:
                self.alignment = AlignmentPoll(report, ddp)

    def _recompile(self) -> None:
        """Forget every frame this object compiled: the next call compiles them again."""
        for backend in (self.backend, self.nosync_backend):
            for code in backend.compiled_codes():
                dc.forget_compiled(code)
        if self.code is not None:
            dc.forget_compiled(self.code)
        self.unfrozen = {Variant.SYNC, Variant.NO_SYNC}
        if self.fused is not None:
            self.fused.runtime.forget_graphs()

    # -- the forward -----------------------------------------------------------------------

    def forward(self, args: tuple, kwargs: dict, *, stance: Callable[[], Any]) -> Any:
        """One forward; ``stance()``: the scope compiled calls run in (``CompiledState.stance``)."""
        self.check()
        ddp = self.ddp
        if self.fused is None:
            return self._with_reducer(Variant.SYNC, args, kwargs, stance)
        if not c10d.registered(ddpc.process_group(ddp)):
            raise RuntimeError(GROUP_DESTROYED)
        sync = ddpc.grad_sync_requested(ddp) and torch.is_grad_enabled()
        if sync and ddpc.join_enabled(ddp):
            return self._in_join(args, kwargs, stance)
        return self._fused(sync, args, kwargs, stance)

    def _fused(self, sync: bool, args: tuple, kwargs: dict, stance: Callable[[], Any]) -> Any:
        ddp, runtime = self.ddp, self.runtime
        if not rr.reducer_released(ddp):
            self._release_reducer()
        runtime.before_forward(sync)
        variant = Variant.SYNC if sync else Variant.NO_SYNC
        call = self._frame(variant)
        with self._stance(variant, stance):
            out = ddpc.run_forward_with_idle_reducer(ddp, args, kwargs, call, self.buffers)
        runtime.after_forward(out, sync)
        if runtime.eager_reduced and "eager grads" not in self.said:
            self.said.add("eager grads")
            names = list(runtime.eager_reduced.values())
            text = (
                f"{len(names)} parameter(s) ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) got their "
                "gradients from code Dynamo ran eagerly (a graph break's region, a reentrant checkpoint's "
                "recompute): averaged after their backward, not overlapped with it (NOTE [fused strategy runtime])"
            )
            log.info("bucketwise fused: %s", text)
            self.report.note(text)
        return out

    def _in_join(self, args: tuple, kwargs: dict, stance: Callable[[], Any]) -> Any:
        """A synced step inside ``ddp.join()`` (uneven inputs).

        NOTE [fused under join]: a joined rank's join hook shadows the *reducer's* allreduces,
        which the fused graphs' buckets would not match. So each step first sends the join
        notification: while no rank has joined, the fused graphs run; after, the step runs the
        ``no_sync()`` graphs with DDP's reducer reducing, which the join hook mirrors.
        """
        ddp = self.ddp
        world = ddpc.world_size(ddp)
        with ddpc.join_notified(ddp) as notice:
            not_joined = notice.not_joined
            if not_joined is not None and not_joined == world:
                return self._fused(True, args, kwargs, stance)
            if "join" not in self.said:
                self.said.add("join")
                why = "a rank has joined" if not_joined is not None else "another joinable leads the join context"
                log.info("bucketwise fused: join(): %s; steps run with DDP's reducer from now on while that holds", why)
                self.report.note(
                    f"join(): steps where {why} ran the compiled graphs without collectives and DDP's reducer "
                    "reduced the gradients, as DDP's join hook expects (NOTE [fused under join])"
                )
            self.runtime.reducer_step()
            notice.hand_to_reducer()
            return self._with_reducer(Variant.NO_SYNC, args, kwargs, stance)

    def _with_reducer(self, variant: Variant, args: tuple, kwargs: dict, stance: Callable[[], Any]) -> Any:
        ddp = self.ddp
        args, kwargs = ddpc.pre_forward(ddp, args, kwargs, self.buffers)
        with self._stance(variant, stance):
            out = self._frame(variant)(*args, **kwargs)
        out = ddpc.post_forward(ddp, out)
        if self.alignment is not None:
            self.alignment.after_forward()
        return out

    def _stance(self, variant: Variant, stance: Callable[[], Any]) -> Any:
        if variant in self.unfrozen:
            self.unfrozen.discard(variant)
            return contextlib.nullcontext()
        return stance()

    def _release_reducer(self) -> None:
        """Free DDP's idle bucket buffers (NOTE [released reducer]), except under ``join()``,
        where a rank with no inputs keeps its reducer and every rank's must match."""
        ddp = self.ddp
        if rr.wants_released_reducer(ddp) and ddpc.join_enabled(ddp):
            return
        freed = rr.release_reducer(ddp)
        if freed and "release" not in self.said:
            self.said.add("release")
            self.report.note(
                f"DDP's reducer bucket buffers released ({freed / 2**20:.1f} MiB, a second copy of the gradients): the "
                "fused backward reduces into buffers that become param.grad (NOTE [released reducer])"
            )


GROUP_DESTROYED = (
    "bucketwise: this DDP module's process group was destroyed (destroy_process_group() was called); its "
    "compiled graphs (strategy 'fused') reduce gradients through that group and cannot run without it. Call "
    "the model before destroy_process_group(), or init_process_group() again and compile a new DDP module"
)


def _fused_alignment() -> dict[str, Any]:
    return {"alignment": None, "status": "fused: DDP's reducer is idle, the compiled backward reduces"}
