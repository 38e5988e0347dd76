"""torch's own ways of training a DDP model that the docs compare bucketwise with, selected only
through torch's private API: ``torch-nosplit`` (DDPOptimizer off), ``torch-ca`` (DDP's Python
reducer under compiled autograd) and ``replicate`` (FSDP2's ``replicate()``). Only the benchmarks
use it (private torch API lives in ``_compat/`` only). Checked on torch 2.11.0 (device machines)
and 2.13.0 (CI, which runs tests/benchmarks/test_torch_ca.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import torch.nn as nn
from torch._dynamo.utils import counters as _dynamo_counters


def optimize_ddp(flag: bool) -> contextlib.AbstractContextManager:
    """Within the block, frames Dynamo converts use (``True``) or skip (``False``) torch's
    DDPOptimizer: Dynamo reads the flag when it converts a frame, so the block must hold the
    calls that compile, not ``torch.compile()``."""
    import torch._dynamo

    return torch._dynamo.config.patch(optimize_ddp=flag)


_PYTHON_REDUCER_INDUCTOR_OPTIONS = ("_fuse_ddp_communication", "_fuse_ddp_bucket_size")
"""The Inductor options DDP's constructor sets for its Python reducer."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PythonReducerBuild:
    """A module built by :func:`build_for_python_reducer` and the Inductor options DDP's
    constructor set for it, for the ``torch.compile`` calls that compile it."""

    module: Any
    inductor_options: dict[str, Any]


def build_for_python_reducer(build: Callable[[], Any]) -> PythonReducerBuild:
    """``build()`` (which constructs DDP modules) under ``optimize_ddp="python_reducer"``. The
    process-wide state DDP's constructor changes for that mode (Inductor's DDP fusion options,
    Dynamo's ``LEGACY_MOD_INLINELIST``) is put back on return; the Inductor options come back
    with the module, for ``torch.compile(..., options=)``."""
    import torch._dynamo
    import torch._inductor.config
    from torch._dynamo import trace_rules

    config = torch._inductor.config
    legacy_before = set(trace_rules.LEGACY_MOD_INLINELIST)
    try:
        with config.patch({k: getattr(config, k) for k in _PYTHON_REDUCER_INDUCTOR_OPTIONS}):
            with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
                module = build()
            options = {k: getattr(config, k) for k in _PYTHON_REDUCER_INDUCTOR_OPTIONS}
    finally:
        added = set(trace_rules.LEGACY_MOD_INLINELIST) - legacy_before
        if added:
            trace_rules.LEGACY_MOD_INLINELIST.difference_update(added)
            trace_rules.get_legacy_mod_inlinelist.cache_clear()
    return PythonReducerBuild(module=module, inductor_options=options)


@contextlib.contextmanager
def python_reducer_steps(compiler: Callable[..., Any]) -> Iterator[None]:
    """Within the block, torch's compiled-DDP path with compiled autograd: ``optimize_ddp`` is
    ``"python_reducer"`` (Dynamo reads it per frame) and every backward pass is captured by
    compiled autograd and compiled by ``compiler``. Enter it around the forward as well as the
    backward; on exit both are as they were."""
    import torch._dynamo
    from torch._dynamo import compiled_autograd

    enable = getattr(compiled_autograd, "_enable", None) or compiled_autograd.enable
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"), enable(compiler):
        yield


def replicate(model: nn.Module) -> nn.Module:
    """FSDP2's ``replicate()`` on each block of the first ``nn.ModuleList`` (the transformer
    blocks), then on the root, as torchtitan applies it."""
    from torch.distributed._composable.replicate_with_fsdp import replicate as replicate_module

    blocks = next((m for m in model.modules() if isinstance(m, nn.ModuleList)), [])
    for block in blocks:
        replicate_module(block)
    return replicate_module(model)


# Probes of the anchors' state (tests/benchmarks/test_torch_ca.py): checked on torch 2.13.0 and
# against the source of 2.11.0.


def graph_counts() -> dict[str, int]:
    """Graphs Dynamo compiled and graph breaks it made since the last ``torch._dynamo.reset()``."""
    return {
        "unique_graphs": int(_dynamo_counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(_dynamo_counters["graph_break"].values())),
    }


def ddp_inline_rule_added() -> bool:
    """Whether Dynamo's ``LEGACY_MOD_INLINELIST`` holds ``torch.nn.parallel.distributed`` (what
    DDP's constructor adds for its python reducer, :func:`build_for_python_reducer`)."""
    from torch._dynamo import trace_rules

    return "torch.nn.parallel.distributed" in trace_rules.LEGACY_MOD_INLINELIST


def compiled_autograd_captures() -> int:
    """Backward graphs compiled autograd captured since the last ``torch._dynamo.reset()``."""
    return int(_dynamo_counters["compiled_autograd"]["captures"])


def compiled_autograd_enabled() -> bool:
    """Whether compiled autograd captures the backward passes run now."""
    from torch._dynamo import compiled_autograd

    return bool(compiled_autograd.compiled_autograd_enabled)
