"""The benchmark configurations: one line per config in ``CONFIGS`` (name -> :class:`Recipe`).

A recipe turns a freshly built model into the module a training step calls:

- ``eager``: ``DDP(model)``, no compile.
- ``torch``: ``torch.compile(DDP(model))`` (torch's DDPOptimizer, default ``optimize_ddp``).
- ``torch-nosplit``: the same with ``optimize_ddp=False`` (``_compat/torch_paths.py``) around every
  training-step call (Dynamo reads the flag per frame when it converts it, so the patch must be
  active while the step runs, not while ``torch.compile()`` is called).
- ``torch-ca``: torch's compiled-DDP path with compiled autograd: DDP built under
  ``optimize_ddp="python_reducer"`` (its Python reducer: a hook per parameter all-reduces the
  gradient with functional collectives), ``torch.compile(DDP(model))`` for the forward, and every
  step run with that mode in force and its backward captured by compiled autograd and compiled by
  ``torch.compile`` with the run's backend (``_compat/torch_paths.py``);
  both compiles get the Inductor options DDP sets for that mode (``options=``).
  What DDP's constructor changes process-wide for that mode is put back once it is built, so
  configs built beside it in one process are unchanged (``build_for_python_reducer``).
- ``local``: ``torch.compile(model)`` without DDP: the compute floor, no gradient traffic.
- ``regional``: torch's regional compilation recipe: each repeated block compiled in place
  (``block.compile()``), the embeddings, head and loss eager, eager DDP around it.
- ``replicate``: torch's DDP successor built on FSDP2 (``replicate()`` from
  ``torch.distributed._composable.replicate_with_fsdp``), applied to each block of the model's
  first ``nn.ModuleList`` and then to the root (torchtitan's order), then ``torch.compile``.
- ``bw-<strategy>``: ``bucketwise.compile(DDP(model), strategy=...)``.
- ``*-ro``: the same with ``mode="reduce-overhead"`` (Inductor's CUDA graphs; CUDA only).
- ``bw-<strategy>-cg``: ``bucketwise.compile(..., cudagraphs=True)`` (bucketwise's own CUDA-graph
  wrapper; CUDA only). Its floor, like that of the ``*-ro`` configs, is ``local-ro``.
- ``bw-fused-blocks``, ``bw-fused-blocks-cg``: ``share_blocks=True`` (identical blocks share one
  compile); ``bw-auto-whole``, ``bw-fused-whole``: ``share_blocks=False`` (every block in the whole
  graph). Every other ``bw-`` config leaves ``share_blocks`` at the product's default, ``"auto"``.
- ``bw-fused-noreorder``: Inductor's compute/communication reordering off (``options=NO_REORDER``).
- ``*-cpp``: Inductor's C++ wrapper (``options=CPP_WRAPPER``): the graphs, shared blocks' included,
  launch their kernels from C++ (``local-cpp``, ``bw-auto-cpp``, ``bw-fused-blocks-cpp``,
  ``bw-fused-whole-cpp``); their floor is still ``local``. On a GPU with torch 2.11 the three run failed to
  compile (``bw-auto-cpp`` not run) (``2026-11-29_1xH200_tax-llama16-b4-cpp-wrapper-fails-torch-2.11``).
- ``*-nomix``: Inductor's mix-order reduction off (``options=NO_MIX_ORDER``), as every compile that
  gathers gradients into buckets runs on torch 2.10 to 2.14 (NOTE [reductions into bucket views]):
  ``local-nomix`` beside ``local`` is what that costs the compute floor, ``bw-split-nomix`` beside
  ``bw-split`` what it costs a strategy that needs no buckets.

The names follow one vocabulary (``core/names.py``), which also says which configs the zoo and the
HF Trainer harness run.

A new strategy is one more line, e.g. ``"bw-fused": Recipe(compiler="bucketwise", strategy="fused")``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketwise._compat import torch_paths

COMPILERS = ("none", "torch", "bucketwise")
COMM_HOOKS = (None, "bf16", "powersgd")
POWERSGD_STATE = {"matrix_approximation_rank": 4, "start_powerSGD_iter": 2}
"""``PowerSGDState`` arguments of the ``powersgd`` configs."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prepared:
    """What a recipe built: the module to call, a context entered around every step call, and
    the bucketwise report (``None`` for the other compilers)."""

    module: nn.Module
    step_context: Callable[[], contextlib.AbstractContextManager]
    report: Any = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    compiler: str = "none"
    """``none`` (eager), ``torch`` (``torch.compile``) or ``bucketwise`` (``bucketwise.compile``)."""
    ddp: bool = True
    """Wrap the model in DDP (``False``: the local compute floor)."""
    replicate: bool = False
    """Wrap the model with FSDP2's ``replicate()`` instead of DDP."""
    regional: bool = False
    """torch's regional compilation: each block of the model's first ``nn.ModuleList`` compiled
    in place (``block.compile()``), the rest (embeddings, head, loss) and DDP's reducer eager."""
    mode: str | None = None
    """``torch.compile`` mode, e.g. ``reduce-overhead``."""
    optimize_ddp: bool | None = None
    """torch's ``optimize_ddp`` (its DDPOptimizer) during the steps (``None``: torch's default)."""
    strategy: str | None = None
    """bucketwise strategy (``split``, ``none``, ...)."""
    cudagraphs: bool | str = False
    """bucketwise ``cudagraphs=`` argument."""
    comm_hook: str | None = None
    """``"bf16"``: register torch's ``bf16_compress_hook`` on the DDP module (opt-in compressed comm);
    ``"powersgd"``: torch's ``powerSGD_hook`` with ``POWERSGD_STATE`` (compressing from the
    second step after the first, within the warm-up)."""
    gather_embedding_rows: bool = True
    """bucketwise ``gather_embedding_rows=`` argument (``False``: all-reduce embedding tables whole)."""
    share_blocks: bool | str = "auto"
    """bucketwise ``share_blocks=`` argument: the product's default, ``True`` (identical blocks share
    one compile) or ``False`` (every block in the whole graph)."""
    options: dict[str, Any] | None = None
    """Inductor ``options=`` of ``bucketwise.compile`` or ``torch.compile``, e.g. ``NO_REORDER``."""
    compiled_autograd: bool = False
    """torch's compiled-DDP path with compiled autograd (``torch-ca``): DDP built for its Python
    reducer (``optimize_ddp="python_reducer"``), that mode in force during every step, and the
    backward captured by compiled autograd and compiled by ``torch.compile`` with the run's
    backend; both compiles get the Inductor options DDP sets for its Python reducer."""

    def __post_init__(self) -> None:
        if self.compiler not in COMPILERS:
            raise ValueError(f"compiler must be one of {COMPILERS}, got {self.compiler!r}")
        if (self.compiler == "bucketwise") != (self.strategy is not None):
            raise ValueError("strategy is required for (and only for) compiler='bucketwise'")
        if self.compiler == "bucketwise" and not self.ddp:
            raise ValueError("bucketwise recipes compile a DDP module (ddp=True)")
        if self.comm_hook not in COMM_HOOKS:
            raise ValueError(f"comm_hook must be one of {COMM_HOOKS}, got {self.comm_hook!r}")
        if self.replicate and (self.ddp or self.compiler != "torch"):
            raise ValueError("replicate recipes compile with torch.compile and use no DDP (ddp=False)")
        if self.compiler == "none" and (self.mode or self.optimize_ddp is not None or self.options):
            raise ValueError("mode/optimize_ddp/options need a compiler")
        if self.mode is not None and self.options is not None:
            raise ValueError(f"mode and options cannot both be set (as in torch.compile), got mode={self.mode!r}")
        if self.compiled_autograd:
            if self.compiler != "torch" or not self.ddp or self.replicate or self.regional:
                raise ValueError(
                    "compiled_autograd=True is torch's compiled DDP path: use compiler='torch' with ddp=True "
                    f"(no replicate or regional), got compiler={self.compiler!r}, ddp={self.ddp}, "
                    f"replicate={self.replicate}, regional={self.regional}"
                )
            if self.optimize_ddp is not None:
                raise ValueError(
                    f"compiled_autograd=True sets optimize_ddp='python_reducer' itself: drop optimize_ddp "
                    f"(got {self.optimize_ddp!r})"
                )
            if self.comm_hook is not None:
                raise ValueError(
                    f"comm_hook={self.comm_hook!r} is a hook of DDP's C++ reducer, which compiled_autograd=True "
                    "replaces with the Python reducer: drop comm_hook"
                )
            if self.mode is not None:
                raise ValueError(
                    f"compiled_autograd=True compiles with the Inductor options DDP sets for its Python reducer, "
                    f"and torch.compile takes options or a mode, not both: drop mode={self.mode!r}"
                )

    @property
    def uses_cuda_graphs(self) -> bool:
        """Inductor's (``mode="reduce-overhead"``) or bucketwise's (``cudagraphs``) CUDA graphs."""
        return self.mode == "reduce-overhead" or bool(self.cudagraphs)

    @property
    def needs_cuda(self) -> str | None:
        """Why this recipe cannot run without CUDA, or ``None``."""
        if self.mode == "reduce-overhead":
            return "mode='reduce-overhead' (CUDA graphs) needs CUDA"
        if self.cudagraphs:
            return "cudagraphs needs CUDA"
        return None

    def wrap(self, model: nn.Module, *, device: torch.device, bucket_cap_mb: float | None) -> nn.Module:
        if self.replicate:
            return torch_paths.replicate(model)
        if not self.ddp:
            return model
        kwargs: dict[str, Any] = {}
        if bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = bucket_cap_mb
        if device.type == "cuda":
            kwargs["device_ids"] = [device.index]
        ddp = DDP(model, **kwargs)
        if self.comm_hook == "bf16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        if self.comm_hook == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

            ddp.register_comm_hook(ps.PowerSGDState(None, **POWERSGD_STATE), ps.powerSGD_hook)
        return ddp

    def prepare(self, model: nn.Module, *, device: torch.device, backend: str, bucket_cap_mb: float | None) -> Prepared:
        if self.compiled_autograd:
            # DDP reads optimize_ddp in its constructor; what it changes process-wide for the
            # python reducer is put back once it is built, and put in force around each step.
            built = torch_paths.build_for_python_reducer(
                lambda: self.wrap(model, device=device, bucket_cap_mb=bucket_cap_mb)
            )
            # Both compiles get the Inductor options DDP set for the whole process in torch's own
            # path; they also keep torch-ca's compiled frames apart from those of other
            # torch.compile(DDP(model)) configs in one process (NOTE [configs side by side]).
            options = built.inductor_options
            compiled = torch.compile(built.module, backend=backend, options=options)
            backward_compiler = torch.compile(backend=backend, options=options)
            return Prepared(module=compiled, step_context=lambda: torch_paths.python_reducer_steps(backward_compiler))
        wrapped = self.wrap(model, device=device, bucket_cap_mb=bucket_cap_mb)
        if self.compiler == "none":
            return Prepared(module=wrapped, step_context=contextlib.nullcontext)
        if self.regional:
            for block in next((m for m in model.modules() if isinstance(m, nn.ModuleList)), []):
                block.compile(backend=backend, mode=self.mode)
            return Prepared(module=wrapped, step_context=contextlib.nullcontext)
        if self.compiler == "torch":
            compiled = torch.compile(wrapped, backend=backend, mode=self.mode, options=self.options)
            if self.optimize_ddp is None:
                return Prepared(module=compiled, step_context=contextlib.nullcontext)
            flag = self.optimize_ddp
            return Prepared(module=compiled, step_context=lambda: torch_paths.optimize_ddp(flag))
        import bucketwise

        compiled = bucketwise.compile(
            wrapped,
            backend=backend,
            strategy=self.strategy,
            mode=self.mode,
            cudagraphs=self.cudagraphs,
            gather_embedding_rows=self.gather_embedding_rows,
            share_blocks=self.share_blocks,
            options=self.options,
        )
        return Prepared(module=compiled, step_context=contextlib.nullcontext, report=bucketwise.report(compiled))


