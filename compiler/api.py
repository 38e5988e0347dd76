"""``bucketwise.compile``: the public entry point."""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any, Callable

import torch
import torch.nn as nn

from .._compat import aot
from .._compat import ddp as ddpc
from ..cudagraphs import policy as cudagraph_policy
from ..stats import bytecode
from .config import CompileConfig
from .decision import decide_strategy, refusal
from .module import compile_function, compile_module

log = logging.getLogger(__name__)


def compile(
    obj: nn.Module | Callable[..., Any],
    *,
    backend: str | Callable[..., Any] = "inductor",
    strategy: str = "auto",
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    cudagraphs: bool | str = False,
    bucket_cap_mb: float | None = None,
    first_bucket_cap_mb: float | None = None,
    gather_embedding_rows: bool = True,
    fallback: str = "eager",
    freeze: bool | str = False,
    share_blocks: bool | str = "auto",
    artifacts: str | os.PathLike | None = None,
) -> Any:
    """Compile a DDP-wrapped module, a plain module or a function, like ``torch.compile``.

    For a ``DistributedDataParallel`` module, every graph Dynamo captures either keeps its
    gradient-bucket allreduces inside its compiled backward (``strategy="fused"``, the default
    where it applies) or is split at the bucket boundaries of DDP's reducer (``"split"``), so
    each bucket's allreduce overlaps the rest of the backward. ``bucketwise.report(result)``
    tells what happened per graph and bucket.

    Args:
        obj: ``DDP(module)``, an ``nn.Module`` or a callable.
        backend: a ``torch.compile`` backend name or a callable backend.
        strategy: ``"fused"``, ``"split"``, ``"none"`` (compile graphs whole, DDP's reducer
            reduces at the end) or ``"auto"`` (``"fused"`` where it applies, else ``"split"``).
            A ``"fused"`` or ``"split"`` that cannot apply (no DDP module; for ``"fused"``, a
            comm hook or gradient hooks it cannot reproduce) raises ``ValueError`` naming why,
            here or at the first call (NOTE [explicit strategies]).
        mode, options, fullgraph, dynamic: as for ``torch.compile``.
        cudagraphs: CUDA-graph wrapping of segments (``True``/``False``/``"auto"``).
        bucket_cap_mb, first_bucket_cap_mb: bucket caps in MiB (default: the DDP module's).
        gather_embedding_rows: ``fused``: reduce an embedding table's gradient as the rows each
            rank looked up, all-gathered, where that sends fewer bytes than all-reducing the
            table (every rank must then look up as many ids per step); ``False``: all-reduce it.
        fallback: ``"eager"`` runs a segment whose compile fails uncompiled (reason in the
            report); ``"raise"`` re-raises.
        freeze: ``True``/``"raise"`` or ``"eager"``: after the first call no new compile
            happens; a call that would recompile raises naming the failed guard, or runs
            eagerly (as :func:`bucketwise.freeze`).
        share_blocks: ``True``: identical blocks (an ``nn.ModuleList`` of one class) share one
            compiled forward and backward (the report's ``shared_blocks`` says which, the
            seconds saved, or why they could not); ``False``: every block is compiled with the
            whole graph; ``"auto"`` (default): shared where ``cudagraphs`` is on and the
            strategy is not ``split``, else not (the report's notes say why). Under ``split`` a
            shared block is never cut, so buckets whose boundaries fall inside a block merge
            into fewer segments; under ``fused`` each shared block reduces its own parameters
            as one bucket.
        artifacts: a folder to keep this rank's compiled artifacts in (``rank{R}.bin``): loaded
            into the local compile caches now if there, saved after the first step, so a
            restart on a machine with an empty cache compiles from cache hits (NOTE [compile
            artifacts]). Default: ``BUCKETWISE_COMPILE_ARTIFACTS`` (``bucketwise launch
            --compile-artifacts DIR``), else none.

    Returns:
        For a module, a module with the same parameters and ``state_dict`` keys; for a
        function, a function.
    """
    if not callable(obj):
        raise TypeError(
            f"obj must be a DistributedDataParallel module, an nn.Module or a callable, got {type(obj).__name__}"
        )
    config = CompileConfig(
        backend=backend,
        strategy=strategy,
        mode=mode,
        options=options,
        fullgraph=fullgraph,
        dynamic=dynamic,
        cudagraphs=cudagraphs,
        bucket_cap_mb=bucket_cap_mb,
        first_bucket_cap_mb=first_bucket_cap_mb,
        gather_embedding_rows=gather_embedding_rows,
        fallback=fallback,
        freeze=freeze,
        share_blocks=share_blocks,
        artifacts=artifacts,
    )
    return compile_with_config(obj, config)


