"""``torch.compile(..., backend="bucketwise")``: bucketwise as a registered torch.compile backend.

Registered as a ``torch_dynamo_backends`` entry point, so frameworks that call ``torch.compile``
themselves reach bucketwise by name.

NOTE [registered backend takes over the DDP forward]: with ``optimize_ddp=True`` Dynamo hands a
graph inside DDP's forward to DDPOptimizer, which cuts it at torch's buckets, and a named backend
cannot scope ``optimize_ddp=False`` (no ``backend_ctx_ctor``; torch 2.11, 2.13). It does see the
active DDP module. For ``torch.compile(DDP(m))`` the first call builds ``bucketwise.compile(ddp)``
and routes that module's forward to it (``_compat/ddp.route_forward``). For
``DDP(torch.compile(m))``, :class:`InsideDDP` keeps DDP's forward and reducer (NOTE [compiled
inside DDP]). Either way the first step runs eagerly (``_FirstCall``).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import warnings
from typing import Any, Callable, Sequence

import torch

from .._compat import ddp as ddpc
from .._compat import dynamo as dc
from .._compat.capabilities import capabilities
from ..distributed.split.alignment import AlignmentPoll
from ..stats.report import Report
from .config import CompileConfig
from .state import new_backend

log = logging.getLogger(__name__)

BACKEND_NAME = "bucketwise"

OWN_OPTIONS = (
    "strategy",
    "inner_backend",
    "cudagraphs",
    "bucket_cap_mb",
    "first_bucket_cap_mb",
    "gather_embedding_rows",
    "fallback",
    "freeze",
    "share_blocks",
)
"""Keys of ``torch.compile(options=...)`` that bucketwise reads (``inner_backend`` is
``bucketwise.compile``'s ``backend``); with ``inner_backend="inductor"`` (the default) every
other key must be an Inductor option and goes to Inductor."""


def config_from_options(mode: str | None, options: dict[str, Any] | None, dynamic: bool | None) -> CompileConfig:
    """The config ``torch.compile(backend="bucketwise", ...)`` asks for; bad keys raise."""
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"torch.compile(backend='bucketwise'): options must be a dict, got {type(options).__name__}")
    rest = dict(options or {})
    own = {k: rest.pop(k) for k in OWN_OPTIONS if k in rest}
    inner = own.pop("inner_backend", "inductor")
    if inner == BACKEND_NAME:
        raise ValueError(
            "torch.compile(backend='bucketwise'): inner_backend cannot be 'bucketwise'; use e.g. 'inductor'"
        )
    if rest:
        inductor = capabilities(inner).inductor
        known = set(dc.inductor_option_names()) if inductor else set()
        bad = sorted(k for k in rest if k not in known)
        if bad:
            others = (
                "and Inductor's options (torch._inductor.list_options())"
                if inductor
                else f"(inner_backend={inner!r} takes no other options)"
            )
            raise ValueError(
                f"torch.compile(backend='bucketwise'): unknown option(s) {bad}; accepted: {list(OWN_OPTIONS)} {others}"
            )
    return CompileConfig(backend=inner, mode=mode, options=rest or None, dynamic=dynamic, **own)


def bucketwise_backend(
    gm: Any, example_inputs: Sequence[Any], *, mode: str | None = None, options: dict[str, Any] | None = None
) -> Callable[..., Any]:
    """See NOTE [registered backend takes over the DDP forward]."""
    config = config_from_options(mode, options, dc.requested_dynamic())
    inside = _INSIDE.get()
    if inside is not None:
        return inside.backend(gm, example_inputs)
    ddp = dc.active_ddp_module()
    if ddp is None:
        return _without_ddp(config, gm, example_inputs)
    if _frame_of(ddp):
        owner = attach(ddp, config)
    else:
        owner = attach_inside(ddp, config)
        module = _frame_module()
        if module is not None:
            # report() accepts the module compiled inside DDP, and what torch.compile returned for it.
            ddpc.set_owner(module, owner)
    owner.first_call.compiled(dc.compiling_code())
    return gm.forward


NO_DDP_WARNING = (
    "bucketwise: no DistributedDataParallel forward is running around this graph (one process: the "
    "framework did not wrap the model in DDP); compiled whole with the inner backend, strategy none, no "
    "buckets. Compile the DDP-wrapped module, or a module that DDP wraps, to get bucketwise's strategies"
)


def _without_ddp(config: CompileConfig, gm: Any, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """No DDP forward around the graph: compiled whole by the inner backend."""
    warnings.warn(NO_DDP_WARNING, stacklevel=3)
    module = _frame_module()
    if module is None:
        return dc.make_backend(config.backend, config.mode, config.options, config.dynamic)(gm, example_inputs)
    owner = ddpc.owner_of(module)
    if not isinstance(owner, WithoutDDP):
        owner = WithoutDDP(module, config)
        ddpc.set_owner(module, owner)
    return owner.backend(gm, example_inputs)


class WithoutDDP:
    """The registered backend where no DDP module runs the model (frameworks on one process):
    graphs compiled whole (strategy ``none``), reported on the module whose frame was compiled."""

    def __init__(self, module: Any, config: CompileConfig) -> None:
        from .api import resolve_cudagraphs

        name = type(dc.uncompiled(module)).__name__
        self.config = config
        self.report = report = Report(target=f"{name} (no DDP)", strategy=config.strategy, backend=config.backend_name)
        self._backend = new_backend(
            config, report, None, cudagraphs=resolve_cudagraphs(config), alignment=False, module=dc.uncompiled(module)
        )
        report.note(
            "compiled through torch.compile(backend='bucketwise') with no DDP forward running: each graph "
            "compiled whole with the inner backend, no buckets"
        )

    def backend(self, gm: Any, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return self._backend(gm, example_inputs)

    def __deepcopy__(self, memo: dict) -> "WithoutDDP":
        # Held by the compiled module: a copy of that module shares it (as InsideDDP).
        return self


def _frame_module() -> Any | None:
    """The module whose method Dynamo is compiling: the first argument, the first ``*args``
    (decorator wrappers), or a closure variable (torch 2.13's ``OptimizedModule`` wrapper)."""
    code, f_locals = dc.compiling_code(), dc.compiling_frame_locals()
    if code is None or f_locals is None:
        return None
    if code.co_argcount:
        candidates = [f_locals.get(code.co_varnames[0])]
    else:
        candidates = [next(iter(_varargs(code, f_locals)), None)]
    candidates += [f_locals.get(name) for name in code.co_freevars]
    for value in candidates:
        value = getattr(value, "__self__", value)  # a bound method: its module
        if isinstance(value, torch.nn.Module):
            return value
    return None


def _varargs(code: Any, f_locals: dict[str, Any]) -> tuple:
    """The frame's ``*args`` tuple (empty without one)."""
    if not code.co_flags & inspect.CO_VARARGS:
        return ()
    value = f_locals.get(code.co_varnames[code.co_argcount + code.co_kwonlyargcount])
    return value if isinstance(value, tuple) else ()


def _frame_of(ddp: Any) -> bool:
    """Whether the compiled frame is the DDP module's own forward (``torch.compile(DDP(m))``),
    not a module compiled before DDP wrapped it or deeper inside. True where torch does not say."""
    code, f_locals = dc.compiling_code(), dc.compiling_frame_locals()
    if f_locals is None:
        return True
    # A decorator around forward (e.g. transformers' deprecate_kwarg) holds the module in *args.
    candidates = [*f_locals.values(), *(_varargs(code, f_locals) if code is not None else ())]
    return any(value is ddp.module for value in candidates)


def attach(ddp: Any, config: CompileConfig) -> Any:
    """The compiled state that runs ``ddp``'s forward from now on (built at the first call)."""
    from .api import compile_with_config
    from .module import state_of

    owner = _existing(ddp, config)
    if owner is not None:
        return owner
    first_call = _FirstCall(ddp)
    try:
        compiled = compile_with_config(ddp, config, first_call=first_call)
    except BaseException:
        first_call.close()  # nothing of the attach stays on the DDP module
        raise
    state = state_of(compiled)
    state.report.note(
        "compiled through torch.compile(backend='bucketwise'): the first call ran uncompiled (torch's DDPOptimizer "
        "had split its graph before bucketwise saw it); bucketwise runs this DDP module's forward from the second "
        "call on (NOTE [registered backend takes over the DDP forward])"
    )
    ddpc.route_forward(ddp, compiled)
    # report() also accepts the user's module (Fabric's OptimizedModule wraps ddp.module).
    ddpc.set_owner(ddp.module, state)
    log.info(
        "bucketwise: %s compiled by torch.compile(backend='bucketwise') (strategy %s, inner backend %s)",
        state.report.target,
        config.strategy,
        config.backend_name,
    )
    return state


def attach_inside(ddp: Any, config: CompileConfig) -> "InsideDDP":
    """The :class:`InsideDDP` compiling the graphs of modules inside ``ddp``'s wrapped module."""
    owner = _existing(ddp, config)
    if owner is not None:
        return owner
    owner = InsideDDP(ddp, config)
    ddpc.set_owner(ddp, owner)
    return owner


def _existing(ddp: Any, config: CompileConfig) -> Any | None:
    owner = ddpc.owner_of(ddp)
    if owner is not None and owner.config != config:
        log.warning(
            "bucketwise: %s is already compiled with other options; keeping the first ones", owner.report.target
        )
    return owner


# The InsideDDP whose DDP module's forward is running (its graphs go to that object's backend).
_INSIDE: contextvars.ContextVar["InsideDDP | None"] = contextvars.ContextVar("bucketwise_inside_ddp", default=None)


class InsideDDP:
    """bucketwise for modules compiled inside DDP's wrapped module (``DDP(torch.compile(m))``):
    DDP's forward (and any framework wrapper such as autocast) and reducer stay in charge,
    strategy ``split``.

    NOTE [compiled inside DDP]: such graphs would be split by DDPOptimizer. From the second
    forward on, the DDP module's forward runs with ``optimize_ddp=False`` (scoped by a forward
    pre-hook and an always-called forward hook), and its graphs go whole to one
    :class:`GraphBackend`, which cuts them at the module's buckets for its reducer. The first
    forward runs uncompiled; its cache entries are then dropped (``_FirstCall``).
    """

    def __init__(self, ddp: Any, config: CompileConfig) -> None:
        from .api import resolve_cudagraphs

        name = type(dc.uncompiled(ddp.module)).__name__
        self.config = config
        self.report = Report(
            target=f"modules inside DDP({name})", strategy=config.strategy, backend=config.backend_name
        )
        self._backend = new_backend(config, self.report, None, cudagraphs=resolve_cudagraphs(config))
        self.report.note(
            "compiled inside the forward of a DDP module through torch.compile(backend='bucketwise'): DDP's "
            "reducer reduces (split); the first call ran uncompiled (NOTE [compiled inside DDP])"
        )
        if config.freeze_mode is not None:
            self.report.note(
                "freeze= not applied: DDP's own forward runs here (compile the DDP module to freeze after warm-up)"
            )
            log.warning("bucketwise: freeze=%r not applied to modules compiled inside DDP", config.freeze)
        self.first_call = _FirstCall(ddp)
        self._ddp = ddp
        self._alignment = AlignmentPoll(self.report, ddp)
        self._scopes: list[contextlib.ExitStack] = []
        ddp.register_forward_pre_hook(self._enter)
        ddp.register_forward_hook(self._leave, always_call=True)

    def backend(self, gm: Any, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return self._backend(gm, example_inputs)

    def __deepcopy__(self, memo: dict) -> "InsideDDP":
        # A copy of the compiled module (EMA, evaluation) shares it.
        return self

    def _enter(self, module: Any, args: Any) -> None:
        scope = contextlib.ExitStack()
        scope.enter_context(dc.torch_ddp_optimizer_disabled())
        token = _INSIDE.set(self)
        scope.callback(_INSIDE.reset, token)
        self._scopes.append(scope)

    def _leave(self, module: Any, args: Any, output: Any) -> None:
        if self._scopes:  # none when the hook was added during this forward
            self._scopes.pop().close()
        self.report.after_call()
        self._alignment.after_forward()


class _FirstCall:
    """The frames compiled in the attaching call (DDPOptimizer's pieces): their cache entries
    are dropped once it returns, or they would run again, for this and other instances (Dynamo
    shares entries per code object), and the backend would never see the DDP forward."""

    def __init__(self, ddp: Any) -> None:
        self.codes: list[Any] = []
        self.done = False
        self.handles = [
            ddp.register_forward_pre_hook(self._forget),
            ddp.register_forward_hook(self._forget, always_call=True),
        ]

    def compiled(self, code: Any) -> None:
        if code is not None and not self.done and code not in self.codes:
            self.codes.append(code)

    def close(self) -> None:
        """Remove the hooks; forget the frames compiled so far."""
        self._forget()

    def _forget(self, *_: Any) -> None:
        self.done = True
        for handle in self.handles:
            handle.remove()
        for code in self.codes:
            dc.forget_compiled(code)
