"""The ``torch-ca`` config: torch's compiled-DDP path with compiled autograd (DDP's Python
reducer, ``optimize_ddp="python_reducer"``), trained on 2 gloo ranks against eager DDP, and built
beside other configs in one process (as ``tax`` and ``ddp --rounds`` build them) without
changing how those run."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._inductor.config
from support.dist import run_distributed

from bucketwise._compat import ddp as ddpc
from bucketwise._compat import dynamo as dc
from bucketwise._compat import torch_paths as tp
from bucketwise.benchmarks.core.configs import CONFIGS, Recipe
from bucketwise.benchmarks.core.models import make_spec
from bucketwise.benchmarks.core.step import make_step, training_step

SIZES = {"layers": 1, "d_model": 32, "heads": 2, "seq": 8, "batch": 2, "vocab": 64}
STEPS = 4


def _train(rank: int, world_size: int, config: str) -> dict:
    """``config`` built from seed 0 and trained ``STEPS`` steps on this rank's own batch."""
    dc.reset()
    spec = make_spec("gpt-tiny", SIZES)
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = spec.build()
    prepared = CONFIGS[config].prepare(model, device=device, backend="aot_eager", bucket_cap_mb=None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = make_step(
        prepared, spec, opt, spec.make_batch(1 + rank, device), device, mark_cudagraph_step=False, annotate=False
    )
    losses = [step().item() for _ in range(STEPS)]
    ddp = dc.uncompiled(prepared.module)
    return {
        "losses": losses,
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        "python_reducer": ddpc.uses_python_reducer(ddp),
        "captures": tp.compiled_autograd_captures(),
        "graphs": tp.graph_counts(),
    }


def _eager_and_torch_ca(rank: int, world_size: int) -> dict:
    return {config: _train(rank, world_size, config) for config in ("eager", "torch-ca")}


def test_torch_ca_trains_like_eager_ddp_on_two_ranks(tmp_path):
    """Each rank trains on its own batch: the final parameters equal eager DDP's only if every
    step's gradients were averaged over the ranks (a reducer that did not reduce leaves each rank
    with its own parameters), and the backward ran as a compiled autograd graph."""
    ranks = run_distributed(_eager_and_torch_ca, tmp_path, world_size=2)
    for rank, out in enumerate(ranks):
        eager, ca = out["eager"], out["torch-ca"]
        assert ca["python_reducer"] and not eager["python_reducer"]
        assert ca["captures"] >= 1, "the backward did not run under compiled autograd"
        # One forward graph (torch.compile of DDP, no graph break) and one backward graph.
        assert ca["graphs"] == {"unique_graphs": 2, "graph_breaks": 0}, ca["graphs"]
        assert ca["losses"] == pytest.approx(eager["losses"], rel=1e-5), rank
        torch.testing.assert_close(ca["params"], eager["params"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ranks[0]["torch-ca"]["params"], ranks[1]["torch-ca"]["params"], rtol=0, atol=0)
    # The ranks' batches differ, so training without averaging would have left them apart.
    assert ranks[0]["eager"]["losses"][0] != ranks[1]["eager"]["losses"][0]


def _process_state() -> dict:
    """What DDP's constructor changes process-wide for its Python reducer, and what torch-ca's
    steps put in force, as seen between steps."""
    return {
        "optimize_ddp": torch._dynamo.config.optimize_ddp,
        "fuse_ddp": torch._inductor.config._fuse_ddp_communication,
        "fuse_ddp_bucket": torch._inductor.config._fuse_ddp_bucket_size,
        "ddp_inline_rule": tp.ddp_inline_rule_added(),
        "compiled_autograd": tp.compiled_autograd_enabled(),
    }


def test_torch_ca_beside_other_configs_leaves_them_unchanged(single_rank_group):
    """``torch`` built alone, then ``torch-ca`` built first and ``local``, ``torch``, ``bw-auto``
    beside it, their steps interleaved, as ``tax`` builds and runs them: outside torch-ca's own
    steps the process is as before (no Python-reducer mode, no DDP fusion in Inductor, DDP's
    forward skipped by Dynamo as usual, compiled autograd off), and ``torch`` compiles the same
    graphs, breaks them in the same places and trains to the same losses as when built alone
    (also beside ``local``, which compiles the same model code: NOTE [configs side by side]);
    torch-ca compiles nothing after its first step (``torch`` compiles the same wrapper frame of
    ``torch.compile(DDP(model))``, whose entry would otherwise serve torch-ca's calls too)."""
    spec = make_spec("gpt-tiny", SIZES)
    device = torch.device("cpu")
    state = _process_state()

    def built(config: str):
        _, prepared, _, step = training_step(CONFIGS[config], spec, device, "aot_eager", isolated=True)
        return prepared, step

    dc.reset()
    alone, step = built("torch")
    alone_losses = [step().item() for _ in range(3)]
    alone_graphs = tp.graph_counts()
    assert alone_graphs["unique_graphs"] >= 1, alone_graphs
    dc.reset()

    ca, ca_step = built("torch-ca")
    assert ddpc.uses_python_reducer(dc.uncompiled(ca.module))
    assert _process_state() == state, "building torch-ca changed the process"
    others = {}
    for config in ("local", "torch", "bw-auto"):
        prepared, step = built(config)
        others[config] = {"prepared": prepared, "step": step, "losses": []}
    torch_ddp = dc.uncompiled(others["torch"]["prepared"].module)
    assert not ddpc.uses_python_reducer(torch_ddp)
    assert not ddpc.uses_python_reducer(others["bw-auto"]["prepared"].module)
    ca_losses, torch_graphs = [], dict.fromkeys(alone_graphs, 0)
    for i in range(3):
        compiled = (tp.graph_counts(), tp.compiled_autograd_captures())
        ca_losses.append(ca_step().item())
        assert _process_state() == state, "a torch-ca step left its settings in force"
        if i:  # torch-ca runs what it compiled in its first step, not what torch compiled in the same frame
            assert (tp.graph_counts(), tp.compiled_autograd_captures()) == compiled, i
        for config, o in others.items():
            before = tp.graph_counts()
            o["losses"].append(o["step"]().item())
            if config == "torch":  # what Dynamo did for torch's steps alone
                torch_graphs = {k: n + tp.graph_counts()[k] - before[k] for k, n in torch_graphs.items()}
    assert others["torch"]["losses"] == pytest.approx(alone_losses, rel=1e-6)
    assert torch_graphs == alone_graphs
    assert tp.compiled_autograd_captures() >= 1
    # One rank: every DDP config trains like the local floor.
    for config in ("torch", "bw-auto"):
        assert others[config]["losses"] == pytest.approx(others["local"]["losses"], rel=1e-5), config
    assert ca_losses == pytest.approx(others["local"]["losses"], rel=1e-5)


def test_torch_ca_recipe_checks_its_fields():
    assert CONFIGS["torch-ca"].compiled_autograd and CONFIGS["torch-ca"].compiler == "torch"
    for kwargs, message in (
        ({"compiler": "bucketwise", "strategy": "fused"}, "compiler='bucketwise'"),
        ({"compiler": "torch", "ddp": False}, "ddp=False"),
        ({"compiler": "torch", "optimize_ddp": False}, "drop optimize_ddp"),
        ({"compiler": "torch", "comm_hook": "bf16"}, "drop comm_hook"),
        ({"compiler": "torch", "mode": "reduce-overhead"}, "drop mode"),
    ):
        with pytest.raises(ValueError, match=message):
            Recipe(compiled_autograd=True, **kwargs)
