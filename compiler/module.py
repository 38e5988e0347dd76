"""What :func:`bucketwise.compile` returns: compiled modules and functions."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import types
from typing import Any, Callable

import torch
import torch.nn as nn

from .._compat import ddp as ddpc
from .._compat import dynamo as dc
from ..cudagraphs.policy import Decision
from ..distributed import gloo_exit, teardown
from ..distributed.fused.runtime import FusedRuntime
from ..distributed.rank_check import prepare_rank_checks
from ..distributed.split.alignment import measure_alignment
from ..stats import profiling
from ..stats.report import Report
from .config import CompileConfig
from .freeze import freeze_after_warmup, stance
from .graph_backend import GraphBackend
from .strategy import resolve_strategy

log = logging.getLogger(__name__)

_ALIGNMENT_POLLS = 20


def _inner_forward(module: nn.Module) -> Callable[..., Any]:
    """The frame Dynamo compiles for a module, with a code object of its own.

    NOTE [compiling torch.nn containers]: Dynamo skips frames whose code lives in ``torch.nn``
    (``nn.Sequential.forward``, ...), so ``torch.compile(DDP(nn.Sequential(...)))`` compiles
    nothing. This closure is bucketwise code, so Dynamo converts it and inlines the module's
    ``__call__``/``forward`` into one graph whatever class the module is.

    NOTE [one cache per compiled object]: Dynamo keeps its compiled entries, and counts them
    against ``recompile_limit`` (8), per code object. Every closure made here shares one code
    object, so compiled objects would compete for those 8 entries: the 9th model compiled in a
    process (a sweep, a notebook, a test suite) ran eagerly. Each compiled object gets a copy
    of the code object instead, and with it a cache of its own.
    """

    def bucketwise_forward(*args: Any, **kwargs: Any) -> Any:
        return module(*args, **kwargs)

    fn = bucketwise_forward
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _torch_compile(fn: Callable[..., Any], backend: GraphBackend, config: CompileConfig) -> Callable[..., Any]:
    return torch.compile(fn, backend=backend, fullgraph=config.fullgraph, dynamic=config.dynamic)


class CompiledModule(nn.Module):
    """A compiled module that behaves like the one it wraps.

    Same parameters (the same tensors), same ``state_dict`` keys (no ``_orig_mod.`` prefix),
    attribute access falls through to the original (``compiled.no_sync()``, ``compiled.module``).

    For a DDP module the forward is DDP's own: ``_pre_forward`` (reducer preparation, bucket
    rebuild, buffer broadcast, input moves) and ``_post_forward`` run eagerly around the
    compiled inner module, so DDP's reducer sees exactly what it sees in eager mode.
    """

    def __init__(self, mod: nn.Module, config: CompileConfig, *, cudagraphs: Decision) -> None:
        super().__init__()
        self._orig_mod = mod
        ddp = mod if ddpc.is_ddp(mod) else None
        inner = mod.module if ddp is not None else mod
        report = Report(
            target=type(inner).__name__ if ddp is None else f"DDP({type(inner).__name__})",
            strategy=config.strategy,
            backend=config.backend_name,
        )
        runtime = FusedRuntime(ddp) if ddp is not None and config.strategy in ("fused", "auto") else None
        backend = GraphBackend(config, report, ddp, cudagraphs=cudagraphs, fused_runtime=runtime)
        forward = _inner_forward(inner)
        # Plain attributes, not submodules: keep them out of parameters()/state_dict().
        self.__dict__["_bucketwise_report"] = report
        self.__dict__["_bucketwise_ddp"] = ddp
        self.__dict__["_bucketwise_runtime"] = runtime
        self.__dict__["_bucketwise_backend"] = backend
        self.__dict__["_bucketwise_freeze"] = config.freeze_mode
        self.__dict__["_nosync_warm"] = False
        self.__dict__["_fused_checked"] = runtime is None
        self.__dict__["_bucketwise_code"] = forward.__code__
        self.__dict__["_bucketwise_call"] = _torch_compile(forward, backend, config)
        self.__dict__["_alignment_pending"] = ddp is not None and runtime is None
        if runtime is not None:
            # no_sync() steps and evaluation run a second compiled variant without collectives;
            # Dynamo keeps one cache entry per backend, so switching costs no recompile.
            nosync = GraphBackend(
                dataclasses.replace(config, strategy="none"), report, ddp, cudagraphs=cudagraphs, variant="no_sync"
            )
            self.__dict__["_bucketwise_call_nosync"] = _torch_compile(forward, nosync, config)
            prepare_rank_checks(ddpc.process_group(ddp))
            if backend.cudagraphs is not None:
                # The backward graphs will hold the bucket allreduces' NCCL kernels.
                teardown.guard(ddpc.process_group(ddp))
            report.set_alignment_source(
                lambda: {"alignment": None, "status": "fused: DDP's reducer is idle, the compiled backward reduces"}
            )
        elif ddp is not None:
            report.set_alignment_source(lambda: measure_alignment(ddp, backend.param_segments))
        if ddp is not None:
            gloo_exit.settle_at_exit(ddpc.process_group(ddp))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        ddp = self._bucketwise_ddp
        training = torch.is_grad_enabled() and (ddp is None or ddpc.grad_sync_requested(ddp))
        profiling.on_call(self, self._bucketwise_report, training=training)
        runs = self._bucketwise_report.graph_runs
        first = self._bucketwise_report.first_step
        if first.pending:
            first.start()
            out = self._forward(*args, **kwargs)
            first.forward_done(out)
        else:
            out = self._forward(*args, **kwargs)
        if self._bucketwise_report.graph_runs == runs:
            say_eager(self._bucketwise_report, self._bucketwise_code, self.__dict__.get("_bucketwise_frozen"))
        freeze_after_warmup(self, self._bucketwise_freeze)
        self._bucketwise_report.after_call()
        return out

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        ddp = self._bucketwise_ddp
        if ddp is None:
            with stance(self):
                return self._bucketwise_call(*args, **kwargs)
        runtime = self._bucketwise_runtime
        if runtime is not None and not self._fused_checked:
            runtime = self._confirm_fused(ddp, runtime)
        if runtime is not None:
            sync = ddpc.grad_sync_requested(ddp) and torch.is_grad_enabled()
            if sync and ddpc.join_enabled(ddp):
                return self._forward_in_join(ddp, runtime, args, kwargs)
            return self._forward_fused(ddp, runtime, sync, args, kwargs)
        return self._forward_with_reducer(ddp, self._bucketwise_call, args, kwargs)

    def _forward_fused(self, ddp: Any, runtime: FusedRuntime, sync: bool, args: tuple, kwargs: dict) -> Any:
        if not ddpc.reducer_released(ddp):
            self._release_reducer(ddp)
        runtime.before_forward(sync)
        call = self._bucketwise_call if sync else self._bucketwise_call_nosync
        # The no_sync() variant is bucketwise's own second cache entry: its first call is
        # part of the warm-up even when it comes after freezing.
        warm = sync or self._nosync_warm
        with stance(self) if warm else contextlib.nullcontext():
            out = ddpc.run_forward_with_idle_reducer(ddp, args, kwargs, call)
        if not sync:
            self.__dict__["_nosync_warm"] = True
        runtime.after_forward(out, sync)
        return out

    def _forward_in_join(self, ddp: Any, runtime: FusedRuntime, args: tuple, kwargs: dict) -> Any:
        """A synced step inside ``ddp.join()`` (uneven inputs).

        NOTE [fused under join]: a rank that has run out of inputs loops in ``Join.__exit__``
        and, for every step the others still take, runs DDP's join hook, which shadows the
        *reducer's* bucket allreduces with zeros. The fused graphs' collectives follow
        bucketwise's own buckets, so nothing on a joined rank would match them. Each step
        therefore first sends the join notification (which counts the ranks that have not
        joined): while every rank is still in, no rank runs the join hook and the fused graphs
        run as usual; once a rank has joined, the step runs the compiled graphs without
        collectives (the ``no_sync()`` variant: no new compile after warm-up) with DDP's
        reducer in charge, exactly what the join hook on the joined ranks mirrors. Only the
        last steps of an uneven epoch lose the in-graph overlap.
        """
        world = ddpc.world_size(ddp)
        with ddpc.join_notified(ddp) as notice:
            not_joined = notice.not_joined
            if not_joined is not None and not_joined == world:
                return self._forward_fused(ddp, runtime, True, args, kwargs)
            if not self.__dict__.get("_join_noted"):
                self.__dict__["_join_noted"] = True
                why = "a rank has joined" if not_joined is not None else "another joinable leads the join context"
                log.info("bucketwise fused: join(): %s; steps run with DDP's reducer from now on while that holds", why)
                self._bucketwise_report.note(
                    f"join(): steps where {why} ran the compiled graphs without collectives and DDP's reducer "
                    "reduced the gradients, as DDP's join hook expects (NOTE [fused under join])"
                )
            runtime.reducer_step()
            notice.hand_to_reducer()
            out = self._forward_with_reducer(ddp, self._bucketwise_call_nosync, args, kwargs, warm=self._nosync_warm)
            self.__dict__["_nosync_warm"] = True
            return out

    def _forward_with_reducer(
        self, ddp: Any, call: Callable[..., Any], args: tuple, kwargs: dict, *, warm: bool = True
    ) -> Any:
        """DDP's own forward around a compiled call: the reducer reduces in the backward."""
        args, kwargs = ddpc.pre_forward(ddp, args, kwargs)
        if self._alignment_pending and ddpc.has_rebuilt_buckets(ddp):
            self._refresh_alignment()
        with stance(self) if warm else contextlib.nullcontext():
            out = call(*args, **kwargs)
        return ddpc.post_forward(ddp, out)

    def _confirm_fused(self, ddp: Any, runtime: FusedRuntime) -> FusedRuntime | None:
        """At the first forward (comm hooks are registered after construction): keep DDP's
        reducer in charge when the fused strategy cannot reproduce what it would do."""
        self.__dict__["_fused_checked"] = True
        requested = self._bucketwise_backend.config.strategy
        if resolve_strategy(requested, ddp, runs_ddp_forward=True).strategy == "fused":
            self.__dict__["_release_wanted"] = True
            return runtime
        runtime.remove_hooks()
        self.__dict__["_bucketwise_runtime"] = None
        self.__dict__["_alignment_pending"] = True
        backend = self._bucketwise_backend
        backend.fused_runtime = None
        self._bucketwise_report.set_alignment_source(lambda: measure_alignment(ddp, backend.param_segments))
        return None

    def _release_reducer(self, ddp: Any) -> None:
        """Free DDP's idle bucket buffers (NOTE [released reducer]). Once ``join()`` rebuilt them,
        they stay while the join context lasts: a rank with no inputs left never forwards, so it
        keeps whatever reducer it has, and every rank's must be in the same state."""
        if not self.__dict__.get("_release_wanted"):
            return
        if ddpc.wants_released_reducer(ddp) and ddpc.join_enabled(ddp):
            return
        freed = ddpc.release_reducer(ddp)
        if freed and not self.__dict__.get("_release_noted"):
            self.__dict__["_release_noted"] = True
            self._bucketwise_report.note(
                f"DDP's reducer bucket buffers released ({freed / 2**20:.1f} MiB, a second copy of the gradients): the "
                "fused backward reduces into buffers that become param.grad (NOTE [released reducer])"
            )

    def _refresh_alignment(self) -> None:
        """Once the reducer's rebuilt buckets are readable, publish the alignment figure.

        DDP refreshes its logging data on its first iterations (then every 100th); stop asking
        after ``_ALIGNMENT_POLLS`` forwards so a long run never pays for this on its hot path
        (``report()`` still reads it on demand)."""
        polls = self.__dict__.get("_alignment_polls", 0) + 1
        self.__dict__["_alignment_polls"] = polls
        if self._bucketwise_report.alignment is not None or polls >= _ALIGNMENT_POLLS:
            self.__dict__["_alignment_pending"] = False
            self._bucketwise_report.write_rank_file()

    # -- behave like the original module ---------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._orig_mod, name)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._orig_mod.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self._orig_mod.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._orig_mod.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._orig_mod.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)


