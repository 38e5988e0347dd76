"""Stable compile-cache keys for what bucketwise puts into compiled graphs.

NOTE [compile cache keys]: a restart over the same Inductor cache dir should load its compiled
graphs. Inductor's FX graph cache and AOTAutograd's cache key a graph by its content, the config
and the code behind what it calls, so what bucketwise adds must take part in that key, or the
cache is bypassed or, worse, a stale entry loads after bucketwise's code changed. The calls of
``sync.bucket_sync`` and ``embedding_rows.embedding_rows`` are declared safe through Inductor's
``unsafe_marked_cacheable_functions``, scoped to bucketwise's compiles, and the scheduler pass
handed to Inductor pickles, both keyed by the hash of the source files whose code ends up in the
graph. ``split``'s segments (``fakify_first_call``, which AOTAutograd's cache refuses) and
``cudagraphs=True`` (a hit would skip the CUDA-graph wrapper) still pay AOTAutograd on a restart.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from types import ModuleType


@functools.lru_cache(maxsize=None)
def _file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def source_key(*modules: ModuleType) -> str:
    """A short hash of the source files of ``modules`` (read once per process)."""
    h = hashlib.sha256()
    for module in modules:
        path = inspect.getsourcefile(module)
        if path is None:
            raise AssertionError(f"expected a source file for module {module.__name__}, got none")
        h.update(module.__name__.encode())
        h.update(_file_digest(path).encode())
    return "bucketwise-" + h.hexdigest()[:32]


def traced_call_targets() -> dict[str, str]:
    """``module.function`` name -> cache key of every function the fused graph passes insert as a
    ``call_function`` target (the names AOTAutograd's cache checks a graph's calls against)."""
    from ..._compat import collectives as cc
    from . import embedding_rows, sync

    key = source_key(sync, embedding_rows, cc)
    return {f"{fn.__module__}.{fn.__name__}": key for fn in (sync.bucket_sync, embedding_rows.embedding_rows)}


def comm_pass_key() -> str:
    """The cache key of the comm scheduler pass (``_compat/collectives.py``) handed to Inductor."""
    from ..._compat import collectives as cc

    return source_key(cc)
