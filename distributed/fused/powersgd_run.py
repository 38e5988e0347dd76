"""The host side of ``powerSGD_hook`` under the fused strategy (NOTE [powersgd in the graph])."""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Hashable, Sequence

import torch

from ...partitioners.param_usage import GraphParam
from .comm_hooks import PLAIN, HookedGraph, HookProgram, InputSpec, bucket_input_spec, has_grads, take_grads
from .powersgd import BucketPlan, PowerSGDConfig, plan_bucket, powersgd_sync, state_layout
from .sync import CommSpec, insert_bucket_syncs

log = logging.getLogger(__name__)

_SEED_HIGH = 1_000_000_000
"""torch's hook seeds Q with ``state.rng.randint(1_000_000_000)``."""


class PowerSGDRun(HookProgram):
    """``powerSGD_hook`` and its state for one DDP module's fused graphs. ``spec``: the all-reduce
    before ``start_powerSGD_iter``; ``keep_in_place``: gets every state tensor the graphs update in
    place (given fixed addresses for CUDA graphs)."""

    name = "powerSGD_hook"

    def __init__(self, state: Any, spec: CommSpec, keep_in_place: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self.state = state
        self._spec = spec
        self._keep_in_place = keep_in_place
        self._private: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """P and Q memories of each bucket when ``warm_start`` is off (torch's dicts stay empty)."""
        self._seeds: list[int] = []
        self._compressed = False
        self._plans: dict[tuple[Any, ...], BucketPlan] = {}
        self._kept: dict[int, weakref.ref] = {}
        """State tensors handed to ``keep_in_place`` already (by id)."""

    def plain_spec(self) -> CommSpec:
        return self._spec

    def config(self) -> PowerSGDConfig:
        s = self.state
        return PowerSGDConfig(
            group=self._spec.group,
            world_size=self._spec.world_size,
            rank=int(s.matrix_approximation_rank),
            min_compression_rate=s.min_compression_rate,
            use_error_feedback=bool(s.use_error_feedback),
            batch_same_shape=bool(s.batch_tensors_with_same_shape),
            epsilon=s.orthogonalization_epsilon,
        )

    def plan(self, key: int, bucket: Sequence[GraphParam], cfg: PowerSGDConfig) -> BucketPlan:
        """The plan of bucket ``key`` (``self.key(bucket)``) under ``cfg``, made once."""
        cached = (key, cfg.rank, cfg.min_compression_rate, cfg.batch_same_shape)
        plan = self._plans.get(cached)
        if plan is None:
            shapes = [tuple(p.tensor.shape) for p in bucket]
            plan = self._plans[cached] = plan_bucket(shapes, cfg.rank, cfg.min_compression_rate, cfg.batch_same_shape)
        return plan

    # -- per call --------------------------------------------------------------------------

    def variant(self, graph: HookedGraph) -> Hashable:
        if self.state.iter < self.state.start_powerSGD_iter:
            return PLAIN
        return ("powerSGD", self.config(), has_grads(graph.buckets))

    def input_specs(self, variant: Hashable, graph: HookedGraph) -> list[InputSpec]:
        if variant == PLAIN:
            return []
        _, cfg, carry = variant
        specs = []
        for key, bucket in zip(graph.keys, graph.buckets):
            plan = self.plan(key, bucket, cfg)
            sizes = {"error": plan.numel, "p": plan.p_numel, "q": plan.q_numel, "carry": plan.numel}
            specs += [bucket_input_spec(bucket, sizes[name]) for name in state_layout(cfg, carry)]
        return specs

    def inputs(self, variant: Hashable, graph: HookedGraph) -> list[torch.Tensor]:
        if variant == PLAIN:
            return []
        _, cfg, carry = variant
        self._compressed = True
        out: list[torch.Tensor] = []
        for key, bucket in zip(graph.keys, graph.buckets):
            plan = self.plan(key, bucket, cfg)
            tensors = self._bucket_state(key, plan, cfg, bucket)
            if carry:
                tensors.append(take_grads(bucket))
            out += tensors
        return out

    def _bucket_state(
        self, key: int, plan: BucketPlan, cfg: PowerSGDConfig, bucket: Sequence[GraphParam]
    ) -> list[torch.Tensor]:
        """torch's hook up to its first collective, for one bucket: the error memory (created as
        zeros), the statistics, and P and Q memories with a fresh random Q where torch draws one."""
        state, like = self.state, bucket[0].tensor
        out = []
        if cfg.use_error_feedback:
            out.append(self._held(state.error_dict, key, plan.numel, like, zero=True))
        state.total_numel_before_compression += plan.numel_before
        state.total_numel_after_compression += plan.numel_after
        if state.warm_start and key in state.p_memory_dict:
            p = self._held(state.p_memory_dict, key, plan.p_numel, like)
            q = self._held(state.q_memory_dict, key, plan.q_numel, like)
        else:
            if state.warm_start:
                p, q = self._new(plan.p_numel, like), self._new(plan.q_numel, like)
                state.p_memory_dict[key], state.q_memory_dict[key] = p, q
            else:
                p, q = self._private.get(key) or (self._new(plan.p_numel, like), self._new(plan.q_numel, like))
                self._private[key] = (p, q)
            self._random_q(q, plan)
        return out + [p, q]

    def _held(self, store: dict, key: int, numel: int, like: torch.Tensor, zero: bool = False) -> torch.Tensor:
        """The state tensor ``store[key]``, created if missing (torch's are, on first use)."""
        t = store.get(key)
        if t is None:
            return store.setdefault(key, self._new(numel, like, zero))
        if (ref := self._kept.get(id(t))) is not None and ref() is t:
            return t
        # Put there from outside (a loaded state): checked once, then kept in place like ours.
        if t.shape != (numel,) or t.dtype != like.dtype or t.device != like.device:
            raise ValueError(
                f"PowerSGDState holds a tensor of shape {tuple(t.shape)} ({t.dtype}, {t.device}) for bucket {key}, "
                f"which needs ({numel},) ({like.dtype}, {like.device}): the state comes from other buckets; "
                "start from a fresh PowerSGDState or keep the bucket caps it was made with"
            )
        self._keep(t)
        return t

    def _new(self, numel: int, like: torch.Tensor, zero: bool = False) -> torch.Tensor:
        t = (torch.zeros if zero else torch.empty)(numel, dtype=like.dtype, device=like.device)
        self._keep(t)
        return t

    def _keep(self, t: torch.Tensor) -> None:
        self._keep_in_place(t)
        self._kept[id(t)] = weakref.ref(t)

    def _random_q(self, q: torch.Tensor, plan: BucketPlan) -> None:
        """torch: ``torch.manual_seed(state.rng.randint(1e9))`` in ``fork_rng(devices=[])``, then
        one CPU ``randn`` per Q in order. The same draws from a generator of its own; the seeding's
        effect on other devices is replayed after the forward (``after_synced_forward``)."""
        seed = int(self.state.rng.randint(_SEED_HIGH))
        self._seeds.append(seed)
        gen = torch.Generator().manual_seed(seed)
        offset = 0
        for shape in plan.q_shapes():
            n = shape[0] * shape[1] * shape[2]
            q[offset : offset + n].view(shape).copy_(torch.randn(shape, generator=gen, dtype=q.dtype))
            offset += n

    def after_synced_forward(self) -> None:
        """The end of torch's hook on the last bucket: device generators, statistics, ``iter``."""
        state = self.state
        for seed in self._seeds:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
        self._seeds = []
        if self._compressed and state.iter >= state.next_stats_report:
            rate, before, after = state.compression_stats()
            log.info(
                "Compression stats: iter %s, total before compression %s, total after compression %s, rate %s",
                state.iter,
                before,
                after,
                rate,
            )
            state.next_stats_report = state.iter + state.compression_stats_logging_frequency
        self._compressed = False
        state.iter += 1
        if state.iter == state.start_powerSGD_iter:
            log.info("Start to apply PowerSGD after %s iterations.", state.iter)

    # -- compile time ----------------------------------------------------------------------

    def insert(self, gm, buckets, variant, extra) -> None:
        if variant == PLAIN:
            insert_bucket_syncs(gm, buckets, self._spec)
            return
        _, cfg, carry = variant
        n = len(state_layout(cfg, carry))

        def args(i: int) -> tuple[Any, ...]:
            return (*cfg.as_args(), carry, *extra[i * n : (i + 1) * n])

        insert_bucket_syncs(gm, buckets, self._spec, target=powersgd_sync, bucket_args=args)

    def variant_name(self, variant: Hashable) -> str:
        if variant == PLAIN:
            return "plain all-reduce (before start_powerSGD_iter)"
        return "powerSGD" + (" (accumulated gradients)" if variant[2] else "")

    def wire(self, bucket: Sequence[GraphParam]) -> tuple[str, int | None, dict[str, int] | None]:
        plan = self.plan(self.key(bucket), bucket, self.config())
        size = bucket[0].tensor.element_size()
        parts = {k: v * size for k, v in plan.wire_elements().items()}
        return "all_reduce " + " + ".join(parts), sum(parts.values()), parts

    def describe(self) -> str:
        s = self.state
        return (
            f"powerSGD_hook (matrix_approximation_rank {s.matrix_approximation_rank}, "
            f"start_powerSGD_iter {s.start_powerSGD_iter})"
        )
