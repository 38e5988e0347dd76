"""Graphs kept on disk next to torch's compile caches, and carried in torch's compile artifacts.

Checked on torch 2.11.0 (device machines), 2.13.0, 2.14.1 and 2.15.0 (CPU).

NOTE [block split cache]: a restart finds Inductor's compiled graphs in its cache (or in the
job's compile artifacts, NOTE [compile artifacts]), but AOTAutograd's split of a shared block
into a forward and a backward graph (``partition``) is bucketwise's own call, which torch's
caches do not keep: every restart traced and partitioned the block again (3.5 to 4 s of a
10 s warm first step of a 32-layer HF Llama on one H200). The split is kept here: its two
graphs, with each node's fake value, pickled by torch's ``GraphPickler`` (the format of
Inductor's own graph cache) in ``<Inductor's cache directory>/bucketwise_block_split/``, under a
key made by the caller of everything the split depends on. Each entry written or read is also
recorded as an artifact of torch's (type ``bucketwise_block_split``), so
``torch.compiler.save_cache_artifacts`` carries it and ``load_cache_artifacts`` writes it
back on another machine. The cache is off where AOTAutograd's is (``enable_autograd_cache``,
``force_disable_caches``). A graph with an operator outside torch's own namespaces is not
kept.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.compiler._cache import CacheArtifact, CacheArtifactFactory, CacheArtifactManager

log = logging.getLogger(__name__)

ARTIFACT_TYPE = "bucketwise_block_split"
_OPS = ("torch.ops.aten.", "torch.ops.prims.")


@CacheArtifactFactory.register
class _BlockSplitArtifact(CacheArtifact):
    def populate_cache(self) -> None:
        _write(self.key, self.content)

    @staticmethod
    def type() -> str:
        return ARTIFACT_TYPE


def enabled() -> bool:
    return bool(torch._functorch.config.enable_autograd_cache) and not torch._inductor.config.force_disable_caches


def digest(text: str) -> str:
    """A cache key of ``text`` (what the cached graphs are of, as the caller wrote it), torch's
    version, AOTAutograd's and Inductor's settings (the partitioner's, the decompositions'), and
    this file's format."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    settings = [sorted(c.save_config_portable().items()) for c in (functorch_config, inductor_config)]
    return hashlib.sha256(f"{torch.__version__}\x00{_FORMAT}\x00{settings!r}\x00{text}".encode()).hexdigest()


def load(key: str, fake_mode: Any) -> tuple[fx.GraphModule, ...] | None:
    """The graphs stored under ``key``, their values fake tensors of ``fake_mode``; ``None`` if
    there are none (or they do not load: then they are recomputed and stored again)."""
    from torch.fx._graph_pickler import GraphPickler

    path = _path(key)
    if not path.is_file():
        return None
    data = path.read_bytes()
    try:
        graphs = GraphPickler.loads(data, fake_mode)
    except Exception as exc:  # noqa: BLE001 - a stale or damaged entry is a miss
        log.warning(
            "bucketwise: the cached block split %s did not load (%s: %s); splitting again",
            path,
            type(exc).__name__,
            exc,
        )
        return None
    CacheArtifactManager.record_artifact(ARTIFACT_TYPE, key, data)
    return tuple(graphs)


def store(key: str, graphs: tuple[fx.GraphModule, ...]) -> str | None:
    """Keep ``graphs`` under ``key``; ``None``, or why they are not kept."""
    from torch.fx._graph_pickler import GraphPickler, Options

    try:
        data = GraphPickler.dumps(graphs, Options(ops_filter=lambda name: name.startswith(_OPS)))
    except Exception as exc:  # noqa: BLE001 - a graph that does not pickle is only not kept
        return f"its graphs do not pickle ({type(exc).__name__}: {exc})"[:200]
    _write(key, data)
    CacheArtifactManager.record_artifact(ARTIFACT_TYPE, key, data)
    return None


_FORMAT = "1"


def _path(key: str) -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / ARTIFACT_TYPE / key[:2] / key


def _write(key: str, data: bytes) -> None:
    path = _path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_bytes(data)
    partial.replace(path)
