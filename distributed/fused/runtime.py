"""Run-time side of the fused strategy: what the compiled graphs do not reduce themselves.

NOTE [fused strategy runtime]: with the reducer idle (``run_forward_with_idle_reducer``), three
kinds of gradient still need DDP's treatment, each reduced exactly once. (1) Gradients
accumulated under ``no_sync()``: the graphs reduce only their step's gradient, so on the first
synced step the accumulated part of every parameter a graph syncs is averaged before its
backward (avg(acc) + avg(new) == avg(acc + new)); a comm hook that is not linear takes them into
its graph instead (NOTE [powersgd in the graph]). (2) Parameters no compiled graph syncs (eager
code between graph breaks, a ``torch.compiler.disable``d submodule): a post-accumulate-grad hook
on those only (one on every gradient would cost launch-bound models more than the rest of the
step's bookkeeping) collects them, and one callback at the end of the backward averages them.
(3) Parameters a graph syncs that eager code also uses: a hook on the eager autograd node
averages its contribution. A graph that did not run in a step (Dynamo ran its frame eagerly)
reduces nothing, so its parameters are treated as in (2) for that step.
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
    """Average in place across ranks the way DDP would for this module (``spec``: the graphs'
    ``sync.CommSpec``, ``CommSpec.to_wire``), dense gradients flattened per dtype and device."""
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
        self.params = [p for _, p in ddpc.reducer_parameters(ddp)]
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
        self._hooks: dict[int, Any] = {}
        """id(param) -> post-accumulate-grad hook handle, for the parameters of (2)."""
        self._hooked_for: Any = None

    @property
    def ddp(self) -> Any:
        return self._ddp()

    def graphs_compiled(self, param_ids: Iterable[int], spec: Any) -> int:
        """A new graph syncs these parameters in its backward, as ``spec`` says; returns the key
        it passes to :meth:`graph_ran` when it runs."""
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
        if not torch.is_grad_enabled():
            return
        if not sync:
            self.accumulated = True

    def reducer_step(self) -> None:
        """DDP's reducer reduces every gradient of this step (NOTE [fused under join] in
        ``compiler/module.py``), what ``no_sync()`` steps accumulated included: nothing is left
        for the runtime to do."""
        self._in_synced_backward = False
        self._ran = set()
        self.accumulated = False

    def after_forward(self, output: Any, sync: bool) -> None:
        if not (sync and torch.is_grad_enabled()):
            return
        self._step_covered = self._covered_by_graphs_that_ran()
        self._hook_uncovered()
        if self.accumulated:
            # (1) average what no_sync() steps accumulated, for the parameters graphs sync.
            # After the forward: graphs compiled by this very forward count too, and the
            # accumulated gradients are untouched until the backward starts.
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
        """The compiled graphs are gone (their frames recompile): forget which parameters they
        reduce; the graphs compiled next record theirs again."""
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
        if not self._eager_ready:
            agc.queue_backward_callback(self._flush_eager)
        self._eager_ready.append(param)

    def _flush_eager(self) -> None:
        params, self._eager_ready = self._eager_ready, []
        # The same collectives in the same order on every rank, whatever order autograd made
        # the gradients ready in.
        params.sort(key=lambda p: self._index[id(p)])
        self._in_synced_backward = False
        self._average([p.grad for p in params if p.grad is not None])

    # -- (3) parameters used both in a graph and eagerly ----------------------------------

    def _hook_eager_uses(self, output: Any) -> None:
        """Find autograd nodes outside compiled graphs that feed a covered parameter's
        accumulator, and average their contribution to it in the backward."""
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