def compile_function(fn: Callable[..., Any], config: CompileConfig, *, cudagraphs: Decision) -> Callable[..., Any]:
    """A compiled function. DDP modules it calls get the split strategy (torch's own
    DDPOptimizer is switched off around each call, see ``torch_ddp_optimizer_disabled``)."""
    report = Report(
        target=getattr(fn, "__qualname__", type(fn).__name__), strategy=config.strategy, backend=config.backend_name
    )
    backend = GraphBackend(config, report, None, cudagraphs=cudagraphs)
    report.set_alignment_source(lambda: function_alignment(backend))
    compiled = _torch_compile(fn, backend, config)

    @functools.wraps(fn)
    def bucketwise_compiled(*args: Any, **kwargs: Any) -> Any:
        profiling.on_call(bucketwise_compiled, report, training=torch.is_grad_enabled())
        runs = report.graph_runs
        first = report.first_step.pending and report.first_step
        if first:
            first.start()
        with dc.torch_ddp_optimizer_disabled(), stance(bucketwise_compiled):
            out = compiled(*args, **kwargs)
        if first:
            first.forward_done(out)
        if report.graph_runs == runs:
            say_eager(report, getattr(fn, "__code__", None), bucketwise_compiled.__dict__.get("_bucketwise_frozen"))
        freeze_after_warmup(bucketwise_compiled, config.freeze_mode)
        report.after_call()
        return out

    bucketwise_compiled._bucketwise_report = report  # type: ignore[attr-defined]
    return bucketwise_compiled


