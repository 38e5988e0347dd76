"""Operators whose Python kernel is one call at run time.

Checked on torch 2.11.0 (device machines), 2.13.0, 2.14.1 and 2.15.0 (CPU).

NOTE [one Python call per op]: a ``torch.library.custom_op`` operator runs five Python functions
per call under autograd, even where no gradient is wanted, and a shared block's operators are
called twice per block and step. :func:`define` registers with ``torch.library.Library`` instead:
its autograd kernel runs the Python kernel directly when nothing traces the call (no Python
dispatch key, no gradient wanted), and otherwise goes ``custom_op``'s way, so tracing, fake tensors
and the autograd formula work unchanged. That the Python key marks exactly those calls (a mode,
fake tensors, a ``__torch_dispatch__`` subclass) is checked on torch 2.13.0.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

_LIBRARIES: dict[str, torch.library.Library] = {}
_PYTHON = torch._C.DispatchKey.Python
"""In a call's dispatch key set where a dispatch mode is on (fake tensors, tracing) or a tensor
argument is a subclass with ``__torch_dispatch__``; absent for plain tensors and parameters."""


def define(
    qualname: str,
    schema: str,
    *,
    kernel: Callable[..., Any],
    fake: Callable[..., Any],
    formula: type[torch.autograd.Function] | None = None,
    tags: Sequence[torch.Tag] = (),
) -> torch._ops.OpOverload:
    """Define ``qualname`` (``namespace::name``) with ``schema`` (``(int key, Tensor[] inputs) ->
    Tensor[]``): ``kernel`` on every device, ``fake`` for fake tensors and meta; ``formula`` (an
    ``autograd.Function`` taking the operator's arguments with its list of tensors spread, and
    returning its outputs as a tuple) where a gradient is wanted. The operator's last argument is
    its list of tensors. Returns the overload (NOTE [one Python call per op])."""
    namespace, name = qualname.split("::")
    lib = _LIBRARIES.get(namespace)
    if lib is None:
        lib = _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
    lib.define(f"{name}{schema}", tags=tuple(tags))
    op = getattr(getattr(torch.ops, namespace), name).default
    lib.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, fake, lib=lib)

    def autograd_kernel(keyset: torch._C.DispatchKeySet, *args: Any) -> Any:
        tensors = args[-1]
        if torch._C.is_grad_enabled() and torch._C._any_requires_grad(tensors):
            if formula is None:
                raise RuntimeError(f"{qualname} has no autograd formula, but an input requires a gradient")
            return list(formula.apply(*args[:-1], *tensors))
        if not keyset.has(_PYTHON):
            return kernel(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & torch._C._after_autograd_keyset, *args)

    lib.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    return op
