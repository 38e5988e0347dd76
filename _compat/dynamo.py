"""Every private torch.compile API bucketwise touches (Dynamo, AOTAutograd, Inductor).

Checked on torch 2.11.0 and 2.13.0. Each helper degrades to a documented default where an
attribute is missing rather than failing a user's compile."""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable

import torch
import torch._dynamo
import torch._guards
import torch._inductor.config
from torch._dynamo.utils import counters as _dynamo_counters

from .capabilities import capabilities

# --- backends ---------------------------------------------------------------------------


def make_backend(
    backend: str | Callable[..., Any], mode: str | None, options: dict | None, dynamic: bool | None
) -> Callable[..., Any]:
    """What torch.compile itself would build, so a segment compiles as a plain graph would."""
    if capabilities(backend).inductor:
        return torch._TorchCompileInductorWrapper(mode, options, dynamic)
    return torch._TorchCompileWrapper(backend, mode, options, dynamic)


def inductor_config_patches(mode: str | None, options: dict | None, dynamic: bool | None) -> dict[str, Any]:
    """The Inductor config patches ``torch.compile(mode=, options=)`` applies inside its compiles
    (``_TorchCompileInductorWrapper.config``)."""
    return dict(torch._TorchCompileInductorWrapper(mode, options, dynamic).config)


def cacheable_calls_options(targets: dict[str, str], options: dict | None) -> dict[str, Any]:
    """``options`` plus ``unsafe_marked_cacheable_functions`` declaring ``targets`` safe for
    AOTAutograd's cache, which otherwise bypasses graphs calling unknown functions. Checked on
    torch 2.13 (present since 2.9, so on 2.11 too); where missing, nothing is declared."""
    key = "unsafe_marked_cacheable_functions"
    if key not in torch._inductor.config.get_config_copy():
        return dict(options or {})
    return {**(options or {}), key: {**(options or {}).get(key, {}), **targets}}


def inductor_option_names() -> list[str]:
    """Every key ``torch.compile(options=...)`` accepts for Inductor."""
    import torch._inductor

    return list(torch._inductor.list_options())


def requested_dynamic() -> bool | None:
    """Inside a backend call: ``torch.compile``'s ``dynamic=``, from the config it patches."""
    config = torch._dynamo.config
    if not getattr(config, "assume_static_by_default", True):
        return True
    if not getattr(config, "automatic_dynamic_shapes", True):
        return False
    return None


def compiling_code() -> Any | None:
    """Inside a backend call: the code object of the frame Dynamo is compiling, or ``None``."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return getattr(InstructionTranslator.current_tx(), "f_code", None)
    except (ImportError, AttributeError):
        return None


def forget_compiled(code: Any) -> None:
    """Drop every compiled entry Dynamo keeps for ``code``: its next call compiles afresh."""
    from torch._dynamo.eval_frame import reset_code

    reset_code(code)


def compiling_frame_locals() -> dict[str, Any] | None:
    """Inside a backend call: the compiled frame's locals, or ``None`` where this torch does not say."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except (ImportError, AttributeError):
        return None
    f_locals = getattr(tx, "f_locals", None)
    return dict(f_locals) if isinstance(f_locals, dict) else None


def uncompiled(module: Any) -> Any:
    """The module ``torch.compile`` wrapped, for an ``OptimizedModule``; else ``module``."""
    from torch._dynamo.eval_frame import OptimizedModule

    return module._orig_mod if isinstance(module, OptimizedModule) else module


def is_dynamo_control_flow(exc: BaseException) -> bool:
    """Dynamo restarting or skipping the frame through a backend: never a failure, re-raised."""
    from torch._dynamo import exc as dynamo_exc

    kinds = tuple(getattr(dynamo_exc, n) for n in ("RestartAnalysis", "SkipFrame") if hasattr(dynamo_exc, n))
    return isinstance(exc, kinds)


def functorch_depth() -> int:
    """How many torch.func transform levels are active (0 outside any transform)."""
    stack = torch._C._functorch.get_interpreter_stack()
    return len(stack) if stack else 0


