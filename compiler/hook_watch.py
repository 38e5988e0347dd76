"""Noticing, at a glance per call, that hooks the compiled graphs depend on changed.

NOTE [hooks registered after compile]: Dynamo traces module hooks into the graph without
guarding on them (``skip_nnmodule_hook_guards``), and gradient hooks decide the strategy (NOTE
[gradient hooks before the reduction]); eager DDP runs whatever is registered at call time. So
we watch: one global registration counter (``_compat/hooks.registrations()``) read per call,
plus the sizes of non-empty hook dicts (removals). When either moves, hooks are listed again;
if they differ from those compiled with, the object decides again and recompiles (NOTE [one
decision]), and the report says why.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Iterable

import torch
import torch.nn as nn

from .._compat import hooks as hc

Entry = tuple[str, str, tuple[int, ...]]
"""``(where, which hooks, handle ids)`` of one non-empty hook dict."""

_MODULE_KINDS = {
    "_forward_pre_hooks": "forward pre-hooks",
    "_forward_hooks": "forward hooks",
    "_backward_pre_hooks": "backward pre-hooks",
    "_backward_hooks": "backward hooks",
}
_TENSOR_KINDS = {"_backward_hooks": "gradient hooks", "_post_accumulate_grad_hooks": "post-accumulate-grad hooks"}


class HookWatch:
    """See NOTE [hooks registered after compile]. ``own()``: our own hooks' ids, ignored."""

    def __init__(
        self,
        modules: Callable[[], Iterable[tuple[str, nn.Module]]],
        params: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        own: Callable[[], Collection[int]] = frozenset,
    ) -> None:
        self._modules, self._params, self._own = modules, params, own
        self._seen = -1
        self._watched: list[dict[int, Any]] = []
        self._sizes: list[int] = []
        """The hook dicts that held hooks at the last look, and how many each held."""
        self._entries: frozenset[Entry] = frozenset()

    def start(self) -> None:
        """Take the hooks as they are now as the ones the graphs are compiled with."""
        self._entries = self._scan()

    def changed(self) -> str | None:
        """What changed since :meth:`start` (or the last change), ``None`` if nothing did."""
        # Host time every call: one pass in C over the watched dicts.
        if hc.registrations() == self._seen and list(map(len, self._watched)) == self._sizes:
            return None
        entries = self._scan()
        if entries == self._entries:
            return None
        added, removed = sorted(entries - self._entries), sorted(self._entries - entries)
        self._entries = entries
        parts = [
            f"hooks added on {_names(added)}" if added else "",
            f"removed from {_names(removed)}" if removed else "",
        ]
        return "; ".join(p for p in parts if p)

    def _scan(self) -> frozenset[Entry]:
        self._seen = hc.registrations()
        own = set(self._own())
        found: list[tuple[str, str, dict[int, Any]]] = [
            ("every module", _MODULE_KINDS[kind], d) for kind, d in hc.global_module_hook_dicts()
        ]
        for name, module in self._modules():
            found += [(name or "the model", _MODULE_KINDS[kind], d) for kind, d in hc.module_hook_dicts(module)]
        for name, param in self._params():
            found += [(name, _TENSOR_KINDS[kind], d) for kind, d in hc.tensor_hook_dicts(param)]
        self._watched = [d for _, _, d in found if d]
        self._sizes = list(map(len, self._watched))
        entries = set()
        for where, kind, d in found:
            ids = tuple(sorted(k for k in d if k not in own))
            if ids:
                entries.add((where, kind, ids))
        return frozenset(entries)


def _names(entries: list[Entry]) -> str:
    shown = [f"{where} ({kind})" for where, kind, _ in entries[:3]]
    return ", ".join(shown) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
