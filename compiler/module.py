"""What :func:`bucketwise.compile` returns: compiled modules and functions."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from typing import Any, Callable

import torch
import torch.nn as nn

from ..distributed import _ddp_compat
from ..distributed.alignment import measure_alignment
from ..distributed.fused_runtime import FusedRuntime
from ..distributed.rank_check import prepare_rank_checks
from . import _dynamo_compat as dc
from .config import CompileConfig
from .freeze import freeze_after_warmup, stance
from .graph_backend import GraphBackend
from .report import Report

log = logging.getLogger(__name__)

_ALIGNMENT_POLLS = 20


def _inner_forward(module: nn.Module) -> Callable[..., Any]:
    """The frame Dynamo compiles for a module.

    NOTE [compiling torch.nn containers]: Dynamo skips frames whose code lives in ``torch.nn``
    (``nn.Sequential.forward``, ...), so ``torch.compile(DDP(nn.Sequential(...)))`` compiles
    nothing. This closure is bucketwise code, so Dynamo converts it and inlines the module's
    ``__call__``/``forward`` into one graph whatever class the module is.
    """

    def bucketwise_forward(*args: Any, **kwargs: Any) -> Any:
        return module(*args, **kwargs)

    return bucketwise_forward


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

    def __init__(self, mod: nn.Module, config: CompileConfig) -> None:
        super().__init__()
        self._orig_mod = mod
        ddp = mod if _ddp_compat.is_ddp(mod) else None
        inner = mod.module if ddp is not None else mod
        report = Report(target=type(inner).__name__ if ddp is None else f"DDP({type(inner).__name__})",
                        strategy=config.strategy, backend=config.backend_name)
        runtime = FusedRuntime(ddp) if ddp is not None and config.strategy in ("fused", "auto") else None
        backend = GraphBackend(config, report, ddp, fused_runtime=runtime)
        forward = _inner_forward(inner)
        # Plain attributes, not submodules: keep them out of parameters()/state_dict().
        self.__dict__["_bucketwise_report"] = report
        self.__dict__["_bucketwise_ddp"] = ddp
        self.__dict__["_bucketwise_runtime"] = runtime
        self.__dict__["_bucketwise_backend"] = backend
        self.__dict__["_bucketwise_freeze"] = config.freeze_mode
        self.__dict__["_nosync_warm"] = False
        self.__dict__["_fused_checked"] = runtime is None
        self.__dict__["_bucketwise_call"] = _torch_compile(forward, backend, config)
        self.__dict__["_alignment_pending"] = ddp is not None and runtime is None
        if runtime is not None:
            # no_sync() steps and evaluation run a second compiled variant without collectives;
            # Dynamo keeps one cache entry per backend, so switching costs no recompile.
            nosync = GraphBackend(dataclasses.replace(config, strategy="none"), report, ddp, variant="no_sync")
            self.__dict__["_bucketwise_call_nosync"] = _torch_compile(forward, nosync, config)
            prepare_rank_checks(_ddp_compat.process_group(ddp))
            report.set_alignment_source(
                lambda: {"alignment": None, "status": "fused: DDP's reducer is idle, the compiled backward reduces"}
            )
        elif ddp is not None:
            report.set_alignment_source(lambda: measure_alignment(ddp, backend.param_segments))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self._forward(*args, **kwargs)
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
            sync = _ddp_compat.grad_sync_requested(ddp) and torch.is_grad_enabled()
            runtime.before_forward(sync)
            call = self._bucketwise_call if sync else self._bucketwise_call_nosync
            # The no_sync() variant is bucketwise's own second cache entry: its first call is
            # part of the warm-up even when it comes after freezing.
            warm = sync or self._nosync_warm
            with stance(self) if warm else contextlib.nullcontext():
                out = _ddp_compat.run_forward_with_idle_reducer(ddp, args, kwargs, call)
            if not sync:
                self.__dict__["_nosync_warm"] = True
            runtime.after_forward(out, sync)
            return out
        args, kwargs = _ddp_compat.pre_forward(ddp, args, kwargs)
        if self._alignment_pending and _ddp_compat.has_rebuilt_buckets(ddp):
            self._refresh_alignment()
        with stance(self):
            out = self._bucketwise_call(*args, **kwargs)
        return _ddp_compat.post_forward(ddp, out)

    def _confirm_fused(self, ddp: Any, runtime: FusedRuntime) -> FusedRuntime | None:
        """At the first forward (comm hooks are registered after construction): keep DDP's
        reducer in charge when the fused strategy cannot reproduce what it would do."""
        self.__dict__["_fused_checked"] = True
        kind, _ = _ddp_compat.comm_hook_kind(ddp)
        if kind != "unsupported" and not _ddp_compat.uses_python_reducer(ddp):
            return runtime
        runtime.remove_hooks()
        self.__dict__["_bucketwise_runtime"] = None
        self.__dict__["_alignment_pending"] = True
        backend = self._bucketwise_backend
        backend.fused_runtime = None
        self._bucketwise_report.set_alignment_source(lambda: measure_alignment(ddp, backend.param_segments))
        return None

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


def compile_function(fn: Callable[..., Any], config: CompileConfig) -> Callable[..., Any]:
    """A compiled function. DDP modules it calls get the split strategy (torch's own
    DDPOptimizer is switched off around each call, see ``torch_ddp_optimizer_disabled``)."""
    report = Report(target=getattr(fn, "__qualname__", type(fn).__name__), strategy=config.strategy,
                    backend=config.backend_name)
    backend = GraphBackend(config, report, None)
    report.set_alignment_source(lambda: _function_alignment(backend))
    compiled = _torch_compile(fn, backend, config)

    @functools.wraps(fn)
    def bucketwise_compiled(*args: Any, **kwargs: Any) -> Any:
        with dc.torch_ddp_optimizer_disabled(), stance(bucketwise_compiled):
            out = compiled(*args, **kwargs)
        freeze_after_warmup(bucketwise_compiled, config.freeze_mode)
        report.after_call()
        return out

    bucketwise_compiled._bucketwise_report = report  # type: ignore[attr-defined]
    return bucketwise_compiled


def _function_alignment(backend: GraphBackend) -> dict[str, Any]:
    ddp = backend.ddp
    if ddp is None:
        return {"alignment": None, "status": "no DDP module seen"}
    return measure_alignment(ddp, backend.param_segments)
