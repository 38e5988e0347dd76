"""Fail on every rank, with the difference named, instead of hanging in a collective."""

from __future__ import annotations

import datetime
import os
import weakref
from typing import Any, Sequence

import torch.distributed as dist

TIMEOUT_ENV = "BUCKETWISE_RANK_CHECK_TIMEOUT"
_DEFAULT_TIMEOUT_S = 120.0

# One gloo side group per job process group, created on first use (all ranks create it at the
# same point: when bucketwise.compile() runs, see ``prepare_rank_checks``).
_side_groups: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


class RankMismatchError(RuntimeError):
    """Ranks disagree on something that must be identical everywhere."""


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, _DEFAULT_TIMEOUT_S)))


def prepare_rank_checks(pg: Any) -> None:
    """Create the gloo side group for checks (collective on ``pg``). Local synchronization gives
    each data-parallel subgroup its own side group; a rank that never joins makes the others
    raise :class:`RankMismatchError` after ``$BUCKETWISE_RANK_CHECK_TIMEOUT`` seconds."""
    if pg in _side_groups or dist.get_world_size(pg) == 1:
        return
    ranks = dist.get_process_group_ranks(pg)
    try:
        side = dist.new_group(ranks=ranks, backend="gloo", timeout=_timeout(), use_local_synchronization=True)
    except RuntimeError as exc:
        raise RankMismatchError(
            f"rank {dist.get_rank(pg)}: other ranks of the DDP process group (global ranks {ranks}) did not "
            f"set up bucketwise's rank checks within {_timeout().total_seconds():.0f} s: every rank must call "
            f"bucketwise.compile on its DDP module at the same point, with the same strategy "
            f"('fused'/'auto' on some ranks, 'split'/'none' on others does not work): {exc}"
        ) from exc
    _side_groups[pg] = side


def rank_checks_ready(pg: Any) -> bool:
    """:func:`prepare_rank_checks` ran for ``pg``, or ``pg`` has one rank (nothing to compare)."""
    return pg in _side_groups or dist.get_world_size(pg) == 1


def gather_on_all_ranks(obj: Any, pg: Any, *, what: str, context: str = "") -> list[Any]:
    """Every rank's ``obj``; :class:`RankMismatchError` after the timeout if a rank never joins."""
    if dist.get_world_size(pg) == 1:
        return [obj]
    side = _side_groups.get(pg)
    if side is None:
        raise AssertionError("expected prepare_rank_checks() to run at compile() time")
    gathered: list[Any] = [None] * dist.get_world_size(pg)
    me = dist.get_rank(pg)
    try:
        dist.all_gather_object(gathered, obj, group=side)
    except RuntimeError as exc:
        raise RankMismatchError(
            f"rank {me}: other ranks did not join the {what} check within {_timeout().total_seconds():.0f} s "
            f"({context + '; ' if context else ''}did this rank compile a graph the others did not, e.g. a "
            f"recompile on one rank only?): {exc}"
        ) from exc
    return gathered


def check_same_on_all_ranks(
    signature: Sequence[str],
    pg: Any,
    *,
    what: str,
    context: str = "",
    gathered: list[Any] | None = None,
    fix: str = "",
) -> None:
    """Raise :class:`RankMismatchError` on every rank, naming the first differing line and
    ``fix``, if the ranks' ``signature`` differ (``gathered``: already gathered)."""
    if dist.get_world_size(pg) == 1:
        return
    if gathered is None:
        gathered = gather_on_all_ranks(list(signature), pg, what=what, context=context)
    reference = gathered[0]
    for rank, theirs in enumerate(gathered):
        if theirs == reference:
            continue
        for i in range(max(len(theirs), len(reference))):
            a = reference[i] if i < len(reference) else "<missing>"
            b = theirs[i] if i < len(theirs) else "<missing>"
            if a != b:
                raise RankMismatchError(
                    f"{what} differs between ranks: rank 0 has {a!r}, rank {rank} has {b!r}"
                    + (f"; {fix}" if fix else "")
                )
