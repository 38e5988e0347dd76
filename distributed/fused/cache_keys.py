"""Stable compile-cache keys for what bucketwise puts into compiled graphs.

NOTE [compile cache keys]: a second process over the same Inductor cache dir (a restart) should
load its compiled graphs instead of compiling them again. Inductor's FX graph cache and
AOTAutograd's cache key a graph by its content, the config and the code behind anything the
graph calls. What bucketwise adds must take part in that key, or the cache is bypassed (every
restart pays AOTAutograd's trace and partition again) or, worse, a stale entry is loaded after
bucketwise's code changed:

- the fused graph pass inserts calls of ``fused/sync.bucket_sync`` and ``fused/embedding_rows.embedding_rows``
  (autograd.Functions AOTAutograd traces into the forward and backward). AOTAutograd's cache
  accepts only call targets it knows to be safe; these are declared safe through Inductor's
  ``unsafe_marked_cacheable_functions`` option, scoped to bucketwise's own compiles, with a key
  that changes whenever the code they trace changes (:func:`traced_call_targets`);
- the scheduler pass handed to Inductor (``_compat/collectives.sink_waits_to_consumers``) is an
  object whose pickled form (what the FX graph cache hashes) carries the same kind of key.

A key is the hash of the source files of the modules whose code ends up in the compiled graph.

Two compiles still pay AOTAutograd again on a restart (the FX graph cache still serves Inductor's
part): the segments of ``split``, compiled with ``fakify_first_call`` so that each segment sees
the strides the previous one really produces, which AOTAutograd's cache refuses (torch's own
DDPOptimizer does the same, with the same cost); and ``cudagraphs=True``, whose inner compile
wraps every compiled graph in a CUDA-graph runner, which a cache hit would skip.
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