def is_higher_order_op(target: Any) -> bool:
    """A higher-order op in a Dynamo graph (checkpoint, torch.func transforms, ...)."""
    return isinstance(target, torch._ops.HigherOrderOperator)


# --- compile ids, counters, timings -----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CompileId:
    frame_id: int | None
    frame_compile_id: int | None

    def __str__(self) -> str:
        return f"{self.frame_id}/{self.frame_compile_id}"


def current_compile_id() -> CompileId:
    cid = torch._guards.CompileContext.current_compile_id()
    if cid is None:
        return CompileId(None, None)
    return CompileId(getattr(cid, "frame_id", None), getattr(cid, "frame_compile_id", None))


def graph_break_reason(gm: Any) -> str | None:
    """The graph break that ended this graph, with its source line (as ``explain`` reports it)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    text = " ".join(str(getattr(reason, "reason", "")).split())
    stack = getattr(reason, "user_stack", None) or []
    if stack:
        frame = stack[-1]
        text += f" (at {frame.filename}:{frame.lineno})"
    return text


@dataclasses.dataclass
class BreakCount:
    """The graph breaks Dynamo counts (``counters["graph_break"]``: process-wide, by message, one
    per break met while tracing a frame, a break that ended no graph included), read around
    calls: :meth:`start` before, :meth:`new` after (checked on torch 2.13.0 and 2.15.0)."""

    total: int = -1
    seen: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def start(self) -> None:
        counted = _dynamo_counters["graph_break"]
        total = counted.total()
        if total != self.total:  # counted elsewhere since: not this caller's
            self.total, self.seen = total, collections.Counter(counted)

    def new(self) -> collections.Counter:
        """The breaks counted since :meth:`start`, by message (empty, nearly always)."""
        counted = _dynamo_counters["graph_break"]
        total = counted.total()
        if total == self.total:
            return collections.Counter()
        new = counted - self.seen
        self.total, self.seen = total, collections.Counter(counted)
        return new


def recompile_reason() -> str | None:
    """Why Dynamo is recompiling the frame being compiled now: the first guard that failed
    (what ``TORCH_LOGS=recompiles`` prints), read from Dynamo's per-compile metrics."""
    try:
        metrics = torch._dynamo.utils.get_metrics_context()._metrics
    except AttributeError:
        return None
    reason = metrics.get("recompile_reason")
    return " ".join(str(reason).split()) if reason else None


def cache_entries(code: Any) -> int:
    """How many compiled entries Dynamo keeps for a code object (one per guard set)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    try:
        return len(_debug_get_cache_entry_list(code))
    except (AttributeError, RuntimeError, TypeError):
        return 0


def recompile_limit() -> int:
    """Dynamo's per-code-object limit (``recompile_limit``; ``cache_size_limit`` before 2.6)."""
    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", 8))


def aot_autograd_count() -> int:
    return int(_dynamo_counters["aot_autograd"]["total"])


def compile_phase_seconds() -> dict[str, float]:
    """Cumulative seconds per compile phase (torch's function names); diff two snapshots."""
    metrics = getattr(torch._dynamo.utils, "compilation_time_metrics", {})
    return {k: float(sum(v)) for k, v in metrics.items()}


# Torch's counters of the compile caches (``torch._dynamo.utils.counters``), by our name.
_COUNTER_NAMES = {
    "fx_hit": ("inductor", "fxgraph_cache_hit"),
    "fx_miss": ("inductor", "fxgraph_cache_miss"),
    "fx_bypass": ("inductor", "fxgraph_cache_bypass"),
    "aot_hit": ("aot_autograd", "autograd_cache_hit"),
    "aot_miss": ("aot_autograd", "autograd_cache_miss"),
    "aot_bypass": ("aot_autograd", "autograd_cache_bypass"),
    "aot_graphs": ("aot_autograd", "total"),
}
COMPILE_COUNTERS = tuple(_COUNTER_NAMES)


