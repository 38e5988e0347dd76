"""Private autograd-engine APIs the fused runtime uses (checked on torch 2.11.0 and 2.13.0)."""

from __future__ import annotations

from typing import Any, Callable

import torch


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the current backward pass has finished (what DDP's reducer uses too)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def in_reentrant_backward() -> bool:
    """Whether this runs inside a backward started from another backward's node (a reentrant
    ``torch.utils.checkpoint`` recompute): the engine's current node is that outer node there,
    ``None`` in the outermost backward's callbacks. Checked on torch 2.13.0 and 2.15.0."""
    return torch._C._current_autograd_node() is not None


def tensor_leaves(obj: Any) -> list[torch.Tensor]:
    leaves = torch.utils._pytree.tree_leaves(obj)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def is_compiled_graph_node(node: Any) -> bool:
    """The autograd node of an AOTAutograd-compiled graph (``CompiledFunctionBackward``)."""
    return "CompiledFunction" in type(node).__name__
