"""The one aligned text table every report, view and CLI command prints."""

from __future__ import annotations

from typing import Callable, Collection, Sequence


def align(rows: Sequence[Sequence[str]], *, right: Collection[int] | Callable[[int], bool] = ()) -> str:
    """``rows`` (the header first) as columns two spaces apart; the columns in ``right`` (indices,
    or a predicate on the index) right-aligned, the others left-aligned; no trailing blanks."""
    if not rows:
        return ""
    is_right = right if callable(right) else (lambda i: i in right)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.rjust(w) if is_right(i) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in rows
    )
