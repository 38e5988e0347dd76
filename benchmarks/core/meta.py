"""What every benchmark result records about its run: when, where, with what, by which command."""

from __future__ import annotations

import datetime
import hashlib
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


def source_tree(root: Path | None = None) -> str | None:
    """The git tree hash of the files the checkout at ``root`` (default: this one) holds (tracked,
    and untracked ones git does not ignore), as they are on disk; ``None`` outside git.

    NOTE [the code a result ran]: a result's ``git`` names the checkout's commit, which is not
    the code that ran where the files were copied over another checkout (a GPU machine's copy of
    a working tree keeps its own, older ``.git``). This hash is computed from the files
    themselves, the way git hashes a tree, so for a clean checkout it equals that commit's
    ``git rev-parse COMMIT^{tree}``: ``git log --format='%h %T' | grep TREE`` finds the commit that
    ran, and no commit matches code that was never committed."""
    root = root or Path(__file__).resolve().parents[2]
    try:
        listed = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    tree: dict[str, Any] = {}
    for path in sorted(set(listed.decode().split("\0")) - {""}):
        file = root / path
        if file.is_symlink():
            entry = ("120000", os.readlink(file).encode())
        elif file.is_file():
            entry = ("100755" if os.access(file, os.X_OK) else "100644", file.read_bytes())
        else:  # listed by an older index, gone from the disk
            continue
        *dirs, name = path.split("/")
        node = tree
        for d in dirs:
            node = node.setdefault(d, {})
        node[name] = (entry[0], _git_hash(b"blob", entry[1]))
    return _tree_hash(tree).hex() if tree else None


def _git_hash(kind: bytes, data: bytes) -> bytes:
    return hashlib.sha1(kind + b" " + str(len(data)).encode() + b"\0" + data).digest()  # noqa: S324 - git's hash


def _tree_hash(tree: dict[str, Any]) -> bytes:
    """Git's tree object hash: entries ordered by name, a folder's name compared with a ``/`` after it."""
    entries = []
    for name, value in tree.items():
        if isinstance(value, dict):
            entries.append((name + "/", b"40000 " + name.encode() + b"\0" + _tree_hash(value)))
        else:
            mode, digest = value
            entries.append((name, mode.encode() + b" " + name.encode() + b"\0" + digest))
    return _git_hash(b"tree", b"".join(e for _, e in sorted(entries)))


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
    process's own), machine, GPU, versions, commit and the code's tree (NOTE [the code a result
    ran])."""
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
        "source_tree": source_tree(),
        **versions(),
    }
