"""Running torchrun so that Ctrl-C stops every rank of the job within seconds, with one line.

NOTE [stopping a job]: torchrun's agent forwards SIGINT to the ranks and waits 30 s before SIGKILL,
but a rank does not always stop on SIGINT (Python swallows a ``KeyboardInterrupt`` in ``__del__``
or a weakref callback; a C++ call sees it only on return). So ``bucketwise launch`` runs torchrun
in a session of its own and owns the signal: on SIGINT, SIGTERM or SIGHUP it prints one line,
freezes the agent (SIGSTOP) and signals every rank's process group (compile workers included); a
rank still there after :data:`INTERRUPT_GRACE_S` gets SIGTERM, after :data:`TERM_GRACE_S` more
SIGKILL (a second Ctrl-C skips the wait). It exits with 128 + the signal's number. Ranks are found
as the agent's children through ``/proc`` (Linux); elsewhere the agent stops them itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Sequence

INTERRUPT_GRACE_S = 3.0
"""Seconds a rank has to end after SIGINT before it gets SIGTERM."""
TERM_GRACE_S = 2.0
"""Seconds a rank has to end after SIGTERM before it gets SIGKILL."""
_POLL_S = 0.05
_HANDLED = ("SIGINT", "SIGTERM", "SIGHUP")


class Interrupted(Exception):
    """The job was stopped on a signal; ``code`` is the launcher's exit code (128 + signal)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def run(cmd: Sequence[str], env: dict[str, str], *, logs: str | None = None) -> int:
    """``cmd``'s exit code; :class:`Interrupted` when stopped (NOTE [stopping a job])."""
    received: list[int] = []
    handled = [getattr(signal, name) for name in _HANDLED if hasattr(signal, name)]
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in handled}
    try:
        proc = subprocess.Popen(list(cmd), env=env, start_new_session=True)
        while not received:
            try:
                return proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                continue
        code = proc.poll()
        if code is not None:  # the job ended at that moment on its own
            return code
        _stop(proc, received, logs)
        raise Interrupted(128 + received[0])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _stop(proc: subprocess.Popen, received: list[int], logs: str | None) -> None:
    first = received[0]
    name = "Ctrl-C" if first == signal.SIGINT else signal.Signals(first).name
    where = f"; their logs: {logs}" if logs and os.path.isdir(logs) else ""
    print(
        f"bucketwise: interrupted ({name}): stopping every rank (SIGTERM after {INTERRUPT_GRACE_S:g} s, SIGKILL "
        f"after {INTERRUPT_GRACE_S + TERM_GRACE_S:g} s){where}",
        file=sys.stderr,
        flush=True,
    )
    agent = proc.pid
    frozen = _send(agent, signal.SIGSTOP, group=False)
    ranks = _children(agent) if frozen else None
    if ranks is None:  # no /proc: the agent stops its ranks itself
        if frozen:
            _send(agent, signal.SIGCONT, group=False)
        _send(agent, first, group=False)
        _wait(proc, INTERRUPT_GRACE_S + TERM_GRACE_S + 30, received)
        _send(agent, signal.SIGKILL, group=True)
        proc.wait()
        return
    steps = [(first, INTERRUPT_GRACE_S), (signal.SIGKILL, 0.0)]
    if first != signal.SIGTERM:
        steps.insert(1, (signal.SIGTERM, TERM_GRACE_S))
    for sig, grace in steps:
        alive = [pid for pid in ranks if _running(pid)]
        if not alive:
            break
        for pid in alive:
            _send(pid, sig, group=True)
        seen = len(received)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and len(received) == seen and any(_running(pid) for pid in alive):
            time.sleep(_POLL_S)
    _send(agent, signal.SIGKILL, group=True)  # the agent, and whatever else is in its group
    proc.wait()


def _wait(proc: subprocess.Popen, seconds: float, received: list[int]) -> None:
    seen = len(received)
    deadline = time.monotonic() + seconds
    while proc.poll() is None and time.monotonic() < deadline and len(received) == seen:
        time.sleep(_POLL_S)


def _send(pid: int, sig: int, *, group: bool) -> bool:
    """Whether ``pid`` was there to get ``sig`` (with ``group``: its process group too)."""
    there = False
    if group:
        try:
            os.killpg(pid, sig)
            there = True
        except (ProcessLookupError, PermissionError):
            pass  # not a group leader (yet): a process forked but not yet in its own session
    try:
        os.kill(pid, sig)
        there = True
    except (ProcessLookupError, PermissionError):
        pass
    return there


def _children(pid: int) -> list[int] | None:
    """The child processes of ``pid`` (``None`` without ``/proc``)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    out = []
    for entry in entries:
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[1] == pid:
                out.append(int(entry))
    return out


def _stat(pid: int) -> tuple[str, int] | None:
    """``(state, parent pid)`` of ``pid`` from ``/proc/<pid>/stat``, ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # after "pid (comm) ": the name may hold anything
    return fields[0], int(fields[1])


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (a rank that ended but its frozen parent has not reaped)."""
    stat = _stat(pid)
    if stat is not None:
        return stat[0] not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return not os.path.isdir("/proc")  # /proc exists but has no entry: gone
