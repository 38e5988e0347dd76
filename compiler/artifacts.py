"""Compiled artifacts carried with a job: a restart on a machine with an empty compile cache starts warm.

NOTE [compile artifacts]: a restart on empty local caches recompiles everything. With
``artifacts=DIR`` (or ``BUCKETWISE_COMPILE_ARTIFACTS``) each rank keeps
``DIR/rank{R}.bin`` (``torch.compiler.save_cache_artifacts``), loaded into the local caches when
the compiled object is made, and written at the second call where nothing was loaded or the
first step still missed a cache. Dynamo's trace is not an artifact: a restart traces again
(NOTE [Dynamo calls a block]). The report's notes say what was loaded and saved.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

ENV = "BUCKETWISE_COMPILE_ARTIFACTS"


@dataclasses.dataclass(eq=False)
class Artifacts:
    """One rank's compiled-artifacts file (NOTE [compile artifacts])."""

    path: Path
    loaded: dict[str, int] | None = None
    """What was loaded from ``path`` (entries per kind), ``None`` if nothing."""
    decided: bool = False
    """Whether the after-first-step save was decided (done or not needed): never looked at again."""

    def load(self) -> str:
        """Fill the local caches from the file, if there is one; says what happened."""
        if not self.path.is_file():
            return f"compile artifacts: none at {self.path} yet; they are saved after the first step"
        info = torch.compiler.load_cache_artifacts(self.path.read_bytes())
        self.loaded = _counts(info)
        return f"compile artifacts: loaded {self.path} ({_describe(self.loaded)})"

    def should_save(self, cache_misses: int) -> bool:
        return self.loaded is None or cache_misses > 0

    def save(self) -> str:
        """Write every artifact this process has compiled or loaded so far."""
        out = torch.compiler.save_cache_artifacts()
        if out is None:
            return f"compile artifacts: nothing to save to {self.path} (no compile went through torch's caches)"
        data, info = out
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + f".{os.getpid()}.partial")
        partial.write_bytes(data)
        partial.replace(self.path)
        return f"compile artifacts: saved {self.path} ({_describe(_counts(info))}, {len(data) / 2**20:.1f} MiB)"


def artifacts_for(directory: str | os.PathLike | None) -> Artifacts | None:
    """This rank's artifacts in ``directory`` (else ``BUCKETWISE_COMPILE_ARTIFACTS``), or ``None``."""
    directory = directory if directory is not None else os.environ.get(ENV) or None
    if directory is None:
        return None
    return Artifacts(path=Path(directory) / f"rank{_rank()}.bin")


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def _counts(info: Any) -> dict[str, int]:
    if info is None:
        return {}
    kinds = ("inductor_artifacts", "aot_autograd_artifacts", "autotune_artifacts", "pgo_artifacts")
    return {kind.removesuffix("_artifacts"): len(getattr(info, kind, None) or ()) for kind in kinds}


def _describe(counts: dict[str, int]) -> str:
    names = {"inductor": "Inductor", "aot_autograd": "AOTAutograd", "autotune": "autotuning", "pgo": "PGO"}
    return ", ".join(f"{n} {names[k]}" for k, n in counts.items() if n) or "no entries"