def function_alignment(backend: GraphBackend) -> dict[str, Any]:
    ddp = backend.ddp
    if ddp is None:
        return {"alignment": None, "status": "no DDP module seen"}
    return measure_alignment(ddp, backend.param_segments)


def say_eager(report: Report, code: Any, frozen: str | None) -> None:
    """A call of a compiled object ran none of its compiled graphs: count it in the report and,
    the first time for a reason, log a warning (NOTE [never silently eager])."""
    # NOTE [never silently eager]: Dynamo runs a frame eagerly, without a word past one log line
    # of its own, when its recompile limit is hit, when a frame is skipped, when an error is
    # suppressed. Every graph bucketwise hands back counts its runs (graph_backend._Counted), so a
    # call that ran none is known here; the report's totals, table and note, the per-rank stats
    # (and so `bucketwise launch`/`stats`/`doctor`) and a warning say it, with the likely reason.
    limit = dc.recompile_limit()
    if frozen == "eager":
        reason = "frozen with on_recompile='eager' and a guard failed (a new input shape?)"
    elif code is not None and dc.cache_entries(code) >= limit:
        reason = (
            f"Dynamo's recompile limit ({limit} compiled versions of this frame) is reached; a call that "
            "needs another runs eagerly (TORCH_LOGS=recompiles names the guard; mark the changing dimension "
            "dynamic, or raise torch._dynamo.config.recompile_limit)"
        )
    else:
        reason = "Dynamo produced no graph for this call (the frame was skipped, or every op broke the graph)"
    if report.ran_eagerly(reason):
        log.warning("bucketwise: %s ran eagerly: %s", report.target, reason)