RO = "reduce-overhead"
NO_REORDER = {"reorder_for_compute_comm_overlap": False}
"""Inductor's compute/communication reordering off (``bw-fused-noreorder``)."""

CPP_WRAPPER = {"cpp_wrapper": True}
"""Inductor's C++ wrapper (the ``*-cpp`` configs)."""

NO_MIX_ORDER = {"triton.mix_order_reduction": False}
"""Inductor's mix-order reduction off (the ``*-nomix`` configs)."""

CONFIGS: dict[str, Recipe] = {
    "eager": Recipe(),
    "torch": Recipe(compiler="torch"),
    "torch-nosplit": Recipe(compiler="torch", optimize_ddp=False),
    "local": Recipe(compiler="torch", ddp=False),
    "torch-ca": Recipe(compiler="torch", compiled_autograd=True),
    "regional": Recipe(compiler="torch", regional=True),
    "replicate": Recipe(compiler="torch", ddp=False, replicate=True),
    "bw-split": Recipe(compiler="bucketwise", strategy="split"),
    "bw-none": Recipe(compiler="bucketwise", strategy="none"),
    "bw-fused": Recipe(compiler="bucketwise", strategy="fused"),
    "bw-auto": Recipe(compiler="bucketwise", strategy="auto"),
    "bw-fused-noreorder": Recipe(compiler="bucketwise", strategy="fused", options=NO_REORDER),
    "bw-fused-bf16": Recipe(compiler="bucketwise", strategy="fused", comm_hook="bf16"),
    "bw-fused-dense": Recipe(compiler="bucketwise", strategy="fused", gather_embedding_rows=False),
    "bw-fused-dense-cg": Recipe(compiler="bucketwise", strategy="fused", cudagraphs=True, gather_embedding_rows=False),
    "eager-bf16": Recipe(comm_hook="bf16"),
    "torch-bf16": Recipe(compiler="torch", comm_hook="bf16"),
    "eager-powersgd": Recipe(comm_hook="powersgd"),
    "torch-powersgd": Recipe(compiler="torch", comm_hook="powersgd"),
    "bw-split-powersgd": Recipe(compiler="bucketwise", strategy="split", comm_hook="powersgd"),
    "bw-fused-powersgd": Recipe(compiler="bucketwise", strategy="fused", comm_hook="powersgd"),
    "bw-fused-powersgd-cg": Recipe(compiler="bucketwise", strategy="fused", cudagraphs=True, comm_hook="powersgd"),
    "torch-ro": Recipe(compiler="torch", mode=RO),
    "torch-nosplit-ro": Recipe(compiler="torch", optimize_ddp=False, mode=RO),
    "local-ro": Recipe(compiler="torch", ddp=False, mode=RO),
    "bw-split-ro": Recipe(compiler="bucketwise", strategy="split", mode=RO),
    "bw-none-ro": Recipe(compiler="bucketwise", strategy="none", mode=RO),
    "bw-fused-ro": Recipe(compiler="bucketwise", strategy="fused", mode=RO),
    "bw-split-cg": Recipe(compiler="bucketwise", strategy="split", cudagraphs=True),
    "bw-none-cg": Recipe(compiler="bucketwise", strategy="none", cudagraphs=True),
    "bw-fused-cg": Recipe(compiler="bucketwise", strategy="fused", cudagraphs=True),
    "bw-fused-blocks": Recipe(compiler="bucketwise", strategy="fused", share_blocks=True),
    "local-cpp": Recipe(compiler="torch", ddp=False, options=CPP_WRAPPER),
    "bw-auto-cpp": Recipe(compiler="bucketwise", strategy="auto", options=CPP_WRAPPER),
    "bw-fused-blocks-cpp": Recipe(compiler="bucketwise", strategy="fused", share_blocks=True, options=CPP_WRAPPER),
    "bw-fused-whole-cpp": Recipe(compiler="bucketwise", strategy="fused", share_blocks=False, options=CPP_WRAPPER),
    "local-nomix": Recipe(compiler="torch", ddp=False, options=NO_MIX_ORDER),
    "bw-split-nomix": Recipe(compiler="bucketwise", strategy="split", options=NO_MIX_ORDER),
    "bw-auto-whole": Recipe(compiler="bucketwise", strategy="auto", share_blocks=False),
    "bw-fused-whole": Recipe(compiler="bucketwise", strategy="fused", share_blocks=False),
    "bw-fused-blocks-cg": Recipe(compiler="bucketwise", strategy="fused", cudagraphs=True, share_blocks=True),
}

DEFAULT_CONFIGS = ("eager", "torch", "torch-nosplit", "local", "bw-split", "bw-none", "bw-fused")


def base_name(config: str) -> str:
    """``bw-split#2`` -> ``bw-split`` (a repeated run of a config)."""
    return config.split("#", 1)[0]


def recipe_for(config: str) -> Recipe:
    try:
        return CONFIGS[base_name(config)]
    except KeyError:
        raise ValueError(f"unknown config {config!r}; known configs: {', '.join(CONFIGS)}") from None


def floor_config(config: str) -> str:
    """The compute floor a config is compared with: ``local-ro`` (CUDA graphs) for the configs that
    use CUDA graphs (``*-ro``, ``*-cg``), else ``local``."""
    return "local-ro" if recipe_for(config).uses_cuda_graphs else "local"