def compile_with_config(obj: nn.Module | Callable[..., Any], config: CompileConfig, *, first_call: Any = None) -> Any:
    """:func:`compile` with a checked config (``first_call``: ``CompiledState.first_call``)."""
    if ddpc.is_ddp(obj):
        problem = ddpc.process_group_usable(obj)
        if problem is not None:
            raise ValueError(f"obj: cannot compile this DDP module: {problem}")
    check_strategy(obj, config)
    cudagraphs = resolve_cudagraphs(config)
    warn_uncached_bytecode()
    if isinstance(obj, nn.Module):
        aot.start_compile_workers(config.capabilities, itertools.chain(obj.parameters(), obj.buffers()))
        return compile_module(obj, config, cudagraphs=cudagraphs, first_call=first_call)
    return compile_function(obj, config, cudagraphs=cudagraphs)


def check_strategy(obj: Any, config: CompileConfig) -> None:
    """Raise now where an explicit strategy cannot apply (NOTE [explicit strategies])."""
    if config.strategy not in ("fused", "split") or not isinstance(obj, nn.Module):
        return
    ddp = obj if ddpc.is_ddp(obj) else None
    problem = refusal(config, decide_strategy(config, ddp, runs_ddp_forward=True), target=target_name(obj))
    if problem is not None:
        raise ValueError(problem)


def target_name(module: nn.Module) -> str:
    """``Net`` or ``DDP(Net)``: what a report and an error call a compiled module."""
    return f"DDP({type(module.module).__name__})" if ddpc.is_ddp(module) else type(module).__name__


# NOTE [compile workers from the start]: torch starts Inductor's compile-worker pool only when its
# backend is called, but we compile shared blocks (NOTE [one compile per block]) before that, so
# their kernels would compile serially. So the pool is started when a GPU module is compiled for
# Inductor (and again, a no-op if running, before a GPU graph shares its blocks).
# ``TORCH_WARM_POOL=0`` and ``TORCHINDUCTOR_COMPILE_THREADS=1`` still turn it off.


def warn_uncached_bytecode() -> None:
    """Warn, on local rank 0, where every process compiles torch's modules from source (NOTE
    [compiled bytecode])."""
    message = bytecode.torch_bytecode().warning()
    if message and os.environ.get("LOCAL_RANK", "0") == "0":
        log.warning("%s", message)


def resolve_cudagraphs(config: CompileConfig) -> cudagraph_policy.Decision:
    """Whether this compiled object gets our CUDA graphs; warns where ``True`` is a no-op."""
    decision = cudagraph_policy.resolve(
        config.cudagraphs,
        cuda=torch.cuda.is_available(),
        backend=config.capabilities,
        mode=config.mode,
        dynamic=config.dynamic,
    )
    if config.cudagraphs is True and not torch.cuda.is_available():
        log.warning(
            "bucketwise: cudagraphs=%r is a no-op without CUDA; compiling without CUDA graphs", config.cudagraphs
        )
    elif config.cudagraphs is True and not decision.enabled:
        log.warning("bucketwise: cudagraphs=True not applied: %s", decision.reason)
    return decision
