"""Dynamo meets each repeated block as one call: ``bucketwise::block_call``.

NOTE [Dynamo calls a block]: Dynamo's work is never cached across processes and, inlining every
block, grows with depth in the first step and every restart. With ``share_blocks``, while a
compiled call runs, each block of a repeated ``nn.ModuleList`` has a forward (in its ``__dict__``
for the call only) calling :func:`block_call`, which Dynamo keeps as one call (``allow_in_graph``):
it runs the block on fake tensors once, recording its ATen ops, so the backend tells which blocks
are the same without tracing each. Dynamo's guards are lost, so this holds only without hooks,
with plain arguments and static shapes, where the fake run sets no attribute, and while the
blocks' plain attributes keep their first values; else every block is inlined from then on.
"""

from __future__ import annotations

import dataclasses
import itertools
import linecache
import logging
import types
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from ..._compat import aot
from ..._compat import autograd as agc
from ..._compat import hooks as hc

log = logging.getLogger(__name__)

_KEYS = itertools.count()
_CALLS: weakref.WeakValueDictionary[int, BlockEntry] = weakref.WeakValueDictionary()
_PLAIN = (torch.Tensor, bool, int, float, str, type(None))


@dataclasses.dataclass(eq=False)
class BlockEntry:
    """One block called as one op: its modules (the block first), its tensors' names in
    :func:`block_call`'s order; ``fingerprint``: its computation, as last run on fake tensors."""

    key: int
    modules: tuple[nn.Module, ...] = dataclasses.field(repr=False)
    names: tuple[str, ...]
    forward: Callable[..., Any] = dataclasses.field(repr=False)
    fingerprint: tuple | None = None


