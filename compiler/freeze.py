"""``bucketwise.freeze``: no new compile after warm-up ("Why are you recompiling in production?")."""

from __future__ import annotations

import contextlib
from typing import Any

ON_RECOMPILE = ("raise", "eager")
_STANCES = {"raise": "fail_on_recompile", "eager": "eager_on_recompile"}


def freeze(compiled: Any, *, on_recompile: str = "raise") -> Any:
    """Stop compiling: from now on a call that would need a new graph (a guard failed, e.g. a
    new input shape) either raises an error naming the failed guard (``"raise"``) or runs
    that frame eagerly (``"eager"``); cached graphs keep running. Returns ``compiled``.

    Uses ``torch.compiler.set_stance`` scoped to this object's calls, so other compiled code in
    the process keeps compiling as usual.
    """
    if on_recompile not in ON_RECOMPILE:
        raise ValueError(f"unknown on_recompile {on_recompile!r}; use 'raise' or 'eager'")
    if not hasattr(compiled, "_bucketwise_report"):
        raise TypeError(f"freeze() expects an object returned by bucketwise.compile, got {type(compiled).__name__}")
    compiled.__dict__["_bucketwise_frozen"] = on_recompile
    compiled._bucketwise_report.note(f"frozen: a recompile {'raises' if on_recompile == 'raise' else 'runs eagerly'}")
    return compiled


def freeze_after_warmup(compiled: Any, mode: str | None) -> None:
    """``compile(..., freeze=...)``: freeze ``compiled`` once its first call has returned."""
    if mode is not None and "_bucketwise_frozen" not in compiled.__dict__:
        freeze(compiled, on_recompile=mode)


def stance(compiled: Any) -> contextlib.AbstractContextManager:
    """The scope a compiled object's calls run in (a no-op unless frozen)."""
    mode = getattr(compiled, "__dict__", {}).get("_bucketwise_frozen")
    if mode is None:
        return contextlib.nullcontext()
    import torch

    return torch.compiler.set_stance(_STANCES[mode])
