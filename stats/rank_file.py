"""Where and when a report is written: ``$BUCKETWISE_STATS_DIR/rank<R>.json``.

A report is written when it changes in a way a reader waits for (a graph compiled, compile records
added, eager calls at powers of two and at exit, alignment known, a profile taken), and also sent
to rank 0 through the job's store (NOTE [job-wide stats]).
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Protocol

import torch.distributed as dist

from ..distributed.at_exit import at_exit
from . import job_stats
from .files import atomic_write_json

STATS_DIR_ENV = "BUCKETWISE_STATS_DIR"


class Writable(Protocol):
    def to_dict(self) -> dict[str, Any]: ...


class RankFile:
    """One report's file: a process's first compiled object owns ``rank<R>.json``; further ones
    (a second model, an eval copy) write ``obj<k>/rank<R>.json``."""

    # Stats folder -> how many compiled objects of this process write into it.
    _slots: dict[str, int] = {}

    def __init__(self) -> None:
        self._slot: tuple[str, int] | None = None

    def write(self, report: Writable) -> None:
        out_dir = os.environ.get(STATS_DIR_ENV)
        if not out_dir:
            return
        rank = rank_and_world()[0]
        key = os.path.abspath(out_dir)
        if self._slot is None or self._slot[0] != key:
            index = RankFile._slots.get(key, 0)
            RankFile._slots[key] = index + 1
            self._slot = (key, index)
        folder = out_dir if self._slot[1] == 0 else os.path.join(out_dir, f"obj{self._slot[1]}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{rank}.json")
        data = report.to_dict()
        atomic_write_json(path, data)
        job_stats.publish(out_dir, os.path.relpath(path, out_dir), data)

    def eager_call(self, report: Writable, count: int) -> None:
        """Written at powers of two and at interpreter exit, not at every call."""
        if count & (count - 1) == 0:
            self.write(report)
        else:
            at_exit("reports", _write_unwritten)
            _unwritten[report] = self


def rank_and_world() -> tuple[int, int]:
    """This process's rank and world size; torchrun's ``RANK``/``WORLD_SIZE`` without a process
    group (after ``destroy_process_group()``: the writes at exit)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


_unwritten: weakref.WeakKeyDictionary[Any, RankFile] = weakref.WeakKeyDictionary()


def _write_unwritten() -> None:
    for report, rank_file in list(_unwritten.items()):
        rank_file.write(report)
    _unwritten.clear()