@dataclasses.dataclass(eq=False)
class BlockCalls:
    """The blocks of ``container`` Dynamo meets as one call each; ``off``: why it inlines them after
    all. Their plain attributes' ``paths``, ``dicts``, ``names`` (apart: one pass in C), ``values`` at first."""

    container: str
    entries: list[BlockEntry] = dataclasses.field(default_factory=list)
    paths: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    dicts: tuple[dict[str, Any], ...] = dataclasses.field(default=(), repr=False)
    names: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    off: str | None = None
    values: list[Any] | None = dataclasses.field(default=None, repr=False)

    def changed(self) -> str | None:
        """Which plain attribute holds another value than at the first call, else ``None``."""
        now = list(map(dict.get, self.dicts, self.names))
        if self.values is None:
            self.values = now
        if now == self.values:  # identity first: an unchanged NaN compares equal
            return None
        for path, name, before, after in zip(self.paths, self.names, self.values, now):
            if after is not before and after != before:
                return f"{path}.{name} changed from {before!r} to {after!r} after the graph was compiled"
        raise AssertionError(f"expected a changed attribute in {self.container}, got none")

    def wrap(self, compiled: Callable[..., Any]) -> Callable[..., Any]:
        """``compiled`` called with the blocks' forwards installed, till a block refuses or changes."""

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.off is None and (why := self.changed()) is not None:
                self._inline(why)
            if self.off is not None:
                return compiled(*args, **kwargs)
            placed = [entry for entry in self.entries if "forward" not in entry.modules[0].__dict__]
            try:
                for entry in placed:
                    entry.modules[0].__dict__["forward"] = entry.forward
                return compiled(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - only a refusal is handled, the rest re-raised
                seen = set()
                while exc is not None and id(exc) not in seen and not isinstance(exc, BlockCallRefused):
                    seen.add(id(exc))
                    exc = exc.__cause__ or exc.__context__
                if not isinstance(exc, BlockCallRefused):
                    raise
                self._inline(str(exc))
            finally:
                for entry in placed:
                    entry.modules[0].__dict__.pop("forward", None)
            return compiled(*args, **kwargs)

        return call

    def _inline(self, why: str) -> None:
        self.off = why
        log.warning("bucketwise: share_blocks: Dynamo traces every block of %s: %s", self.container, why)


class BlockCallRefused(Exception):
    """A block cannot run as one call (NOTE [Dynamo calls a block]); the message says why."""


def find_block_calls(module: nn.Module) -> BlockCalls:
    """The repeated blocks of ``module`` Dynamo may meet as one call each; ``off`` says why none."""
    found = repeated_blocks(module)
    if found is None:
        return BlockCalls("", off="no nn.ModuleList of two or more blocks of one class")
    name, blocks = found
    if hc.global_module_hooks():
        return BlockCalls(name, off="global module hooks are registered")
    for index, block in enumerate(blocks):
        if "forward" in block.__dict__:
            return BlockCalls(name, off=f"{name}.{index}: it has a forward attribute of its own (a framework's hook)")
        for path, sub in block.named_modules():
            if hc.module_hooks(sub):
                why = f"module {path or '(the block)'} has hooks ({', '.join(hc.module_hooks(sub))})"
                return BlockCalls(name, off=f"{name}.{index}: {why}")
    attributes = [
        (f"{name}.{index}" + (f".{path}" if path else ""), sub.__dict__, attribute)
        for index, block in enumerate(blocks)
        for path, sub in block.named_modules()
        for attribute, value in vars(sub).items()
        if not attribute.startswith("_") and attribute != "training" and _plain_value(value)
    ]
    return BlockCalls(name, [_entry(block) for block in blocks], *zip(*attributes))


def repeated_blocks(module: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The longest ``nn.ModuleList`` of two or more blocks of one class in ``module``, and its name."""
    lists = [
        (name, child)
        for name, child in module.named_modules()
        if isinstance(child, nn.ModuleList) and len(child) > 1 and len({type(b) for b in child}) == 1
    ]
    if not lists:
        return None
    name, blocks = max(lists, key=lambda item: len(item[1]))
    return name or type(module).__name__, blocks


def _plain_value(value: Any) -> bool:
    """What a forward may branch on that Dynamo would guard: numbers, strings, flags, tuples of them."""
    if isinstance(value, tuple):
        return all(map(_plain_value, value))
    return type(value) in (bool, int, float, str, type(None))


def _entry(block: nn.Module) -> BlockEntry:
    paths = []
    for prefix, sub in block.named_modules(remove_duplicate=False):
        path = _path(prefix)
        for kind, table in (("_parameters", sub._parameters), ("_buffers", sub._buffers)):
            for name, tensor in table.items():
                if tensor is not None:
                    paths.append((path, kind, name))
    key, names = next(_KEYS), tuple(".".join((*path, name)) for path, _, name in paths)
    forward = types.MethodType(_block_forward(key, paths, block), block)
    entry = _CALLS[key] = BlockEntry(key, tuple(block.modules()), names, forward)
    return entry


def _block_forward(key: int, paths: list[tuple[tuple[str, ...], str, str]], block: nn.Module) -> Callable[..., Any]:
    """NOTE [a block call in straight lines]: Dynamo interprets every bytecode of a block's forward,
    for every block, in every first step; loops over parameters and ``training`` flags would be most
    of its work, so the forward it traces is generated: one line per submodule, parameter, flag."""
    local: dict[tuple[str, ...], str] = {(): "self"}
    lines = [
        "def forward(self, *args, **kwargs):",
        "    if not _plain((*args, *kwargs.values())):",
        "        return type(self).forward(self, *args, **kwargs)",
    ]

    def module(path: tuple[str, ...]) -> str:
        if path not in local:
            parent = module(path[:-1])
            local[path] = f"m{len(local)}"
            lines.append(f"    {local[path]} = {parent}._modules[{path[-1]!r}]")
        return local[path]

    # ``named_modules()`` walks the modules in ``BlockEntry.modules``' order (``block.modules()``).
    flags = "".join(f"{module(_path(prefix))}.training, " for prefix, _ in block.named_modules())
    tensors = "".join(f"{module(path)}.{kind}[{name!r}], " for path, kind, name in paths)
    lines.append(f"    return block_call({key}, ({tensors}), ({flags}), args, tuple(kwargs), tuple(kwargs.values()))")
    source, filename = "\n".join(lines) + "\n", f"<bucketwise block forward {key}>"
    scope = {"_plain": _plain, "block_call": block_call}
    exec(compile(source, filename, "exec"), scope)  # noqa: S102
    # Its lines in tracebacks, for as long as the block lives.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    weakref.finalize(block, linecache.cache.pop, filename, None)
    return scope["forward"]


def _path(prefix: str) -> tuple[str, ...]:
    return tuple(prefix.split(".")) if prefix else ()


def _plain(values: tuple | list) -> bool:
    """Every value a tensor, number, string, ``None``, or a tuple or list of them (traced by Dynamo)."""
    return all(isinstance(v, _PLAIN) or (isinstance(v, (tuple, list)) and _plain(v)) for v in values)


@torch.compiler.allow_in_graph
def block_call(key: int, tensors: tuple, flags: tuple, args: tuple, names: tuple, values: tuple) -> Any:
    """Run block ``key``'s forward on ``tensors`` (its parameters and buffers), ``flags`` (its modules'
    ``training``) and its arguments; on fake tensors, record its computation (NOTE [Dynamo calls a block])."""
    entry = _CALLS.get(key)
    if entry is None:
        raise RuntimeError(f"bucketwise: block call {key} outlived its module")
    module = entry.modules[0]
    kwargs = dict(zip(names, values))

    def run() -> Any:
        own = module.__dict__.pop("forward", None)
        try:
            return torch.func.functional_call(module, dict(zip(entry.names, tensors)), args, kwargs, strict=True)
        finally:
            if own is not None:
                module.__dict__["forward"] = own

    flat = [*tensors, *agc.tensor_leaves(args), *agc.tensor_leaves(values)]
    if not aot.all_fake(flat):
        return run()
    if any(aot.symbolic(t) for t in flat):
        # Dynamo would guard on the shapes the block's Python branches on; it sees none here.
        raise BlockCallRefused("dynamic shapes (the block's own shape checks need Dynamo's guards)")
    before = [dict(m.__dict__) for m in entry.modules]
    try:
        out, entry.fingerprint = aot.op_trace_key(run, flat, extra=(flags, names, _constants(args), _constants(values)))
    except Exception as exc:  # noqa: BLE001 - whatever fails here, Dynamo inlining the block handles it as before
        why = f"{type(module).__name__}.forward does not run on fake tensors on its own: {type(exc).__name__}: {exc}"
        raise BlockCallRefused(why[:300]) from exc
    changed = [k for m, was in zip(entry.modules, before) for k in _changed(m.__dict__, was)]
    if changed:
        for m, was in zip(entry.modules, before):
            m.__dict__.clear()
            m.__dict__.update(was)
        raise BlockCallRefused(
            f"{type(module).__name__}.forward sets module attributes ({', '.join(sorted(set(changed))[:4])}), "
            "which Dynamo replays on every call"
        )
    return out


def _constants(values: Any) -> Any:
    if isinstance(values, torch.Tensor):
        return "tensor"
    if isinstance(values, (tuple, list)):
        return tuple(_constants(v) for v in values)
    return repr(values)


def _changed(now: dict[str, Any], was: dict[str, Any]) -> list[str]:  # another object, or came or went
    return [k for k in now.keys() | was.keys() if now.get(k, _changed) is not was.get(k, _changed)]


def is_block_call(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is block_call


def opaque_key(node: fx.Node) -> tuple[Any, Any] | None:
    """A ``block_call`` node's signature key: its block's recorded computation (else its key), its args."""
    if not is_block_call(node):
        return None
    computation = getattr(_CALLS.get(node.args[0]), "fingerprint", None)
    return (computation if computation is not None else ("unrecorded", node.args[0])), node.args[1:]
