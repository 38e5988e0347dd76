"""What every benchmark result records about its run: when, where, with what, by which command."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import torch


def git_revision() -> str | None:
    """The checkout's short commit, ``-dirty`` with uncommitted changes; ``None`` outside git."""
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + ("-dirty" if dirty else "")) or None


def versions() -> dict[str, str | None]:
    """torch, its CUDA and Triton, Python (and whether it runs torch from cached bytecode: NOTE
    [compiled bytecode]) and bucketwise."""
    import bucketwise
    from bucketwise.stats import bytecode

    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "bucketwise": bucketwise.__version__,
        "python_bytecode": bytecode.torch_bytecode().state.value,
    }


def run_meta(*, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The run's date, exact command (``argv``: as it should be written down; default: this
    process's own), machine, GPU, versions and commit."""
    cuda = torch.cuda.is_available()
    command = shlex.join(argv) if argv is not None else shlex.join(getattr(sys, "orig_argv", sys.argv))
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command,
        "device": "cuda" if cuda else "cpu",
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpus": torch.cuda.device_count() if cuda else 0,
        "cpu": f"{os.cpu_count()} cores, {platform.machine()}",
        "host": socket.gethostname(),
        "git": git_revision(),
        **versions(),
    }
