"""Configs side by side in one process, each with the model code of its own.

NOTE [configs side by side]: Dynamo keeps what it compiled per code object, and the harnesses
that keep several configs alive in one process (``tax``, ``ddp --rounds``) build every config's
model from the same classes, so their frames share code objects (``GPT.forward``, each
``Block.forward``). A compiled version is found again for another config when its guards pass
and its backend compares equal, which it does for two ``torch.compile`` calls with the same
backend and mode: ``torch`` built after ``local`` ran ``local``'s whole graph instead of its own
DDPOptimizer graphs, ``torch-nosplit`` after ``torch`` ran ``torch``'s split ones (seen on
torch 2.11 and 2.13; configs compiled under backends that compare unequal would still count
against each code object's ``recompile_limit``: :func:`side_by_side_compile_limits`).
:func:`own_code` gives a config's model classes of its own, whose methods are copies with code
objects of their own, so each config compiles and finds only its own frames, as in a process of
its own. torch's own frames stay shared: Dynamo runs ``nn.Module.__call__`` and
``DistributedDataParallel.forward`` eagerly, and in the wrapper frame of
``torch.compile(DDP(model))`` the configs that break the graph at DDP's C++ reducer (``torch``,
``torch-nosplit``, ...) compile only that break, the same for each; ``torch-ca``, which compiles
DDP's whole forward in that frame, compiles with options of its own (``core/configs.py``), so
with a backend that compares unequal. Functions outside the model's classes stay shared too: a
graph break inside one of them would make it a frame of its own, shared by the configs.
"""

from __future__ import annotations

import contextlib
import types
from typing import Iterator

import torch
import torch.nn as nn


def own_code(model: nn.Module) -> nn.Module:
    """``model`` with a class of its own for each of its modules' classes that defines methods
    outside torch: a subclass (same name) holding copies of those methods with new code objects,
    the rest inherited. Returns ``model`` itself, its modules' ``__class__`` replaced. Zero-argument
    ``super()`` still resolves through the original class (the copies keep its closure), so the
    methods behave as before; only Dynamo's caches, which hang on code objects, are this model's."""
    made: dict[type, type] = {}
    for module in model.modules():
        cls = type(module)
        if cls not in made:
            made[cls] = _class_of_its_own(cls)
        module.__class__ = made[cls]
    return model


def _class_of_its_own(cls: type) -> type:
    copies = {}
    for name in {n for klass in cls.__mro__ for n in vars(klass)}:
        owner = next(klass for klass in cls.__mro__ if name in vars(klass))
        value = vars(owner)[name]
        if isinstance(value, types.FunctionType) and not _is_torch(owner):
            copies[name] = _copy(value)
    if not copies:
        return cls
    return type(cls.__name__, (cls,), {**copies, "__module__": cls.__module__, "__qualname__": cls.__qualname__})


def _is_torch(klass: type) -> bool:
    return klass.__module__.split(".")[0] in ("torch", "builtins")


def _copy(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with a code object of its own (same bytecode, globals, defaults and closure)."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    copy.__doc__ = fn.__doc__
    copy.__dict__.update(fn.__dict__)
    return copy


@contextlib.contextmanager
def side_by_side_compile_limits(configs: int) -> Iterator[None]:
    """Within the block, Dynamo's per-code-object ``recompile_limit`` (and its
    ``accumulated_recompile_limit``, at least as much) is ``configs`` times its value
    (``torch.compiler.config``), so that each of ``configs`` compiled objects alive side by side
    in one process keeps the budget it has alone: frames they share (torch's own) count every
    config's compiles, and the 9th would run eagerly."""
    config = torch.compiler.config
    limit = int(config.recompile_limit) * max(1, configs)
    with config.patch(
        recompile_limit=limit, accumulated_recompile_limit=max(int(config.accumulated_recompile_limit), limit)
    ):
        yield
