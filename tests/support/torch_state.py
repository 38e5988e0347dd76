"""What a test may not leave behind in the interpreter it shares with later tests.

torch keeps its compile settings in config modules (``torch._dynamo.config``,
``torch._inductor.config``, ``torch._functorch.config``, ...). A test changes one only through
the module's own ``patch()`` (a context manager or decorator that restores it). ``monkeypatch``
is not a substitute: since pytest 9.2 its undo deletes an attribute that was not in the module's
``__dict__``, and a config option never is, so the option is gone for every later compile in
that worker. conftest.py compares a snapshot taken before and after every test and fails the
test that changed or removed an option, and does the same for the rest of what tests share:
environment variables, torch's global modes, global module hooks, a process group left behind.
"""

from __future__ import annotations

import os
import sys
from typing import Any

Snapshot = dict[str, dict[str, Any]]


def config_modules() -> dict[str, Any]:
    """Every torch config module imported so far, by name (the modules torch builds with
    ``install_config_module``: they have ``get_config_copy`` and ``patch``)."""
    return {
        name: module
        for name, module in list(sys.modules.items())
        if name.split(".")[0] == "torch"
        and callable(getattr(type(module), "get_config_copy", None))
        and callable(getattr(type(module), "patch", None))
    }


def config_snapshot() -> Snapshot:
    """Every option of every torch config module imported so far, copied."""
    return {name: module.get_config_copy() for name, module in config_modules().items()}


def config_changes(before: Snapshot, after: Snapshot) -> list[str]:
    """Options of ``before`` that ``after`` lacks or holds with another value, one line each.
    Modules first imported in between are not compared (they were not there before)."""
    out = []
    for name, options in before.items():
        now = after.get(name)
        if now is None:
            out.append(f"{name} is no longer a config module")
            continue
        for key, value in options.items():
            if key not in now:
                out.append(f"{name}.{key} is missing (it was {value!r})")
            elif not _same(value, now[key]):
                out.append(f"{name}.{key} changed from {value!r} to {now[key]!r}")
    return out


def process_snapshot() -> dict[str, Any]:
    """The rest of what tests share in one interpreter: environment variables, torch's global
    modes, hooks on every module, a process group left behind."""
    import torch
    import torch.distributed as dist

    from bucketwise._compat import hooks as hc

    return {
        "environment": {k: v for k, v in os.environ.items() if not _set_by_a_library(k)},
        "default dtype": torch.get_default_dtype(),
        "grad mode": torch.is_grad_enabled(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "threads": torch.get_num_threads(),
        "global module hooks": {kind: len(d) for kind, d in hc.global_module_hook_dicts()},
        "process group": dist.is_available() and dist.is_initialized(),
    }


def _set_by_a_library(name: str) -> bool:
    """Variables set by pytest itself, by Inductor at its first compile in a process (on CUDA
    also Triton's cache directory and ``ptxas`` path, ``TRITON_CACHE_DIR``, ``TRITON_PTXAS_PATH``),
    and by Lightning when it is first imported (``PYTORCH_NVML_BASED_CUDA_CHECK``): not a test's
    doing."""
    return name.startswith(("PYTEST_", "_TORCHINDUCTOR_", "TRITON_")) or name == "PYTORCH_NVML_BASED_CUDA_CHECK"


def process_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    out = []
    for key, value in before.items():
        if key == "environment":
            changed = sorted(k for k in set(value) | set(after[key]) if value.get(k) != after[key].get(k))
            out += [f"environment variable {k}: {value.get(k)!r} -> {after[key].get(k)!r}" for k in changed]
        elif not _same(value, after[key]):
            out.append(f"{key}: {value!r} -> {after[key]!r}")
    return out


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value without a usable ==: compare identities
        return a is b
