"""Run-time side of the fused strategy: what the compiled graphs do not reduce themselves.

NOTE [fused strategy runtime]: with the reducer idle, three kinds of gradient still need
reducing, each exactly once. (1) Accumulated under ``no_sync()``: averaged after the first synced
forward (avg(acc) + avg(new) == avg(acc + new)); a non-linear hook takes them into its graph
(NOTE [powersgd in the graph]). (2) Parameters no graph that ran syncs (eager code, graph breaks,
a graph Dynamo ran eagerly): post-accumulate-grad hooks on those only, averaged by one callback at
the end of the backward, or of each reentrant backward inside it (a ``use_reentrant=True``
checkpoint recomputes and back-propagates its region in a backward of its own), each parameter
once a step. (3) Parameters a graph syncs that eager code also uses: a hook on the
eager autograd node averages its contribution.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Iterable

import torch
import torch.distributed as dist

from ..._compat import autograd as agc
from ..._compat import ddp as ddpc
from .sync import reducer_spec

log = logging.getLogger(__name__)


def _average_(tensors: list[torch.Tensor], pg: Any, spec: Any) -> None:
    """Average in place across ranks as ``spec`` (a ``CommSpec``) says, flat per dtype/device."""
    if not tensors:
        return
    for t in tensors:
        if t.is_sparse:
            # As DDP's reducer reduces a sparse gradient: on its own, divided, then summed.
            t.div_(spec.world_size)
            dist.all_reduce(t, group=pg)
    tensors = [t for t in tensors if not t.is_sparse]
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    for group in by_dtype.values():
        wire = spec.to_wire(torch.cat([t.reshape(-1) for t in group]))
        dist.all_reduce(wire, op=dist.ReduceOp.AVG if spec.averages(wire.dtype) else dist.ReduceOp.SUM, group=pg)
        offset = 0
        for t in group:
            t.copy_(wire[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


class FusedRuntime:
    """Per compiled DDP module: keeps DDP's semantics for what the graphs leave out."""

    def __init__(self, ddp: Any) -> None:
        self._ddp = weakref.ref(ddp)
        named = ddpc.reducer_parameters(ddp)
        self.params = [p for _, p in named]
        self._names = {id(p): n for n, p in named}
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.covered: set[int] = set()
        """ids of parameters that some compiled graph reduces in its backward."""
        self._graph_params: list[frozenset[int]] = []
        self._ran: set[int] = set()
        self._step_covered: frozenset[int] | set[int] = frozenset()
        """ids of parameters that the graphs which ran in this step's forward reduce."""
        self.mixed: set[int] = set()
        """ids of covered parameters that eager code also uses."""
        self.accumulated = False
        self.spec: Any = None
        """The CommSpec the graphs use; eager reductions follow it too."""
        self.hook: Any = None
        """The comm hook's program (``comm_hooks.HookProgram``: PowerSGD, a traceable user hook),
        shared by the graphs; told when each synced forward is over."""
        self._check_autograd_graph = True
        self._in_synced_backward = False
        self._eager_ready: list[torch.Tensor] = []
        self._eager_done: set[int] = set()
        """ids of the parameters of (2) averaged since this step's synced forward."""
        self.eager_reduced: dict[int, str] = {}
        """id -> name of every parameter (2) has averaged, for the report."""
        self._hooks: dict[int, Any] = {}
        """id(param) -> post-accumulate-grad hook handle, for the parameters of (2)."""
        self._hooked_for: Any = None

    @property
    def ddp(self) -> Any:
        return self._ddp()

    def graphs_compiled(self, param_ids: Iterable[int], spec: Any) -> int:
        """Record a new graph's parameters; returns its key for :meth:`graph_ran`."""
        ids = frozenset(param_ids)
        self.covered.update(ids)
        self.spec = spec
        self._check_autograd_graph = True
        self._graph_params.append(ids)
        return len(self._graph_params) - 1

    def graph_ran(self, key: int) -> None:
        self._ran.add(key)

    # -- around each forward ---------------------------------------------------------------

    def before_forward(self, sync: bool) -> None:
        self._in_synced_backward = sync and torch.is_grad_enabled()
        self._ran = set()
        self._eager_ready, self._eager_done = [], set()
        if not torch.is_grad_enabled():
            return
        if not sync:
            self.accumulated = True

    def reducer_step(self) -> None:
        """DDP's reducer reduces this step, accumulated gradients too (NOTE [fused under join])."""
        self._in_synced_backward = False
        self._ran = set()
        self.accumulated = False

    def after_forward(self, output: Any, sync: bool) -> None:
        if not (sync and torch.is_grad_enabled()):
            return
        self._step_covered = self._covered_by_graphs_that_ran()
        self._hook_uncovered()
        if self.accumulated:
            # (1), after the forward so graphs compiled by this forward count too.
            grads = [p.grad for p in self.params if id(p) in self.covered and p.grad is not None]
            self._average(grads)
            self.accumulated = False
        if self._check_autograd_graph or self.mixed:
            self._hook_eager_uses(output)
            self._check_autograd_graph = False
        if self.hook is not None:
            self.hook.after_synced_forward()

    def _covered_by_graphs_that_ran(self) -> frozenset[int] | set[int]:
        if len(self._ran) == len(self._graph_params):
            return self.covered
        ran = set().union(*(self._graph_params[k] for k in self._ran))
        skipped = len(self.covered - ran)
        if skipped:
            log.info("bucketwise fused: %d parameter(s) reduced after the backward: their graph ran eagerly", skipped)
        return ran

    def own_hook_ids(self) -> set[int]:
        """Handle ids of the post-accumulate-grad hooks this runtime put on parameters (2)."""
        return {handle.id for handle in self._hooks.values()}

    def forget_graphs(self) -> None:
        """The compiled graphs are gone (their frames recompile)."""
        self.covered = set()
        self._graph_params = []
        self._ran = set()
        self._step_covered = frozenset()
        self.mixed = set()
        self._check_autograd_graph = True
        self._hooked_for = None

    def remove_hooks(self) -> None:
        for handle in self._hooks.values():
            handle.remove()
        self._hooks = {}
        self._hooked_for = None

    def _hook_uncovered(self) -> None:
        """Hook exactly the parameters this step's graphs do not reduce (see (2))."""
        # Unchanged since the last step when every graph ran and none was compiled since.
        key = len(self._graph_params) if self._step_covered is self.covered else None
        if key is not None and key == self._hooked_for:
            return
        self._hooked_for = key
        wanted = {id(p): p for p in self.params if id(p) not in self._step_covered}
        for pid in [pid for pid in self._hooks if pid not in wanted]:
            self._hooks.pop(pid).remove()
        for pid, p in wanted.items():
            if pid not in self._hooks:
                self._hooks[pid] = p.register_post_accumulate_grad_hook(self._on_grad_ready)

    # -- (2) parameters no graph reduces ---------------------------------------------------

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._in_synced_backward or id(param) in self._step_covered:
            return
        if id(param) in self._eager_done:
            # Averaged already at the end of a reentrant backward: this second gradient cannot be
            # told apart from the first in .grad. Eager DDP's reducer refuses it too.
            self._in_synced_backward = False
            raise RuntimeError(
                f"bucketwise (strategy='fused'): parameter {self._names[id(param)]!r} got a second gradient in "
                "one backward after a reentrant backward (torch.utils.checkpoint with use_reentrant=True) "
                "had reduced its first; eager DDP refuses this too unless static_graph=True. Fixes: "
                "use_reentrant=False, or strategy='split' with DDP(..., static_graph=True) (DDP's reducer reduces)"
            )
        if not self._eager_ready:
            agc.queue_backward_callback(self._flush_eager)
        self._eager_ready.append(param)

    def _flush_eager(self) -> None:
        params, self._eager_ready = self._eager_ready, []
        # Same collective order on every rank.
        params.sort(key=lambda p: self._index[id(p)])
        self._eager_done.update(id(p) for p in params)
        self.eager_reduced.update((id(p), self._names[id(p)]) for p in params)
        # A reentrant backward ends inside the step's backward: more gradients may follow.
        self._in_synced_backward = agc.in_reentrant_backward()
        self._average([p.grad for p in params if p.grad is not None])

    # -- (3) parameters used both in a graph and eagerly ----------------------------------

    def _hook_eager_uses(self, output: Any) -> None:
        """(3): hook eager autograd nodes that feed a covered parameter's accumulator."""
        roots = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        seen: set[Any] = set()
        stack = list(roots)
        found: set[int] = set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            eager_slots = []
            for slot, (nxt, _) in enumerate(node.next_functions):
                if nxt is None:
                    continue
                var = getattr(nxt, "variable", None)
                if var is not None:
                    if id(var) in self.covered and not agc.is_compiled_graph_node(node):
                        eager_slots.append(slot)
                        found.add(id(var))
                else:
                    stack.append(nxt)
            if eager_slots:
                node.register_hook(self._averaging_hook(eager_slots))
        if found - self.mixed:
            log.info("bucketwise fused: %d parameter(s) are also used outside compiled graphs", len(found - self.mixed))
        self.mixed = found

    def _average(self, tensors: list[torch.Tensor]) -> None:
        pg = ddpc.process_group(self.ddp)
        spec = self.spec if self.spec is not None else reducer_spec(pg)
        _average_(tensors, pg, spec)

    def _averaging_hook(self, slots: list[int]):
        def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> tuple[Any, ...]:
            out = list(grad_inputs)
            for slot in slots:
                if out[slot] is not None:
                    g = out[slot].clone()
                    self._average([g])
                    out[slot] = g
            return tuple(out)

        return hook


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in agc.tensor_leaves(obj) if t.requires_grad]
