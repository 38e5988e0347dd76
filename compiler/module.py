"""What :func:`bucketwise.compile` returns: compiled modules and functions."""

from __future__ import annotations

import copy
import functools
import types
import weakref
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from .._compat import ddp as ddpc
from .._compat import dynamo as dc
from ..cudagraphs.policy import Decision as CudaGraphDecision
from ..distributed import gloo_exit, teardown
from ..distributed.rank_check import prepare_rank_checks
from ..stats.report import Report
from .artifacts import artifacts_for
from .blocks.calls import BlockCalls
from .config import CompileConfig
from .ddp_forward import DDPForward
from .decision import Variant
from .graph_backend import GraphBackend
from .hook_watch import HookWatch
from .state import CompiledState, new_backend, torch_compile


def _inner_forward(module: nn.Module) -> Callable[..., Any]:
    """The frame Dynamo compiles for a module, with a code object of its own.

    NOTE [compiling torch.nn containers]: Dynamo skips frames whose code lives in ``torch.nn``
    (``nn.Sequential.forward``); this closure is our code, so Dynamo inlines any module into it.

    NOTE [one cache per compiled object]: Dynamo caches entries, up to ``recompile_limit``, per
    code object; a shared closure code would make the 9th compiled model run eagerly. So each
    compiled object gets its own copy of the code object.
    """

    def bucketwise_forward(*args: Any, **kwargs: Any) -> Any:
        return module(*args, **kwargs)

    fn = bucketwise_forward
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class CompiledModule(nn.Module):
    """What :func:`bucketwise.compile` returns for a module: that module, with a compiled forward.

    NOTE [the compiled module is the module]: the compiled object shares the module's very
    ``__dict__``, so names, ``state_dict`` keys and anything walking attributes (DCP, ``torch.func``,
    framework unwrapping) see the module; only calls differ. Our state lives in the ``_bucketwise``
    slot. For DDP it is a :class:`CompiledDDP`, itself a ``DistributedDataParallel`` with
    ``nn.Module.__call__``, so DDP-module hooks run around the compiled forward. Copying or
    pickling copies the module and compiles the copy with the same options.
    """

    __slots__ = ("_bucketwise",)
    _bucketwise: CompiledState

    def __init__(self, module: nn.Module, state: CompiledState) -> None:
        # nn.Module.__init__ is not called: the module's own state is adopted, not made anew.
        object.__setattr__(self, "__dict__", module.__dict__)
        object.__setattr__(self, "_bucketwise", state)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return CompiledModule.forward(self, *args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state = self._bucketwise
        return state.run(self, lambda: _call_frame(state, args, kwargs), training=torch.is_grad_enabled())

    @property
    def _bucketwise_report(self) -> Report:
        return self._bucketwise.report

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = object.__getattribute__(self, "_bucketwise").module
            return getattr(module, name)

    # The module's own class may define these: answer as the module does.
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._bucketwise.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self._bucketwise.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._bucketwise.module.named_parameters(
            prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate
        )

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._bucketwise.module.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def __deepcopy__(self, memo: dict) -> Any:
        state = self._bucketwise
        return compile_module(copy.deepcopy(state.module, memo), state.config, cudagraphs=state.cudagraphs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        state = self._bucketwise
        return (_compiled, (state.module, state.config, state.cudagraphs))


class CompiledDDP(CompiledModule, DistributedDataParallel):
    """See NOTE [the compiled module is the module]."""

    __call__ = nn.Module.__call__

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state = self._bucketwise
        ddp = state.ddp.ddp
        training = torch.is_grad_enabled() and ddpc.grad_sync_requested(ddp)
        return state.run(self, lambda: state.ddp.forward(args, kwargs, stance=state.stance), training=training)


def _call_frame(state: CompiledState, args: tuple, kwargs: dict) -> Any:
    with state.stance():
        return state.call(*args, **kwargs)


def _compiled(module: nn.Module, config: CompileConfig, cudagraphs: CudaGraphDecision) -> CompiledModule:
    return compile_module(module, config, cudagraphs=cudagraphs)


def compile_module(
    module: nn.Module, config: CompileConfig, *, cudagraphs: CudaGraphDecision, first_call: Any = None
) -> CompiledModule:
    """``first_call``: see ``CompiledState.first_call``."""
    if isinstance(module, CompiledModule):
        raise ValueError(
            "obj: this module is already compiled by bucketwise; compile the module itself once, or keep the "
            "object bucketwise.compile returned"
        )
    ddp = module if ddpc.is_ddp(module) else None
    inner = ddp.module if ddp is not None else module
    report = Report(
        target=type(inner).__name__ if ddp is None else f"DDP({type(inner).__name__})",
        strategy=config.strategy,
        backend=config.backend_name,
    )
    run: DDPForward | None = None
    backend = new_backend(
        config,
        report,
        ddp,
        cudagraphs=cudagraphs,
        alignment=ddp is not None,
        # A compiled DDP module's graphs compile under its decision, made at its first call.
        decisions=(lambda: run.current()) if ddp is not None else None,
        module=inner if ddp is None else None,
        blocks_of=inner,
    )
    forward = _inner_forward(inner)
    compiled_forward = torch_compile(forward, backend, config)
    call = _calling_blocks(backend.block_calls, compiled_forward)
    run = None if ddp is None else _ddp_forward(ddp, forward, compiled_forward, backend, report, config, cudagraphs)
    state = CompiledState(
        config=config,
        report=report,
        backend=backend,
        call=call,
        code=forward.__code__,
        module=module,
        cudagraphs=cudagraphs,
        ddp=run,
        first_call=first_call,
        artifacts=artifacts_for(config.artifacts),
    )
    state.load_artifacts()
    compiled = CompiledModule(module, state) if run is None else CompiledDDP(module, state)
    # report(module) finds the compile through the module (and so through the compiled object).
    ddpc.set_owner(module, state)
    weakref.finalize(compiled, _forget, state.code, [backend, run.nosync_backend if run is not None else None])
    return compiled


def _calling_blocks(blocks: BlockCalls | None, compiled: Callable[..., Any]) -> Callable[..., Any]:
    return compiled if blocks is None else blocks.wrap(compiled)


def _ddp_forward(
    ddp: Any,
    forward: Callable[..., Any],
    call: Callable[..., Any],
    backend: GraphBackend,
    report: Report,
    config: CompileConfig,
    cudagraphs: CudaGraphDecision,
) -> DDPForward:
    blocks = backend.block_calls
    # no_sync() steps and evaluation use a second backend (its own cache entry): no recompile.
    nosync = new_backend(
        config, report, ddp, cudagraphs=cudagraphs, variant=Variant.NO_SYNC, alignment=False, block_calls=blocks
    )
    run = DDPForward(
        ddp=ddp,
        config=config,
        report=report,
        backend=backend,
        code=forward.__code__,
        call=call,
        nosync_backend=nosync,
        call_nosync=torch_compile(forward, nosync, config),
        blocks=blocks,
        hooks=HookWatch(ddp.module.named_modules, lambda: ddpc.reducer_parameters(ddp), lambda: run.own_hook_ids()),
        buffers=ddpc.BufferBroadcast(ddp),
    )
    if config.strategy in ("fused", "auto"):
        # Groups created on every rank now (NOTE [cuda graphs at teardown]).
        prepare_rank_checks(ddpc.process_group(ddp))
        if backend.cudagraphs is not None:
            teardown.guard(ddpc.process_group(ddp))
    gloo_exit.settle_at_exit(ddpc.process_group(ddp))
    return run


def _forget(code: types.CodeType, backends: list[Any]) -> None:
    """The compiled object is gone: forget the frames it compiled (NOTE [a compiled object lets go])."""
    codes = {code}
    for backend in backends:
        if backend is not None:
            codes.update(backend.compiled_codes())
    for c in codes:
        dc.forget_compiled(c)


def compile_function(
    fn: Callable[..., Any], config: CompileConfig, *, cudagraphs: CudaGraphDecision
) -> Callable[..., Any]:
    """A compiled function; DDP modules it calls get ``split`` (DDPOptimizer switched off)."""
    report = Report(
        target=getattr(fn, "__qualname__", type(fn).__name__), strategy=config.strategy, backend=config.backend_name
    )
    backend = new_backend(config, report, None, cudagraphs=cudagraphs)
    state = CompiledState(
        config=config,
        report=report,
        backend=backend,
        call=torch_compile(fn, backend, config),
        code=getattr(fn, "__code__", None),
        module=None,
        cudagraphs=cudagraphs,
        artifacts=artifacts_for(config.artifacts),
    )
    state.load_artifacts()

    @functools.wraps(fn)
    def bucketwise_compiled(*args: Any, **kwargs: Any) -> Any:
        def call() -> Any:
            with dc.torch_ddp_optimizer_disabled():
                return _call_frame(state, args, kwargs)

        return state.run(bucketwise_compiled, call, training=torch.is_grad_enabled())

    bucketwise_compiled._bucketwise = state  # type: ignore[attr-defined]
    bucketwise_compiled._bucketwise_report = report  # type: ignore[attr-defined]
    return bucketwise_compiled


def state_of(compiled: Any) -> CompiledState | None:
    """The :class:`CompiledState` of an object :func:`bucketwise.compile` returned, else ``None``."""
    if isinstance(compiled, CompiledModule):
        return compiled._bucketwise
    state = getattr(compiled, "__dict__", {}).get("_bucketwise")
    return state if isinstance(state, CompiledState) else None
