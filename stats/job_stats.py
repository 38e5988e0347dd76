"""Every rank's rank files, gathered into rank 0's stats folder through the job's own store.

NOTE [job-wide stats]: each node's ranks write into that node's ``--stats-dir``, and a shared
folder cannot be assumed. So every rank-file write is also published through the default group's
store (``bucketwise/stats/<restart>/rank<R>``), and at exit each rank publishes once more, marked
final, through its own client of the store's TCP server, which outlives
``destroy_process_group()``. Rank 0, at exit, waits for the final entries
(``$BUCKETWISE_STATS_GATHER_TIMEOUT``, 60 s by default; not after an unhandled exception), writes
files it lacks into its folder and records in ``job.json`` who sent what; other ranks' ``job.json``
names rank 0's host and folder. Nothing is published without a process group of more than one rank.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import sys
import time
from typing import Any, Iterable

import torch.distributed as dist

from .._compat import c10d as c10c
from ..distributed.at_exit import at_exit
from .files import atomic_write_json

log = logging.getLogger(__name__)

JOB_FILE = "job.json"
GATHER_TIMEOUT_ENV = "BUCKETWISE_STATS_GATHER_TIMEOUT"
DEFAULT_GATHER_TIMEOUT_S = 60.0
_STORE_TIMEOUT = datetime.timedelta(seconds=30)
_POLL_S = 0.1


class _Publisher:
    """This process's entry in the job's store (one per process: the first stats folder)."""

    def __init__(self, stats_dir: str, store: Any, rank: int, world: int) -> None:
        self.stats_dir = stats_dir
        self.store = store
        self.rank = rank
        self.world = world
        self.host = socket.gethostname()
        self.files: dict[str, dict[str, Any]] = {}
        self.broken = False
        self.finished = False

    def entry(self, final: bool) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "stats_dir": self.stats_dir, "final": final, "files": self.files}

    def send(self, final: bool) -> None:
        if self.broken:
            return
        try:
            self.store.set(f"rank{self.rank}", json.dumps(self.entry(final)))
            if final:
                self.store.set(f"rank{self.rank}/final", "1")
        except Exception as exc:  # noqa: BLE001 - the job goes on; only the job-wide table suffers
            self.broken = True
            log.warning(
                "bucketwise: could not publish rank %d's report to the job's store (%s: %s); "
                "the job-wide table will lack it",
                self.rank,
                type(exc).__name__,
                exc,
            )


_publisher: _Publisher | None = None


def publish(stats_dir: str, relpath: str, data: dict[str, Any]) -> None:
    """Send ``data`` (the file written at ``stats_dir/relpath``) to the job's store."""
    global _publisher
    stats_dir = os.path.abspath(stats_dir)
    if _publisher is None:
        _publisher = _open(stats_dir)
        if _publisher is None:
            return
        at_exit("job stats", finish)
    if _publisher.stats_dir != stats_dir or _publisher.finished:
        return
    _publisher.files[relpath.replace(os.sep, "/")] = data
    _publisher.send(final=False)


def _open(stats_dir: str) -> _Publisher | None:
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    store = c10c.default_store()
    if store is None:
        return None
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"bucketwise/stats/{restart}/"
    return _Publisher(stats_dir, dist.PrefixStore(prefix, _own_client(store)), dist.get_rank(), dist.get_world_size())


def _own_client(store: Any) -> Any:
    """A client of the store's TCP server of our own (it outlives ``destroy_process_group()``
    and has a short timeout); the store itself when it is not a TCP store."""
    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    if not isinstance(inner, dist.TCPStore):
        return store
    try:
        return dist.TCPStore(inner.host, inner.port, is_master=False, timeout=_STORE_TIMEOUT, wait_for_workers=False)
    except Exception as exc:  # noqa: BLE001
        log.debug("bucketwise: no client of the job's TCP store of our own (%s); using the default store", exc)
        return store


def finish() -> None:
    """At interpreter exit: the last writes, the final entry, and rank 0's gather."""
    pub = _publisher
    if pub is None or pub.finished:
        return
    # A profile still open and reports not yet written (NOTE [at-exit order]) have written their
    # files (and handed them to publish()) before this runs.
    try:
        pub.finished = True
        pub.send(final=True)
        if pub.broken:
            return
        if pub.rank == 0:
            _gather(pub, wait_s=0.0 if _exiting_on_exception() else _gather_timeout())
        else:
            _point_at_rank0(pub)
    except Exception as exc:  # noqa: BLE001 - at exit: say it, never mask the job's own end
        log.warning("bucketwise: the job-wide stats were not completed: %s: %s", type(exc).__name__, exc)


def _gather_timeout() -> float:
    text = os.environ.get(GATHER_TIMEOUT_ENV)
    if not text:
        return DEFAULT_GATHER_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        log.warning(
            "bucketwise: $%s=%r is not a number of seconds >= 0; using %s",
            GATHER_TIMEOUT_ENV,
            text,
            DEFAULT_GATHER_TIMEOUT_S,
        )
        return DEFAULT_GATHER_TIMEOUT_S
    return value


def _exiting_on_exception() -> bool:
    # Python sets these when an unhandled exception ended the script, before atexit runs.
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


