"""Compile progress on rank 0: a live line on a terminal, plain lines in logs.

``BUCKETWISE_PROGRESS=0`` turns it off; ``=1`` forces it on every rank.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Iterator, TextIO

import torch.distributed as dist

_ENV = "BUCKETWISE_PROGRESS"


def _enabled() -> bool:
    setting = os.environ.get(_ENV, "auto").lower()
    if setting in ("0", "false", "off", "no"):
        return False
    if setting in ("1", "true", "on", "yes"):
        return True
    return not dist.is_initialized() or dist.get_rank() == 0


class Progress:
    """Reports each compile step as ``[bucketwise] graph 0: segment 3/12, inductor, 4.1 s``."""

    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = _enabled()
        self.live = self.enabled and hasattr(self.stream, "isatty") and self.stream.isatty()

    @contextlib.contextmanager
    def step(self, what: str, backend: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        if self.live:
            self.stream.write(f"\r[bucketwise] {self.label}: {what}, {backend} ...\x1b[K")
            self.stream.flush()
        try:
            yield
        finally:
            line = f"[bucketwise] {self.label}: {what}, {backend}, {time.perf_counter() - start:.1f} s"
            self.stream.write(("\r" + line + "\x1b[K\n") if self.live else line + "\n")
            self.stream.flush()
