"""What the backend a compiled object's graphs compile with can do, resolved once from the
config, and what this torch's Inductor gets wrong: the one place that compares backend names,
Inductor's wrapper mode and torch versions (everything else asks here). Inductor's settings read
here: ``torch._inductor.config.cpp_wrapper``, checked on torch 2.11.0, 2.13.0 and 2.15.0."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch.torch_version import TorchVersion

MIX_ORDER_REDUCTION = "triton.mix_order_reduction"
FIXED_IN = "2.15"

SHAREABLE = ("inductor", "aot_eager")
"""The backends a shared block compiles with (NOTE [one compile per block])."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Capabilities:
    name: str
    """The backend's name as the report shows it."""
    inductor: bool
    """Inductor: its config patches and decompositions apply, its graphs can be wrapped in CUDA
    graphs, a shared block's cost can be estimated, its compile workers started early."""
    shares_blocks: bool
    """A shared block compiles with it (``SHAREABLE``)."""
    cpp_wrapper: bool
    """Inductor's C++ wrapper (``options={"cpp_wrapper": True}`` or ``TORCHINDUCTOR_CPP_WRAPPER=1``),
    which cannot call the coalesced all-reduce nor the rows' gather
    (NOTE [collectives the C++ wrapper cannot call])."""

    @property
    def groups_block_reductions(self) -> bool:
        """Shared blocks' all-reduces can be grouped into one coalesced call."""
        return self.inductor and not self.cpp_wrapper

    @property
    def gathers_rows(self) -> bool:
        """Embedding tables' gradients can be gathered as rows (NOTE [embedding rows])."""
        return not self.cpp_wrapper


def capabilities(backend: str | Callable[..., Any], options: dict | None = None) -> Capabilities:
    """The record for ``bucketwise.compile(backend=..., options=...)``."""
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)
    inductor = backend == "inductor"
    cpp = inductor and bool((options or {}).get("cpp_wrapper", torch._inductor.config.cpp_wrapper))
    return Capabilities(name=name, inductor=inductor, shares_blocks=backend in SHAREABLE, cpp_wrapper=cpp)


def reductions_into_views_lost() -> bool:
    """Whether this torch's mix-order reduction loses its results computed into a view of another
    buffer (NOTE [reductions into bucket views]). Checked on torch 2.11.0 (an H200: wrong
    gradients), 2.13.0 and 2.14.1 (the generated code rebinds the name) and 2.15.0 (it writes
    through the view). Releases without the option (before 2.10) have no such reduction."""
    if MIX_ORDER_REDUCTION not in torch._inductor.config.get_config_copy():
        return False
    return TorchVersion(torch.__version__) < FIXED_IN


def products_lowering_checked() -> bool:
    """Whether NOTE [matrix products into the bucket]'s lowering was run on this torch's Inductor
    IR: torch 2.13.0, 2.14.1 and 2.15.0 (CPU)."""
    return TorchVersion("2.13") <= TorchVersion(torch.__version__) < TorchVersion("2.16")