def compile_counters() -> dict[str, int]:
    """Cumulative FX-graph-cache and AOTAutograd-cache lookups (hit, miss, bypass) and AOTAutograd
    compiles (``aot_graphs``) of this process; take a difference of two snapshots. Checked on
    torch 2.11 and 2.13 (the counter names are those of both)."""
    return {name: int(_dynamo_counters[group][key]) for name, (group, key) in _COUNTER_NAMES.items()}


def inductor_seconds(phases: dict[str, float]) -> float:
    """Seconds in ``compile_fx_inner`` (cache lookups included) of a phase difference."""
    return float(phases.get("compile_fx_inner", 0.0))


def current_compile_id_text() -> str | None:
    """Dynamo's id of the compile in progress as torch writes it in its records (``"0/1"``)."""
    cid = torch._guards.CompileContext.current_compile_id()
    return None if cid is None else str(cid)


def wall_us() -> int:
    """Wall-clock microseconds, the clock of torch's compile records."""
    return time.time_ns() // 1000


# --- fake tensors and tracing context ---------------------------------------------------


def is_fake(value: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)


# --- torch's own DDPOptimizer -------------------------------------------------------------


def torch_ddp_optimizer_disabled():
    """``optimize_ddp=False`` around each call (Dynamo reads it per frame), not globally."""
    return torch._dynamo.config.patch(optimize_ddp=False)


def active_ddp_module():
    """The DDP module whose forward is running (set by DDP around its inner module call)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel._get_active_ddp_module()


# --- CUDA graphs (cudagraphs/runner.py) -------------------------------------------------


def compile_with_inner(
    mode: str | None, options: dict | None, dynamic: bool | None, make_inner: Callable[[], Callable[..., Any]]
) -> Callable[..., Any]:
    """An Inductor backend like ``make_backend("inductor", ...)`` whose every compiled graph goes
    through ``make_inner()`` (one per graph handed to the backend), which gets
    ``compile_fx_inner``'s arguments and must call :func:`inductor_compile_inner`. The
    AOTAutograd cache is off here: a hit would skip ``inner_compile``."""
    wrapper = torch._TorchCompileInductorWrapper(mode, options, dynamic)

    def backend(gm: Any, example_inputs: Any) -> Any:
        from torch._inductor.compile_fx import compile_fx

        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=make_inner(), config_patches=dict(wrapper.config))

    backend.__name__ = "inductor"
    return backend


def inductor_compile_inner(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, example_inputs, **kwargs)


def forward_returned_outputs() -> int | None:
    """In a forward's inner compile: how many leading outputs go to autograd, the rest saved for
    the backward. ``None`` when unknown (treat every output as returned)."""
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    n = getattr(meta, "num_forward", None)
    return int(n) if n is not None else None


def op_name(target: Any) -> str:
    """``aten.add_``-style name of an FX call target."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.replace("::", ".")
    return getattr(target, "__name__", str(target))


def written_args(node: Any) -> list[Any]:
    """The arguments an aten op node writes into (its schema marks them ``a!``)."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return []
    schema = node.target._schema.arguments
    given = {**{a.name: v for a, v in zip(schema, node.args)}, **node.kwargs}
    return [given[a.name] for a in schema if a.alias_info is not None and a.alias_info.is_write and a.name in given]


def has_unbacked_symbols(value: Any) -> bool:
    """A data-dependent size (unbacked SymInt) in ``value`` (a node's ``meta["val"]``)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    try:
        return bool(free_unbacked_symbols(value))
    except Exception:  # a value free_unbacked_symbols cannot walk: not a shape
        return False


def has_static_address(t: torch.Tensor) -> bool:
    """Dynamo's fixed-address mark (Inductor's ``static_input_idxs``), also in split segments."""
    if isinstance(t, torch.nn.Parameter):
        return True
    get = getattr(torch._dynamo.utils, "get_static_address_type", None)
    kind = get(t) if get is not None else getattr(t, "_dynamo_static_input_type", None)
    return kind is not None


# --- for the benchmarks (benchmarks/) ---------------------------------------------------------
# Checked on torch 2.11.0 (device machines) and 2.13.0 (CI).


def reset() -> None:
    """Forget every compiled frame and Dynamo's counters, as in a new process."""
    torch._dynamo.reset()
    _dynamo_counters.clear()
