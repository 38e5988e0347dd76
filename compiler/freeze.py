"""``bucketwise.freeze``: no new compile after warm-up ("Why are you recompiling in production?")."""

from __future__ import annotations

from typing import Any

ON_RECOMPILE = ("raise", "eager")


def freeze(compiled: Any, *, on_recompile: str = "raise") -> Any:
    """Stop compiling: from now on a call that would need a new graph (a guard failed, e.g. a
    new input shape) either raises an error naming the failed guard (``"raise"``) or runs
    that frame eagerly (``"eager"``); cached graphs keep running. Returns ``compiled``.

    Uses ``torch.compiler.set_stance`` scoped to this object's calls, so other compiled code in
    the process keeps compiling as usual.
    """
    from .module import state_of

    if on_recompile not in ON_RECOMPILE:
        raise ValueError(f"unknown on_recompile {on_recompile!r}; use 'raise' or 'eager'")
    state = state_of(compiled)
    if state is None:
        raise TypeError(f"freeze() expects an object returned by bucketwise.compile, got {type(compiled).__name__}")
    state.freeze(on_recompile)
    return compiled
