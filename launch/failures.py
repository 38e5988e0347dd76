"""Which rank broke a job, and why, from the per-rank logs torchrun keeps in the stats folder: the
ranks whose stderr holds a traceback raised (torchrun stops the others with SIGTERM, leaving none).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from typing import Sequence

_RANK_PREFIX = re.compile(r"^\[[A-Za-z]*\d+\]:\s?")
# Errors a rank gets because a peer died first (its own failure is a consequence).
_FOLLOW_ON = re.compile(
    r"Connection closed by peer|remote worker crash|Connection reset by peer|Broken pipe|"
    r"communicator was aborted|ProcessGroup\w* .*abort|Socket Timeout",
    re.IGNORECASE,
)
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Failed|Interrupt|Exit)\w*(: |:?$)")
LOG_OPTIONS = ("--log-dir", "--log_dir", "--tee", "--redirects", "-r", "-t")


@dataclasses.dataclass(frozen=True)
class RankFailure:
    local_rank: int
    attempt: int
    error: str
    """The exception line that ended the rank (``RuntimeError: ...``)."""
    log: str

    @property
    def follow_on(self) -> bool:
        """The rank failed because a peer had failed (a collective saw it die)."""
        return bool(_FOLLOW_ON.search(self.error))


def log_options(user_options: Sequence[str], stats_dir: str) -> list[str]:
    """Options putting per-rank logs in ``<stats_dir>/logs``, unless the user set log options."""
    if any(opt.split("=", 1)[0] in LOG_OPTIONS for opt in user_options):
        return []
    return ["--log-dir", os.path.join(stats_dir, "logs"), "--tee", "3"]


def find_failures(log_dir: str) -> list[RankFailure]:
    """Ranks of the last attempt whose stderr ends in a Python traceback."""
    attempts = sorted(glob.glob(os.path.join(glob.escape(log_dir), "*", "attempt_*")), key=_attempt_number)
    if not attempts:
        return []
    last = attempts[-1]
    failures = []
    for path in sorted(glob.glob(os.path.join(glob.escape(last), "*", "stderr.log"))):
        error = _last_exception(path)
        if error:
            local_rank = int(os.path.basename(os.path.dirname(path)))
            failures.append(RankFailure(local_rank, _attempt_number(last), error, path))
    return failures


def _attempt_number(path: str) -> int:
    return int(path.rsplit("attempt_", 1)[1])


def _last_exception(path: str) -> str | None:
    try:
        with open(path, errors="replace") as f:
            # torch prefixes a rank's uncaught-exception lines with "[rankN]: ".
            lines = [_RANK_PREFIX.sub("", line.rstrip()) for line in f]
    except OSError:
        return None
    if not any(line.startswith("Traceback (most recent call last)") for line in lines):
        return None
    # The last "SomeError: message" line: the innermost cause (Dynamo appends its own hints
    # after a backend error, and wraps it as "BackendCompilerFailed: ... raised:").
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line):
            return line[:300]
    for line in reversed(lines):
        if line and not line.startswith((" ", "\t")) and not line.startswith("Traceback"):
            return line[:300]
    return None


def describe(failures: Sequence[RankFailure], code: int) -> list[str]:
    if not failures:
        return [f"bucketwise: the job failed with exit code {code} (no rank left a Python traceback)"]
    lines = [f"bucketwise: the job failed with exit code {code}"]
    for f in sorted(failures, key=lambda f: (f.follow_on, f.local_rank)):
        what = "failed after a peer's failure:" if f.follow_on else "raised"
        lines.append(f"bucketwise: local rank {f.local_rank} (attempt {f.attempt}) {what} {f.error}")
        lines.append(f"bucketwise:   its log: {f.log}")
    return lines
