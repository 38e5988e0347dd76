"""Identical blocks share one compile (NOTE [one compile per block]) and train exactly like eager DDP.

The graph analysis (which nodes are a block, which blocks are the same computation) is checked
on Dynamo's graph of a small GPT; training is checked across 2 real ranks against eager DDP,
gradients after every backward and parameters after every step, under every strategy, with the
report saying which blocks shared a compile, or why they did not. All cases of a test run in one
pair of processes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from support.dist import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketwise._compat.capabilities import capabilities
from bucketwise.compiler.blocks.find import find_block_run, piece_of

STEPS = 4


class Block(nn.Module):
    def __init__(
        self, d: int = 32, checkpointed: bool = False, dropout: float = 0.0, counts_calls: bool = False
    ) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)
        self.checkpointed, self.dropout, self.counts_calls = checkpointed, dropout, counts_calls
        self.temperature = 8.0  # a plain attribute the forward reads

    def _body(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv(self.ln(x.to(self.ln.weight.dtype)).to(x.dtype)).split(x.shape[-1], dim=-1)
        att = q @ k.transpose(-1, -2) / self.temperature
        if mask is not None:  # made an additive bias in every block, as HF's attention does
            att = att + torch.where(mask, 0.0, float("-inf"))
        att = torch.softmax(att, dim=-1) @ v
        x = x + self.proj(att)
        return x + F.dropout(self.out(F.gelu(self.fc(x))), self.dropout, self.training)

    def forward(
        self, x: torch.Tensor, scale: torch.Tensor | None = None, extra: object = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        if scale is not None:
            x = x * scale
        if self.counts_calls:  # a Python side effect Dynamo replays on every call
            self.calls = getattr(self, "calls", 0) + 1
        if self.checkpointed:
            return checkpoint.checkpoint(self._body, x, mask, use_reentrant=False)
        return self._body(x, mask)


class Net(nn.Module):
    def __init__(
        self, depth: int = 3, *, shared_scale: bool = False, extra: object = None, masked: bool = False, **block: object
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(Block(**block) for _ in range(depth))
        self.head = nn.Linear(32, 64)
        # A parameter every block reads: its gradient is complete only after the last block's
        # backward, so no block may reduce it.
        self.scale = nn.Parameter(torch.ones(32)) if shared_scale else None
        self.extra = extra  # passed to every block: an object Dynamo cannot put into a graph
        self.masked = masked  # a causal mask made once and passed to every block

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        n = ids.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool).tril() if self.masked else None
        for block in self.blocks:
            x = block(x, self.scale, self.extra) if self.extra is not None else block(x, self.scale, mask=mask)
        return F.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


def test_the_blocks_of_a_graph_are_found_and_cut_where_they_start():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(Net(depth=3), backend=backend)(torch.randint(0, 64, (2, 8)))
    (gm,) = graphs
    run, why = find_block_run(gm)
    assert run is not None, why
    assert (run.name, run.block_class, len(run)) == ("blocks", "Block", 3)
    nodes = list(gm.graph.nodes)
    pieces = [piece_of(run, i) for i in range(len(nodes))]
    assert pieces == sorted(pieces) and set(pieces) == {0, 1, 2, 3, 4}
    # The embedding lookup comes before the first block, the head after the last.
    first_block = [n for n, p in zip(nodes, pieces) if p == 1 and n.op.startswith("call_")]
    assert all("blocks.0" in str(n.meta["nn_module_stack"]) for n in first_block)


def test_a_block_call_passes_only_what_its_compiled_forward_reads():
    """NOTE [computed once before the blocks]: the mask's bias moves out of the blocks, so their
    compiled forward reads the boolean mask no more; no call passes it (Inductor would copy that
    view at every call). The gradients still match the whole graph's."""
    from bucketwise.compiler import blocks

    calls = []

    def backend(gm, example_inputs):
        whole = copy.deepcopy(gm)
        sharing, why = blocks.share_blocks(gm, example_inputs, backend=capabilities("aot_eager"), config_patches={})
        assert sharing is not None, why
        calls.extend(n for n in gm.graph.nodes if n.target is blocks.SHARED_BLOCK)
        return whole.forward

    torch.manual_seed(0)
    net = Net(depth=3, masked=True)
    torch.compile(net, backend=backend)(torch.randint(0, 64, (2, 8))).backward()
    assert len(calls) == 3, calls
    for call in calls:
        given = [n.meta.get("val", n.meta.get("example_value")) for n in call.args[1]]
        assert not any(v.dtype == torch.bool for v in given), [(v.dtype, tuple(v.shape)) for v in given]
        # The bias made once before the blocks is the last input of every call.
        assert given[-1].dtype == torch.float32 and tuple(given[-1].shape) == (8, 8), given[-1]
    assert calls[0].args[1][-1] is calls[2].args[1][-1]


