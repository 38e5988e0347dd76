"""Private torch.distributed (c10d) state bucketwise reads. Checked on torch 2.11.0 and 2.13.0:
``destroy_process_group()`` calls ``shutdown()`` on every group of ``_world.pg_names``, last name
first, and removes it from there (2.13.0); ``_get_default_store()`` returns the store wrapped in
``PrefixStore("default_pg", ...)``; ``new_group()`` asks a group for the backend of the default
group's ``bound_device_id``, which a Python ``ProcessGroup`` subclass lacks; a group's gloo backend
(``_get_backend(device)``) keeps its worker-thread count in ``options._threads`` (2.13.0, 2.14.1,
2.15.0).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator


def shuts_down_before(first: Any, then: Any) -> bool:
    """Does ``destroy_process_group()`` shut ``first`` down before ``then``?"""
    from torch.distributed import distributed_c10d as c10d

    names = c10d._world.pg_names
    if first not in names or then not in names:
        return False
    return names[first] > names[then]


def registered(pg: Any) -> bool:
    """Not destroyed: a destroyed group still answers ``get_world_size``, but functional
    collectives, which find it by its registered name, do not."""
    from torch.distributed import distributed_c10d as c10d

    return pg in c10d._world.pg_names


def gloo_threads(pg: Any, device: Any) -> int | None:
    """The worker threads of ``pg``'s gloo backend for ``device``, which also run its futures'
    callbacks; ``None`` where that backend is not gloo."""
    import torch.distributed as dist

    try:
        backend = pg._get_backend(device)
        if not isinstance(backend, getattr(dist, "ProcessGroupGloo", ())):
            return None
        return int(backend.options._threads)
    except (AttributeError, RuntimeError, ValueError):
        return None


def default_store() -> Any | None:
    """The default process group's store, or ``None`` without one."""
    from torch.distributed import distributed_c10d as c10d

    try:
        return c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


@contextlib.contextmanager
def default_device_unbound() -> Iterator[None]:
    """Within, the default group has no ``device_id``, so ``new_group()`` takes a Python backend."""
    from torch.distributed import distributed_c10d as c10d

    default = c10d._get_default_group()
    bound, default.bound_device_id = default.bound_device_id, None
    try:
        yield
    finally:
        default.bound_device_id = bound
