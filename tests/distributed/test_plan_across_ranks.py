"""The same model, config and device give the same plan on every rank and every compile
(NOTE [one plan per graph] in compiler/plan.py: a graph's plan is a pure function of the config,
the DDP module's decision, the graph and its device; nothing in it is timed).

On 2 real gloo ranks, each fed different data, one small GPT-like net (an embedding, 3 identical
blocks in an ``nn.ModuleList``, a head) is compiled under DDP with several configs: the default
``bucketwise.compile(DDP(net))`` (Inductor), ``share_blocks=True``, ``strategy="split"`` at 10 KiB
buckets and the default with DDP's ``fp16_compress_hook`` (the bf16 one needs CUDA), and trained 2
steps. What the report records of each graph's plan, its timings left out (:func:`plan_record`),
is the same on both ranks; on each rank a second compile of a fresh copy of the net after
``torch._dynamo.reset()`` (a restart, in-process) records the same plan again. The records are
checked not to be trivially equal: each config's says what that config does, and no two configs'
are the same. tests/gpu/test_gpu_plan_across_ranks.py checks the same on 2 GPUs, where the
default's sharing is decided by its cost estimate (NOTE [sharing by cost]).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from support.dist import run_distributed
from support.plan_records import differences, plan_record
from torch.nn.parallel import DistributedDataParallel as DDP

D, VOCAB, DEPTH, STEPS = 16, 32, 3, 2

# name -> (bucketwise.compile's keyword arguments, DDP's, the comm hook registered before the
# compile). Only the default compiles with Inductor; the others with aot_eager, several times
# faster to compile on 2 cores (of its backend a plan reads whether it is Inductor, for sharing by
# cost, which needs a GPU, and whether it can gather embedding rows).
CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any], str | None]] = {
    "default": ({}, {}, None),
    "share_blocks": ({"backend": "aot_eager", "share_blocks": True}, {}, None),
    "split": ({"backend": "aot_eager", "strategy": "split"}, {"bucket_cap_mb": 0.01}, None),
    "fp16_hook": ({"backend": "aot_eager"}, {}, "fp16_compress_hook"),
}


class Block(nn.Module):
    """A transformer-like block (as test_shared_blocks.py's, without its options)."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln(x)).split(x.shape[-1], dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1) @ v
        x = x + self.proj(att)
        return x + self.out(F.gelu(self.fc(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


def _compile_and_train(rank: int, name: str) -> dict[str, Any]:
    import bucketwise

    options, ddp_options, hook = CONFIGS[name]
    torch.manual_seed(0)
    net = Net()
    ddp = DDP(net, **ddp_options)
    if hook is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, getattr(default_hooks, hook))
    compiled = bucketwise.compile(ddp, **options)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(10 * step + rank))
        compiled(ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return plan_record(bucketwise.report(compiled).to_dict())


def _records(rank: int, world: int, names: list[str]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Per config: the plan record of a compile and of a second compile of a fresh copy after a
    Dynamo reset (a restart, in-process)."""
    out = {}
    for name in names:
        first = _compile_and_train(rank, name)
        torch._dynamo.reset()
        again = _compile_and_train(rank, name)
        torch._dynamo.reset()
        out[name] = (first, again)
    return out


def test_every_rank_and_every_compile_gets_the_same_plan(tmp_path):
    r0, r1 = run_distributed(_records, tmp_path, args=(list(CONFIGS),), timeout=600)
    assert list(r0) == list(r1) == list(CONFIGS)
    for name in CONFIGS:
        assert r0[name][0] == r1[name][0], (
            f"{name}: rank 0 and rank 1 planned differently",
            differences(r0[name][0], r1[name][0]),
        )
        for rank, (first, again) in enumerate((r0[name], r1[name])):
            assert first == again, (
                f"{name}: rank {rank} planned differently when compiled again",
                differences(first, again),
            )
    records = {name: r0[name][0] for name in CONFIGS}
    # Not trivially equal: one graph each, which says what its config does ...
    assert all(len(r["graphs"]) == 1 for r in records.values()), records
    graph = {name: r["graphs"][0] for name, r in records.items()}
    default, shared, split, hooked = (graph[n] for n in ("default", "share_blocks", "split", "fp16_hook"))
    assert default["strategy"] == "fused" and len(default["buckets"]) >= 1, default
    # On the CPU the default compiles the blocks with the whole graph, and says why.
    assert set(default["shared_blocks"]) == {"reason"}, default["shared_blocks"]
    assert default["shared_blocks"]["reason"].startswith("share_blocks='auto'"), default["shared_blocks"]
    (unshared,) = records["default"]["unshared_blocks"]
    assert (unshared["container"], unshared["blocks"]) == ("blocks", DEPTH), unshared
    assert unshared["reason"] == default["shared_blocks"]["reason"], unshared
    sharing = shared["shared_blocks"]
    assert (sharing["blocks"], sharing["class"], sharing["compiles"]) == ("blocks", "Block", 1), sharing
    assert sharing["count"] >= 3, sharing
    assert records["share_blocks"]["unshared_blocks"] == [], records["share_blocks"]
    assert split["strategy"] == "split" and len(split["segments"]) >= 2 and len(split["buckets"]) >= 2, split
    assert {b["comm_dtype"] for b in hooked["buckets"]} == {"float16"}, hooked["buckets"]
    assert {b["comm_dtype"] for b in default["buckets"]} == {"same as grads"}, default["buckets"]
    # ... and no two configs plan alike.
    names = list(records)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert records[a] != records[b], f"{a} and {b} recorded the same plan"