def _case(rank: int, name: str, strategy: str, backend: str) -> dict:
    import bucketwise

    torch.manual_seed(0)
    kwargs = {
        "plain": {},
        "checkpointed": {"checkpointed": True},
        "dropout": {"dropout": 0.1},
        "two_kinds": {},
        "not_shared": {},
        "fp16_hook": {},
        "mixed_dtypes_hook": {},
        "shared_scale": {"shared_scale": True},
        "masked": {"masked": True},
        "retuned": {},
        "object_arg": {"extra": _Opaque()},
        "side_effect": {"counts_calls": True},
        "hooked": {},
        "cpp_wrapper": {"masked": True},
        "cpp_wrapper_whole": {"masked": True},
    }[name]
    base = Net(depth=4, **kwargs)
    if name == "hooked":
        base.blocks[2].fc.register_forward_hook(lambda module, args, out: out * 0.5)
    if name == "mixed_dtypes_hook":  # each block's first parameter bf16, the others float32
        for block in base.blocks:
            block.ln.to(torch.bfloat16)
    if name == "two_kinds":  # blocks 0 and 3 differ from the middle ones: the middle ones share
        base.blocks[0].fc, base.blocks[0].out = nn.Linear(32, 16), nn.Linear(16, 32)
    eager_net, net = copy.deepcopy(base), copy.deepcopy(base)
    eager, ddp = DDP(eager_net), DDP(net)
    if name in ("fp16_hook", "mixed_dtypes_hook"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        for model in (eager, ddp):
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    options = {"cpp_wrapper": True} if name.startswith("cpp_wrapper") else None
    share = name not in ("not_shared", "cpp_wrapper_whole")
    compiled = bucketwise.compile(ddp, backend=backend, strategy=strategy, share_blocks=share, options=options)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager_net, net)]
    worst = relative = 0.0  # relative: float32 gradients, to each one's largest entry
    for step in range(STEPS):
        if name == "retuned" and step == 2:  # after the graph compiled: eager DDP reads the new value
            for block in (*eager_net.blocks, *net.blocks):
                block.temperature = 4.0
        ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(10 * step + rank))
        for model in (eager, compiled):
            torch.manual_seed(step)  # the same dropout masks
            with model.no_sync() if step == 1 else torch.enable_grad():
                model(ids).backward()
        if step == 1:
            continue  # accumulated under no_sync(); compared after the next synced step
        for p, q in zip(eager_net.parameters(), net.parameters()):
            worst = max(worst, (p.grad - q.grad).abs().max().item())
            if p.dtype == torch.float32:
                relative = max(relative, ((p.grad - q.grad).abs().max() / p.grad.abs().max()).item())
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for p, q in zip(eager_net.parameters(), net.parameters()):
        worst = max(worst, (p - q).abs().max().item())
    # Evaluation after training: the blocks' training flags are guarded (dropout switches off).
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        eager.eval(), compiled.eval()
        worst = max(worst, (eager(ids) - compiled(ids)).abs().item())
    report = bucketwise.report(compiled)
    graphs = report.to_dict()["graphs"]
    collectives = _collectives_of_a_step(compiled, ids) if backend == "inductor" else None
    return {
        "collectives": collectives,
        "lines": [line for line in report.table().splitlines() if " share " in line],
        "worst": worst,
        "relative": relative,
        "shared": [g["shared_blocks"] for g in graphs],
        "strategies": [g["strategy"] for g in graphs],
        "buckets": [[b["params"] for b in g["buckets"]] for g in graphs],
        "calls": [net.blocks[0].calls, eager_net.blocks[0].calls] if name == "side_effect" else None,
        "forward_attributes": ["forward" in b.__dict__ for b in net.blocks],
        "notes": report.notes,
    }


