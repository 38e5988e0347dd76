"""``torch.compile(..., backend="bucketwise")``: bucketwise as a registered torch.compile backend.

The package registers :func:`bucketwise_backend` in the ``torch_dynamo_backends`` entry-point
group (``pyproject.toml``), so frameworks that call ``torch.compile`` themselves (Lightning
Fabric and Trainer, accelerate, HF Trainer through a compiled model) reach bucketwise by name,
without importing it first.

NOTE [registered backend takes over the DDP forward]: a backend only ever sees graphs, and for a
DDP module it does not even see whole ones: with torch's default ``optimize_ddp=True``, Dynamo
hands a graph captured inside DDP's forward to torch's own DDPOptimizer, which cuts it at
torch's bucket boundaries and calls the backend once per piece. Nor can a backend scope
``optimize_ddp=False`` around the calls of the compiled object: ``torch.compile`` wraps a named
backend in ``_TorchCompileWrapper``, which does not carry a ``backend_ctx_ctor`` through (torch
2.11, 2.13). What the backend does see is the DDP module whose forward is running
(``DistributedDataParallel._get_active_ddp_module()``), whichever way the framework nested
``torch.compile`` and ``DDP``: Dynamo never traces DDP's own forward, it runs it eagerly and
compiles the inner module's frame. So at its first call for a DDP module the backend builds
what ``bucketwise.compile(ddp)`` builds (a ``CompiledModule`` with its own frame, Dynamo cache,
report, strategy ``auto``, rank checks, CUDA graphs on request) and routes that DDP module's
forward to it (``_ddp_compat.route_forward``: an instance attribute of that one module, the
class and torch untouched). The pieces of that first call run as they are (uncompiled graph
modules, DDP's reducer reducing), so the first step is an eager DDP step; from the second call
on, DDP's pre/post-forward run eagerly around bucketwise's compiled inner module, exactly as
under ``bucketwise.compile``, and torch's DDPOptimizer never sees those frames (no active DDP
module during them). ``bucketwise.report`` accepts the framework's object
(``OptimizedModule``, the DDP module) and finds the compiled module through the DDP module.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Sequence

from ..distributed import _ddp_compat
from . import _dynamo_compat as dc
from .config import CompileConfig

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
        raise ValueError("torch.compile(backend='bucketwise'): inner_backend cannot be 'bucketwise'; use e.g. 'inductor'")
    if rest:
        known = set(dc.inductor_option_names()) if inner == "inductor" else set()
        bad = sorted(k for k in rest if k not in known)
        if bad:
            others = ("and Inductor's options (torch._inductor.list_options())" if inner == "inductor"
                      else f"(inner_backend={inner!r} takes no other options)")
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
    ddp = dc.active_ddp_module()
    if ddp is None:
        warnings.warn(
            "bucketwise: no DistributedDataParallel forward is running around this graph; compiled with "
            "the inner backend alone (no buckets, no report). Compile the DDP-wrapped module, or a module "
            "that DDP wraps, to get bucketwise's strategies",
            stacklevel=2,
        )
        return dc.make_backend(config.backend, config.mode, config.options, config.dynamic)(gm, example_inputs)
    if not _frame_of(ddp):
        # NOTE [registered backend takes over the DDP forward]: only the module DDP wraps is
        # taken over; a module deeper inside (compiled on its own) keeps torch's DDPOptimizer.
        warnings.warn(
            f"bucketwise: a module inside {type(dc.uncompiled(ddp.module)).__name__} (which DDP wraps) was compiled; "
            "bucketwise's strategies apply to the DDP module or the module DDP wraps, so this graph is compiled by "
            "torch's DDPOptimizer with the inner backend. Compile the module DDP wraps instead",
            stacklevel=2,
        )
        return dc.make_backend(config.backend, config.mode, config.options, config.dynamic)(gm, example_inputs)
    attach(ddp, config).__dict__["_bucketwise_first_call"].compiled(dc.compiling_code())
    return gm.forward


def _frame_of(ddp: Any) -> bool:
    """Is Dynamo compiling a frame of the module DDP wraps (its forward, or a resumption of it),
    rather than of a module inside it? True where torch does not say."""
    f_locals = dc.compiling_frame_locals()
    if f_locals is None:
        return True
    inner = dc.uncompiled(ddp.module)
    return any(value is inner for value in f_locals.values())


def attach(ddp: Any, config: CompileConfig) -> Any:
    """The ``CompiledModule`` that runs ``ddp``'s forward from now on (built at the first call)."""
    from .api import compile_with_config

    compiled = _ddp_compat.routed_to(ddp)
    if compiled is not None:
        if compiled._bucketwise_backend.config != config:
            log.warning("bucketwise: %s is already compiled with other options; keeping the first ones",
                        compiled._bucketwise_report.target)
        return compiled
    compiled = compile_with_config(ddp, config)
    compiled._bucketwise_report.note(
        "compiled through torch.compile(backend='bucketwise'): the first call ran uncompiled (torch's DDPOptimizer "
        "had split its graph before bucketwise saw it); bucketwise runs this DDP module's forward from the second "
        "call on (NOTE [registered backend takes over the DDP forward])"
    )
    compiled.__dict__["_bucketwise_first_call"] = _FirstCall(ddp)
    _ddp_compat.route_forward(ddp, compiled)
    if dc.uncompiled(ddp.module) is not ddp.module:
        # DDP(torch.compile(m, backend="bucketwise")): report() also accepts what torch.compile returned.
        ddp.module.__dict__["_bucketwise_compiled"] = compiled
    log.info("bucketwise: %s compiled by torch.compile(backend='bucketwise') (strategy %s, inner backend %s)",
             compiled._bucketwise_report.target, config.strategy, config.backend_name)
    return compiled


class _FirstCall:
    """The frames compiled in the call that attached bucketwise to a DDP module: their Dynamo
    cache entries (torch's DDPOptimizer's pieces, run uncompiled) are dropped once that call has
    returned. Dynamo shares a code object's entries among instances of a class, and a
    ``torch.compile`` of another instance with the same options would reuse them: that module's
    DDP forward would then never reach the backend and stay uncompiled."""

    def __init__(self, ddp: Any) -> None:
        self.codes: list[Any] = []
        self.done = False
        self.handle = ddp.register_forward_hook(self, always_call=True)

    def compiled(self, code: Any) -> None:
        if code is not None and not self.done and code not in self.codes:
            self.codes.append(code)

    def __call__(self, module: Any, args: Any, output: Any) -> None:
        self.done = True
        self.handle.remove()
        for code in self.codes:
            dc.forget_compiled(code)
