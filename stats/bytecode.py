"""Whether torch's compile stack runs from cached bytecode or is compiled again in every process.

NOTE [compiled bytecode]: where Python may not cache bytecode (``PYTHONDONTWRITEBYTECODE``, a
read-only installation), every process recompiles every module it imports; Dynamo, AOTAutograd
and Inductor are large and imported at the first compile, so each rank pays it at start, first
step and every restart. :func:`torch_bytecode` checks a few of those modules: up-to-date bytecode
(the cached header, as Python checks it) or, if not, whether Python will keep what it compiles.
``bucketwise.compile`` warns (on local rank 0: a fact of the machine) and names the fix; the
report's totals say which case it is (``python_bytecode``).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import os
import sys

SAMPLES = (
    "_dynamo/symbolic_convert.py",
    "_functorch/partitioners.py",
    "_inductor/lowering.py",
    "_inductor/scheduler.py",
)
"""Large modules of torch (paths inside its package) that every first compile imports."""
COMPILE_ONCE = "python -m compileall -q -j 0 <site-packages>"
"""The fix, once per installation, as the report and ``bucketwise stats`` name it."""


class BytecodeState(str, enum.Enum):
    CACHED = "cached"
    """Every sampled module has up-to-date bytecode."""
    SAVED_AT_FIRST_IMPORT = "saved at the first import"
    """Some have none yet, and Python will cache what it compiles: the first process pays once."""
    EVERY_PROCESS = "compiled from source in every process"
    """Some have none, and Python may not cache it: every process pays again."""


@dataclasses.dataclass(frozen=True)
class Bytecode:
    """What :func:`check` found for one package."""

    state: BytecodeState
    package: str
    """The package's folder."""
    missing: tuple[str, ...] = ()
    """The sampled modules (paths inside ``package``) without up-to-date bytecode."""
    kept_from: str | None = None
    """Why Python does not cache what it compiles (``EVERY_PROCESS`` only)."""
    keep: str | None = None
    """What lets Python cache it (``EVERY_PROCESS`` only)."""

    def warning(self) -> str | None:
        """The warning ``bucketwise.compile`` gives, or ``None`` where there is nothing to fix."""
        if self.state is not BytecodeState.EVERY_PROCESS:
            return None
        site = os.path.dirname(self.package)
        return (
            f"bucketwise: Python compiles torch's modules from source in every process here: "
            f"{len(self.missing)} of {len(SAMPLES)} of the compile modules checked have no up-to-date "
            f"bytecode (e.g. {os.path.join(self.package, self.missing[0])}) and {self.kept_from}, so every "
            f"rank compiles them again at its start and at its first compile, at every restart "
            f"(NOTE [compiled bytecode]). Fix: compile them once where they are installed, "
            f"`{sys.executable} -m compileall -q -j 0 {site}` (in a container image: after the pip "
            f"install), or let Python keep its bytecode ({self.keep})."
        )


def check(package: str, samples: tuple[str, ...] = SAMPLES) -> Bytecode:
    """Up-to-date bytecode for ``samples`` (paths in ``package``), else whether Python will cache it."""
    missing = tuple(s for s in samples if not _up_to_date(os.path.join(package, s)))
    if not missing:
        return Bytecode(BytecodeState.CACHED, package)
    not_kept = _not_kept(os.path.join(package, missing[0]))
    if not_kept is None:
        return Bytecode(BytecodeState.SAVED_AT_FIRST_IMPORT, package, missing)
    return Bytecode(BytecodeState.EVERY_PROCESS, package, missing, *not_kept)


def torch_bytecode() -> Bytecode:
    """:func:`check` of torch (a few ``stat`` calls, not cached: it follows the process's settings)."""
    import torch

    return check(os.path.dirname(torch.__file__))


def _up_to_date(source: str) -> bool:
    """The cached bytecode of ``source`` is for this Python and, if it records the source's
    modification time and size, matches them (what Python's ``SourceLoader`` checks)."""
    try:
        cached = importlib.util.cache_from_source(source)
        with open(cached, "rb") as f:
            head = f.read(16)
        st = os.stat(source)
    except (OSError, NotImplementedError, ValueError):
        return False
    if len(head) < 16 or head[:4] != importlib.util.MAGIC_NUMBER:
        return False
    if int.from_bytes(head[4:8], "little") & 0b1:
        return True  # hash-based: Python checks the source's hash itself, or not at all
    mtime, size = int.from_bytes(head[8:12], "little"), int.from_bytes(head[12:16], "little")
    return mtime == int(st.st_mtime) & 0xFFFFFFFF and size == st.st_size & 0xFFFFFFFF


def _not_kept(source: str) -> tuple[str, str] | None:
    """Why Python would not cache ``source``'s bytecode and what would let it; ``None`` if it will."""
    if sys.dont_write_bytecode:
        return "PYTHONDONTWRITEBYTECODE is set (or python -B)", "unset PYTHONDONTWRITEBYTECODE"
    folder = os.path.dirname(importlib.util.cache_from_source(source))
    while not os.path.isdir(folder):
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    if not os.access(folder, os.W_OK):
        return f"{folder} is not writable", "point PYTHONPYCACHEPREFIX at a writable folder"
    return None