def _collectives_of_a_step(model, ids) -> dict[str, int]:
    """The collectives one training step issues, by the process group's operator for each
    (``c10d::``): the traced functional collectives call it from Inductor's Python wrapper and
    from its C++ wrapper alike, where the profiler records the functional operator only in the
    former."""
    from torch.profiler import ProfilerActivity, profile

    model.train()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(ids).backward()
    calls: dict[str, int] = {}
    for e in prof.events():
        if e.name.startswith("c10d::"):
            calls[e.name] = calls.get(e.name, 0) + 1
    return calls


class _Opaque:
    """An argument of every block that is neither a tensor nor a constant."""


def _cases(rank: int, world: int, cases: list[tuple[str, str, str]]) -> dict:
    return {case: _case(rank, *case) for case in cases}


def _run(tmp_path, cases: list[tuple[str, str, str]]) -> dict:
    r0, r1 = run_distributed(_cases, tmp_path, args=(cases,), timeout=900)
    assert r0.keys() == r1.keys()
    return r0


def test_shared_blocks_train_like_eager_ddp_under_every_strategy(tmp_path):
    cases = [("plain", strategy, "aot_eager") for strategy in ("fused", "split", "none")]
    cases += [("checkpointed", "fused", "aot_eager"), ("two_kinds", "fused", "aot_eager")]
    cases += [("fp16_hook", "fused", "aot_eager"), ("shared_scale", "fused", "aot_eager")]
    cases += [("masked", "split", "aot_eager"), ("mixed_dtypes_hook", "fused", "aot_eager")]
    results = _run(tmp_path, cases)
    for case, r in results.items():
        # fp16 on the wire: eager DDP's hook and the block's rounding of the same values agree
        # to fp16's precision, not bit for bit (the sums of 2 ranks are exact in both).
        bound = 1e-3 if case[0].endswith("hook") else 1e-6
        assert r["worst"] <= bound, f"{case}: {r['worst']:.3g} from eager DDP"
    # Each reduced gradient goes back to its own parameter's dtype, as DDP's bucket of that dtype
    # takes it: a float32 gradient is fp16's value, never rounded through another parameter's bf16.
    mixed = results[("mixed_dtypes_hook", "fused", "aot_eager")]
    assert mixed["relative"] <= 1e-3 and mixed["shared"][0]["bucket_per_block"] is True, mixed
    for strategy in ("fused", "split", "none"):
        training = results[("plain", strategy, "aot_eager")]["shared"][0]
        assert training["count"] == 4 and training["compiles"] == 1 and training["class"] == "Block", training
        assert training["saved_seconds"] > 0, training
    # NOTE [a bucket per block]: under fused each block reduces its own parameters, one bucket
    # per block in backward order (the last block's first), the embedding and head around them.
    for name in ("plain", "fp16_hook", "shared_scale"):
        r = results[(name, "fused", "aot_eager")]
        assert r["shared"][0]["bucket_per_block"] is True, r["shared"]
        per_block = [b for b in r["buckets"][0] if all(n.startswith("blocks.") for n in b)]
        assert [{n.split(".")[1] for n in b} for b in per_block] == [{"3"}, {"2"}, {"1"}, {"0"}], r["buckets"]
        assert all(len(b) == 10 for b in per_block), per_block  # every parameter of the block
        others = sorted(n for b in r["buckets"][0] for n in b if not n.startswith("blocks."))
        expected = ["emb.weight", "head.bias", "head.weight"] + (["scale"] if name == "shared_scale" else [])
        assert others == expected, r["buckets"]
    assert "bucket_per_block" not in results[("plain", "split", "aot_eager")]["shared"][0]
    # The synced graph's blocks reduce their buckets; the no_sync() variant's reduce nothing.
    lines = results[("plain", "fused", "aot_eager")]["lines"]
    assert lines[0].startswith("graph 0:") and lines[0].endswith("as one bucket"), lines
    assert not any("bucket" in line for line in lines[1:]), lines
    assert results[("checkpointed", "fused", "aot_eager")]["shared"][0].get("compiles") == 1, results[
        ("checkpointed", "fused", "aot_eager")
    ]
    two = results[("two_kinds", "fused", "aot_eager")]["shared"][0]
    assert (two["count"], two["compiles"]) == (3, 1), two  # block 0 stays in the graph
    # NOTE [Dynamo calls a block]: Dynamo met every block as one call, and left the model as it was.
    for case, r in results.items():
        assert r["shared"][0]["dynamo_calls"] is True, (case, r["shared"])
        assert r["forward_attributes"] == [False] * 4, case
    assert "Dynamo traced each as one call" in lines[0], lines
    # NOTE [computed once before the blocks]: the mask's bias is made once, before the blocks.
    assert "aten::where" in results[("masked", "split", "aot_eager")]["shared"][0]["computed_before_blocks"]
    assert all("computed_before_blocks" not in r["shared"][0] for c, r in results.items() if c[0] != "masked")


