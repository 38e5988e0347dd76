"""Where torch keeps the hooks of tensors and modules (private registries).

Checked on torch 2.11.0 (device machines), 2.13.0 and 2.15.0 (CI). Registering any hook makes a
``RemovableHandle``, whose id comes from one process-wide counter, and stores the hook in a dict
keyed by that id.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
"""The hook dicts of an ``nn.Module`` that run around its forward and in its backward."""

_GLOBAL_MODULE_HOOKS = tuple("_global" + kind for kind in MODULE_HOOKS)


def registrations() -> int:
    """The id the next ``RemovableHandle`` gets: unchanged, no hook of any kind was added."""
    return RemovableHandle.next_id


def tensor_hooks(t: torch.Tensor) -> dict[int, Any]:
    """``Tensor.register_hook`` hooks of ``t`` by handle id (they see its gradient first)."""
    return getattr(t, "_backward_hooks", None) or {}


def post_accumulate_hooks(t: torch.Tensor) -> dict[int, Any]:
    """``register_post_accumulate_grad_hook`` hooks of a leaf ``t`` by handle id."""
    return getattr(t, "_post_accumulate_grad_hooks", None) or {}


def tensor_hook_dicts(t: torch.Tensor) -> Iterator[tuple[str, dict[int, Any]]]:
    """Both hook dicts of a parameter, where it has them."""
    for kind in ("_backward_hooks", "_post_accumulate_grad_hooks"):
        hooks = getattr(t, kind, None)
        if hooks is not None:
            yield kind, hooks


def module_hook_dicts(module: nn.Module) -> Iterator[tuple[str, dict[int, Any]]]:
    """A module's forward and backward hook dicts (:data:`MODULE_HOOKS`)."""
    for kind in MODULE_HOOKS:
        hooks = module.__dict__.get(kind)
        if hooks is not None:
            yield kind, hooks


def global_module_hook_dicts() -> Iterator[tuple[str, dict[int, Any]]]:
    """The global module hooks (``register_module_forward_hook``, ...), named as a module's own."""
    from torch.nn.modules import module as module_mod

    for kind in _GLOBAL_MODULE_HOOKS:
        hooks = getattr(module_mod, kind, None)
        if hooks is not None:
            yield kind.replace("_global", ""), hooks


def module_hooks(module: nn.Module) -> list[str]:
    """The kinds of forward and backward hooks ``module`` has (:data:`MODULE_HOOKS`), if any."""
    return [kind.strip("_") for kind, hooks in module_hook_dicts(module) if hooks]


def global_module_hooks() -> list[str]:
    """The kinds of global module hooks registered, if any."""
    return [kind.strip("_") for kind, hooks in global_module_hook_dicts() if hooks]
