"""``torch.compile(..., backend="bucketwise")``: bucketwise as a registered torch.compile backend.

The package registers :func:`bucketwise_backend` in the ``torch_dynamo_backends`` entry-point
group (``pyproject.toml``), so frameworks that call ``torch.compile`` themselves (Lightning
Fabric and Trainer, accelerate, HF Trainer through a compiled model) reach bucketwise by name,
without importing it first.

NOTE [registered backend takes over the DDP forward]: a backend only ever sees graphs, and for a
DDP module not even whole ones: with torch's default ``optimize_ddp=True`` Dynamo hands a graph
captured inside DDP's forward to torch's DDPOptimizer, which cuts it at torch's buckets, and a
named backend cannot scope ``optimize_ddp=False`` around its calls (``_TorchCompileWrapper``
does not carry a ``backend_ctx_ctor`` through; torch 2.11, 2.13). It does see the DDP module whose
forward runs (``_get_active_ddp_module()``). Where the compile wraps the DDP module
(``torch.compile(DDP(m))``: accelerate, Lightning Fabric), the first call builds what
``bucketwise.compile(ddp)`` builds and routes that one module's forward to it (an instance
attribute, ``_compat/ddp.route_forward``), so later calls run DDP's pre/post-forward eagerly around
bucketwise's frames, which DDPOptimizer never sees. Where DDP wraps the compiled module
(``DDP(torch.compile(m))``: HF Trainer), :class:`InsideDDP` keeps DDP's forward and reducer
(NOTE [compiled inside DDP]). Either way the first step is an eager DDP step (``_FirstCall``).
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
    """The :class:`CompileConfig` that ``torch.compile(backend="bucketwise", mode=, options=,
    dynamic=)`` asks for; a bad key raises naming it and the accepted ones."""
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
    """The ``"bucketwise"`` torch.compile backend (NOTE [registered backend takes over the DDP
    forward]). Outside any DDP forward the graph is compiled with the inner backend."""
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
    """A graph with no DDP forward around it: compiled whole, with the inner backend; recorded in
    the report of the module whose frame it is (:class:`WithoutDDP`), where there is one."""
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
    """``torch.compile(model, backend="bucketwise")`` where no DDP module runs the model: a
    framework on one process (HF Trainer, accelerate, Lightning with one device) does not wrap
    it. Each graph is compiled whole by the inner backend (strategy ``none``, as
    ``bucketwise.compile(model)`` without DDP) and ``bucketwise.report`` finds what was compiled
    through the framework's object, as it does on N processes. The report belongs to the module
    whose frame Dynamo compiled (the model; a graph break resumed in a submodule's method is
    recorded on that submodule)."""

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
    """The module whose method Dynamo is compiling, or None: its first argument, the first of
    its ``*args`` for a decorator's wrapper such as transformers' ``deprecate_kwarg``, or the
    module that a wrapper's closure calls (torch 2.13's ``OptimizedModule`` compiles
    ``inner(*args, **kwargs)`` around ``fn``, the module)."""
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
    """Is Dynamo compiling a frame of the module DDP calls itself (its forward, or a resumption
    of it), i.e. does the ``torch.compile`` wrap the DDP module? False for a module compiled
    before DDP wrapped it (``DDP(torch.compile(m))``: DDP calls the ``OptimizedModule``, the
    frame is ``m``'s) or deeper inside. True where torch does not say."""
    code, f_locals = dc.compiling_code(), dc.compiling_frame_locals()
    if f_locals is None:
        return True
    # A decorator around the module's forward (transformers 5.24 wraps LlamaForCausalLM.forward
    # in deprecate_kwarg's ``wrapped_func(*args, **kwargs)``) holds the module in its *args.
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
    # report() accepts the module the user compiled (Fabric re-applies the compile over its DDP
    # module, so the user's OptimizedModule wraps ddp.module) as well as the DDP module.
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
    """bucketwise for modules compiled before DDP wrapped them (``DDP(torch.compile(m))``: HF
    Trainer given a compiled model) or inside DDP's wrapped module (a LightningModule's network):
    DDP's own forward and reducer stay in charge, strategy ``split`` (``fused`` needs bucketwise
    to run the DDP forward: compile the DDP module).

    Running DDP's own forward keeps whatever a framework wrapped around the compiled module's
    ``forward`` (accelerate's autocast for mixed precision): bucketwise's own frame around the DDP
    module would trace past such a wrapper, which carries the ``_torchdynamo_inline`` attribute
    of the function it wraps.

    NOTE [compiled inside DDP]: such a graph reaches the backend with DDP's forward running, and
    so, with torch's default ``optimize_ddp=True``, split by torch's DDPOptimizer. From its
    second forward on, this DDP module's forward runs with ``optimize_ddp=False`` (a forward
    pre-hook enters the scope, a forward hook that runs even on an exception leaves it; nothing
    outside that forward sees the change) and every graph compiled in it goes, whole, to one
    :class:`GraphBackend` that finds the DDP module as the active one, cuts the graph at that
    module's buckets and leaves the reduction to its reducer. The first forward runs uncompiled,
    and its cache entries are dropped once it returns (``_FirstCall``).
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
        # Held by the compiled module (report() finds it there): a copy of that module (an EMA
        # copy, an evaluation copy) shares it rather than copying hooks and compiled graphs.
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
    """The frames compiled in the call that attached bucketwise to a DDP module: their Dynamo
    cache entries (torch's DDPOptimizer's pieces, run uncompiled) are dropped once that call has
    returned (at its end, or at the start of the next forward when the module had no hooks when
    the call began and so runs none at its end). Kept, they would run again: in the next
    forward of a module compiled inside DDP, and for any other instance of the class compiled
    with the same options (Dynamo shares a code object's entries among instances), whose DDP
    forward would then never reach the backend."""

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