def test_blocks_dynamo_must_trace_are_shared_all_the_same_and_say_why(tmp_path):
    cases = [(name, "fused", "aot_eager") for name in ("object_arg", "side_effect", "hooked", "retuned")]
    results = _run(tmp_path, cases)
    for case, r in results.items():
        assert r["worst"] <= 1e-6, f"{case}: {r['worst']:.3g} from eager DDP"
    arg = results[("object_arg", "fused", "aot_eager")]["shared"][0]
    assert arg["compiles"] == 1 and "not a tensor, a number" in arg["dynamo_calls"], arg
    side = results[("side_effect", "fused", "aot_eager")]
    assert "sets module attributes (calls)" in side["shared"][0]["dynamo_calls"], side["shared"]
    # Every call counted, as eager DDP counts them (7 forwards: 4 steps, the no_sync one, eval).
    assert side["calls"][0] == side["calls"][1], side["calls"]
    hooked = results[("hooked", "fused", "aot_eager")]["shared"][0]
    assert hooked["dynamo_calls"] == "blocks.2: module fc has hooks (forward_hooks)", hooked
    assert (hooked["count"], hooked["compiles"]) == (3, 1), hooked  # the hooked block is another computation
    # An attribute a block reads, changed after the graph compiled: Dynamo traces the blocks again
    # with its guards on the new value (trained like eager DDP above) and the report says why.
    retuned = results[("retuned", "fused", "aot_eager")]["shared"]
    assert retuned[0]["dynamo_calls"] is True, retuned
    why = "blocks.0.temperature changed from 8.0 to 4.0 after the graph was compiled"
    assert any(why in f"{s.get('dynamo_calls')} {s.get('reason')}" for s in retuned[1:] if s), retuned


def test_shared_blocks_with_inductor_train_like_eager_ddp(tmp_path):
    # Masked: the blocks' compiled forward also takes the mask's bias, made once before them
    # (NOTE [computed once before the blocks]); the `aot_eager` cases share blocks without a mask.
    # A compress hook's cast is traced into the block's backward with Inductor's decompositions,
    # as the rest of that graph was (Inductor lowers no ``aten._to_copy``).
    cases = [("masked", "fused", "inductor"), ("fp16_hook", "fused", "inductor")]
    results = _run(tmp_path, cases)
    hooked = results[("fp16_hook", "fused", "inductor")]
    assert hooked["worst"] <= 1e-3 and hooked["shared"][0]["bucket_per_block"] is True, hooked
    shared = results[("masked", "fused", "inductor")]
    assert shared["worst"] <= 1e-5, shared
    assert shared["shared"][0]["compiles"] == 1, shared
    assert "aten::where" in shared["shared"][0]["computed_before_blocks"], shared["shared"]
    # The 4 blocks' all-reduces go as one coalesced call, well under the bucket cap (NOTE [block
    # reductions grouped]), beside the bucket of the parameters outside the blocks, and the
    # table's rows are gathered (NOTE [embedding rows]). (Whole graphs under Inductor:
    # test_fused_inductor_overlaps_every_bucket in test_fused_correctness.py.)
    rows = {"c10d::allgather_into_tensor_coalesced_": 1}
    calls = shared["collectives"]
    assert calls == {"c10d::allreduce_coalesced_": 1, "c10d::allreduce_": 1, **rows}, calls


