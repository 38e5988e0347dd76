"""Private autograd-engine APIs the fused runtime uses (checked on torch 2.11.0 and 2.13.0)."""

from __future__ import annotations

from typing import Any, Callable

import torch


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the current backward pass has finished (what DDP's reducer uses too)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def tensor_leaves(obj: Any) -> list[torch.Tensor]:
    leaves = torch.utils._pytree.tree_leaves(obj)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def is_compiled_graph_node(node: Any) -> bool:
    """The autograd node of an AOTAutograd-compiled graph (``CompiledFunctionBackward``)."""
    return "CompiledFunction" in type(node).__name__
