"""User-facing compile configuration, validated before anything is compiled."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Callable

import torch

from .._compat import inductor as ci
from .._compat.capabilities import Capabilities
from .._compat.capabilities import capabilities as resolve_capabilities

STRATEGIES = ("auto", "split", "fused", "none")
FALLBACKS = ("eager", "raise")
CUDAGRAPHS = (True, False, "auto")
FREEZE = (False, True, "raise", "eager")
SHARE_BLOCKS = (True, False, "auto")


def _known_backends() -> list[str]:
    return sorted(torch.compiler.list_backends(exclude_tags=()))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileConfig:
    """Everything :func:`bucketwise.compile` was asked to do.

    Checked in ``__post_init__`` so a bad value raises before any state is built.
    """

    backend: str | Callable[..., Any] = "inductor"
    """A ``torch.compile`` backend name (``torch.compiler.list_backends()``) or a callable
    ``(GraphModule, example_inputs) -> callable``. Each bucket segment is compiled with it."""

    strategy: str = "auto"
    """``"split"``: cut every Dynamo graph at gradient-bucket boundaries; ``"fused"``: compile
    each graph whole with the bucket allreduces traced into its backward; ``"none"``: compile
    each graph whole; ``"auto"``: ``"fused"`` where it applies, else ``"split"`` (the report says
    why)."""

    mode: str | None = None
    """``torch.compile`` mode, e.g. ``"reduce-overhead"`` or ``"max-autotune"``."""

    options: dict[str, Any] | None = None
    """Backend options, as for ``torch.compile(options=...)``."""

    fullgraph: bool = False
    """Raise on any graph break instead of splitting the frame."""

    dynamic: bool | None = None
    """As ``torch.compile(dynamic=...)``."""

    cudagraphs: bool | str = False
    """CUDA-graph wrapping of compiled segments (no-op with a message on CPU)."""

    bucket_cap_mb: float | None = None
    """Bucket cap in MiB; default: the DDP module's own ``bucket_bytes_cap``."""

    first_bucket_cap_mb: float | None = None
    """Cap of the first bucket (the last gradients of the backward); default: DDP's own."""

    gather_embedding_rows: bool = True
    """``fused``: reduce an embedding table's gradient by all-gathering the rows each rank looked
    up (and their ids) instead of all-reducing the whole table, where that sends fewer bytes
    (ranks x ids <= table rows; NOTE [embedding rows] in ``distributed/fused/embedding_rows.py``).
    Every rank must then look up the same number of ids per step; ``False`` all-reduces tables
    like any gradient."""

    fallback: str = "eager"
    """What a segment whose compile fails does: ``"eager"`` runs it uncompiled and records the
    reason in the report; ``"raise"`` re-raises."""

    freeze: bool | str = False
    """Stop compiling after the first call (the warm-up): ``True``/``"raise"`` makes a later
    recompile raise an error naming the failed guard, ``"eager"`` runs that frame eagerly (see
    :func:`bucketwise.freeze`, which freezes at a point of your choosing)."""

    share_blocks: bool | str = "auto"
    """``True``: identical blocks of a graph (an ``nn.ModuleList`` of one block class) share one
    compiled forward and backward, so AOTAutograd and the backend run once per distinct block
    (NOTE [one compile per block]); ``False`` compiles every block with the whole graph;
    ``"auto"`` (default): ``True`` where bucketwise's CUDA graphs are on and the strategy is not
    ``split``; without CUDA graphs on a GPU, where the block's call, estimated from its graphs,
    hides behind its kernels (NOTE [sharing by cost]); else ``False`` (NOTE [sharing by
    default]; the report says which and why)."""

    artifacts: str | os.PathLike | None = None
    """A folder for this rank's compiled artifacts, loaded now and saved after the first step
    (NOTE [compile artifacts]); ``None``: ``BUCKETWISE_COMPILE_ARTIFACTS``, else none."""

    def __post_init__(self) -> None:
        if self.artifacts is not None and not isinstance(self.artifacts, (str, os.PathLike)):
            raise TypeError(f"artifacts must be a folder path or None, got {type(self.artifacts).__name__}")
        if isinstance(self.artifacts, (str, os.PathLike)) and os.path.isfile(self.artifacts):
            raise ValueError(f"artifacts must be a folder (rank files go inside it), got the file {self.artifacts!r}")
        if self.share_blocks not in SHARE_BLOCKS or type(self.share_blocks) not in (bool, str):
            raise ValueError(f"share_blocks must be True, False or 'auto', got {self.share_blocks!r}")
        if self.freeze not in FREEZE or isinstance(self.freeze, int) and not isinstance(self.freeze, bool):
            raise ValueError(f"freeze must be False, True, 'raise' or 'eager', got {self.freeze!r}")
        if isinstance(self.backend, str):
            known = _known_backends()
            if self.backend not in known:
                raise ValueError(f"unknown backend {self.backend!r}; use a callable or one of {known}")
        elif not callable(self.backend):
            raise TypeError(f"backend must be a backend name or a callable, got {type(self.backend).__name__}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; use 'split', 'fused', 'none' or 'auto'")
        if self.fallback not in FALLBACKS:
            raise ValueError(f"unknown fallback {self.fallback!r}; use 'eager' or 'raise'")
        if self.mode is not None and not isinstance(self.mode, str):
            raise TypeError(f"mode must be a string or None, got {type(self.mode).__name__}")
        if self.mode is not None and self.options is not None:
            raise ValueError("mode and options cannot both be set (as in torch.compile)")
        if self.options is not None and not isinstance(self.options, dict):
            raise TypeError(f"options must be a dict or None, got {type(self.options).__name__}")
        if (
            self.strategy in ("fused", "auto")
            and (self.options or {}).get(ci.MIX_ORDER_REDUCTION)
            and ci.reductions_into_views_lost()
        ):
            raise ValueError(
                f"options[{ci.MIX_ORDER_REDUCTION!r}]=True with strategy={self.strategy!r}: torch "
                f"{torch.__version__} loses norm-layer gradients that this reduction computes into a bucket "
                f"(pytorch/pytorch#193061, fixed in torch {ci.FIXED_IN}; NOTE [reductions into bucket views]); "
                "leave the option out (bucketwise turns it off where gradients go into buckets) or pass "
                "strategy='split'"
            )
        if (
            self.cudagraphs not in CUDAGRAPHS
            or isinstance(self.cudagraphs, int)
            and not isinstance(self.cudagraphs, bool)
        ):
            raise ValueError(f"cudagraphs must be True, False or 'auto', got {self.cudagraphs!r}")
        if not isinstance(self.gather_embedding_rows, bool):
            raise TypeError(f"gather_embedding_rows must be a bool, got {self.gather_embedding_rows!r}")
        if not isinstance(self.fullgraph, bool):
            raise TypeError(f"fullgraph must be a bool, got {type(self.fullgraph).__name__}")
        if self.dynamic not in (None, True, False):
            raise ValueError(f"dynamic must be None, True or False, got {self.dynamic!r}")
        for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number of MiB (0 or more), got {value!r}")
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(
                    f"{name} must be a finite number of MiB, 0 or more (0: one parameter per bucket), got {value!r}"
                )

    @property
    def freeze_mode(self) -> str | None:
        """``"raise"``/``"eager"`` once warmed up, or ``None`` (never frozen)."""
        if self.freeze is False:
            return None
        return "raise" if self.freeze is True else self.freeze

    @functools.cached_property
    def capabilities(self) -> Capabilities:
        """What the backend can do, resolved once (the only place backend names are compared)."""
        return resolve_capabilities(self.backend, self.options)

    @property
    def backend_name(self) -> str:
        return self.capabilities.name