def _gather(pub: _Publisher, wait_s: float) -> None:
    others = [r for r in range(pub.world) if r != pub.rank]
    deadline = time.monotonic() + wait_s
    final: set[int] = set()
    try:
        while True:
            final.update(r for r in others if r not in final and pub.store.check([f"rank{r}/final"]))
            if len(final) == len(others) or time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
        entries = {r: json.loads(pub.store.get(f"rank{r}")) for r in others if pub.store.check([f"rank{r}"])}
    except Exception as exc:  # noqa: BLE001
        log.warning(
            "bucketwise: could not read the other ranks' reports from the job's store (%s: %s)", type(exc).__name__, exc
        )
        return
    for entry in entries.values():
        for rel, data in entry.get("files", {}).items():
            _write_if_absent(pub.stats_dir, rel, data)
    ranks = {str(pub.rank): _summary(pub.entry(final=True))}
    ranks.update({str(r): _summary(e) for r, e in sorted(entries.items())})
    _write_job(
        pub,
        {"rank": pub.rank, "host": pub.host, "stats_dir": pub.stats_dir},
        ranks=ranks,
        not_final=sorted(r for r in entries if r not in final),
        missing=[r for r in others if r not in entries],
        waited_s=wait_s,
    )


def _summary(entry: dict[str, Any]) -> dict[str, Any]:
    return {"host": entry.get("host"), "stats_dir": entry.get("stats_dir"), "final": bool(entry.get("final"))}


def _write_if_absent(stats_dir: str, rel: str, data: Any) -> None:
    rel = os.path.normpath(rel)
    if os.path.isabs(rel) or rel.startswith(".."):
        log.warning("bucketwise: ignoring a gathered file outside the stats folder: %s", rel)
        return
    path = os.path.join(stats_dir, rel)
    if not os.path.exists(path):
        _write_json(path, data)


def _point_at_rank0(pub: _Publisher) -> None:
    """Leave ``job.json`` naming rank 0's folder, unless this folder is rank 0's."""
    try:
        if not pub.store.check(["rank0"]):
            return
        rank0 = json.loads(pub.store.get("rank0"))
    except Exception as exc:  # noqa: BLE001
        log.debug("bucketwise: rank 0's entry is not readable (%s)", exc)
        return
    same = rank0.get("host") == pub.host and rank0.get("stats_dir") == pub.stats_dir
    if same or os.path.exists(os.path.join(pub.stats_dir, "rank0.json")):
        return
    _write_job(pub, {"rank": 0, "host": rank0.get("host"), "stats_dir": rank0.get("stats_dir")})


def _write_job(pub: _Publisher, gathered_by: dict[str, Any], **gathered: Any) -> None:
    job = {"schema": 1, "world_size": pub.world, "gathered_by": gathered_by, **gathered}
    _write_json(os.path.join(pub.stats_dir, JOB_FILE), job)


def _write_json(path: str, data: Any) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write_json(path, data)
    except OSError as exc:
        log.warning("bucketwise: could not write %s: %s", path, exc)


# -- reading job.json back: `bucketwise launch` and `bucketwise stats` -----------------------


def read_job_file(stats_dir: str) -> dict[str, Any] | None:
    """A run folder's ``job.json`` (rank 0's record of the gather, or where rank 0's folder is), or ``None``."""
    try:
        with open(os.path.join(stats_dir, JOB_FILE)) as f:
            job = json.load(f)
    except (OSError, ValueError):
        return None
    return job if isinstance(job, dict) and isinstance(job.get("gathered_by"), dict) else None


def is_elsewhere(stats_dir: str, job: dict[str, Any] | None) -> bool:
    """This folder is not the one the job-wide table was gathered into."""
    return job is not None and "ranks" not in job and not os.path.exists(os.path.join(stats_dir, "rank0.json"))


def job_lines(job: dict[str, Any] | None) -> list[str]:
    """Which ranks' files came through the job's store, from which folders; which did not finish."""
    if job is None or "ranks" not in job:
        return []
    by_folder: dict[tuple[str, str], list[int]] = {}
    for rank, info in job["ranks"].items():
        by_folder.setdefault((info.get("host"), info.get("stats_dir")), []).append(int(rank))
    own = (job["gathered_by"].get("host"), job["gathered_by"].get("stats_dir"))
    parts = [
        f"rank(s) {rank_ranges(r)} from {h}:{d}"
        for (h, d), r in sorted(by_folder.items(), key=lambda x: min(x[1]))
        if (h, d) != own
    ]
    lines = [f"gathered through the job's store: {'; '.join(parts)}"] if parts else []
    if job.get("not_final"):
        when = (
            f"within {job['waited_s']:g} s of rank 0's end (killed, or still running)"
            if job.get("waited_s")
            else "before rank 0 ended with an error"
        )
        lines.append(
            f"warning: rank(s) {rank_ranges(job['not_final'])} sent no final report {when}: "
            "the last one they sent (after a compile) is shown"
        )
    if job.get("missing"):
        lines.append(f"warning: nothing from rank(s) {rank_ranges(job['missing'])} reached the job's store")
    return lines


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out: list[list[int]] = []
    for r in sorted(set(ranks)):
        if out and out[-1][1] == r - 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in out)