def test_fused_under_inductors_cpp_wrapper_trains_like_eager_ddp(tmp_path):
    """``options={"cpp_wrapper": True}`` (NOTE [collectives the C++ wrapper cannot call]): the
    shared blocks' graphs get the C++ wrapper as the graphs around them do, which call the
    blocks' operators and the buckets' all-reduces, not the coalesced
    all-reduce that groups the blocks' reductions nor the embedding rows' gather; so each block
    reduces its bucket on its own, the table is all-reduced, and the report says both."""
    from bucketwise._compat import inductor as ci

    cases = [("cpp_wrapper", "fused", "inductor"), ("cpp_wrapper_whole", "fused", "inductor")]
    results = _run(tmp_path, cases)
    for case, r in results.items():
        assert r["worst"] <= 1e-5, (case, r["worst"])
        assert ci.CPP_WRAPPER_NO_ROWS in r["notes"], (case, r["notes"])
    shared = results[("cpp_wrapper", "fused", "inductor")]
    assert shared["shared"][0]["compiles"] == 1 and shared["shared"][0]["bucket_per_block"] is True, shared["shared"]
    assert ci.CPP_WRAPPER_UNGROUPED in shared["notes"], shared["notes"]
    # The shared block's own graphs get the C++ wrapper too.
    assert shared["shared"][0].get("cpp_wrapper") is True, shared["shared"]
    whole = results[("cpp_wrapper_whole", "fused", "inductor")]
    assert ci.CPP_WRAPPER_UNGROUPED not in whole["notes"]
    # What a step issued: a bucket per block and one for the rest, the table's gradient in it
    # (no rows gathered) and no coalesced call; whole, one bucket.
    assert shared["collectives"] == {"c10d::allreduce_": 5}, shared["collectives"]
    assert whole["collectives"] == {"c10d::allreduce_": 1}, whole["collectives"]


@pytest.mark.parametrize("why", ["dropout"])
def test_blocks_that_cannot_be_shared_compile_whole_and_say_why(tmp_path, why):
    results = _run(tmp_path, [(why, "fused", "aot_eager")])
    r = results[(why, "fused", "aot_eager")]
    assert r["worst"] <= 1e-6, r
    assert "random numbers" in r["shared"][0]["reason"], r["shared"]


def _hf_checkpointed(rank: int, world: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    import bucketwise

    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        max_position_embeddings=16,
        use_cache=False,
    )
    torch.manual_seed(0)
    net = LlamaForCausalLM(cfg)
    net.gradient_checkpointing_enable()  # HF checkpoints around each layer's call
    eager_net = copy.deepcopy(net)
    eager, compiled = DDP(eager_net), bucketwise.compile(DDP(net), backend="aot_eager", share_blocks=True)
    worst = 0.0
    for step in range(2):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step + 10 * rank))
        for model in (eager, compiled):
            model(input_ids=ids, labels=ids).loss.backward()
        for p, q in zip(eager_net.parameters(), net.parameters()):
            worst = max(worst, (p.grad - q.grad).abs().max().item())
            p.grad = q.grad = None
    return {"worst": worst, "shared": bucketwise.report(compiled).to_dict()["graphs"][0]["shared_blocks"]}


def test_hugging_face_layers_checkpointed_around_each_call_share_like_eager_ddp(tmp_path):
    pytest.importorskip("transformers")
    r0, _ = run_distributed(_hf_checkpointed, tmp_path, timeout=900)
    assert r0["worst"] <= 1e-6, r0
    shared = r0["shared"]
    assert (shared["count"], shared["compiles"], shared["dynamo_calls"]) == (3, 1, True), shared
