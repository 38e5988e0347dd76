"""Checkpoints move freely between eager DDP, ``torch.compile(DDP)`` and bucketwise, across 2 ranks.

A checkpoint is written through ``torch.distributed.checkpoint`` (``get_state_dict`` then
``dcp.save``) from each kind of model after two AdamW steps, loaded (``dcp.load`` then
``set_state_dict``) into a freshly initialised model of every kind, and training goes on: after
two more steps every model must equal eager DDP trained four steps without a break. The
state-dict helpers and ``torch.func.functional_call`` see the DDP module's names on what
``bucketwise.compile`` returned (NOTE [the compiled module is the module]).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from support.dist import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

KINDS = ("eager", "torch", "bw-fused", "bw-split")
STEPS_BEFORE, STEPS_AFTER = 2, 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(16, 32)
        self.blocks = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(torch.relu(self.emb(x)))))


def _model(kind: str, seed: int) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    """(what the loop calls, the plain module, its optimizer)."""
    import bucketwise

    torch.manual_seed(seed)
    net = Net()
    ddp = DDP(net)
    if kind == "eager":
        model = ddp
    elif kind == "torch":
        model = torch.compile(ddp, backend="aot_eager")
    else:
        model = bucketwise.compile(ddp, backend="aot_eager", strategy=kind.removeprefix("bw-"))
    return model, net, torch.optim.AdamW(net.parameters(), lr=0.01)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, rank: int, first: int, count: int) -> None:
    for step in range(first, first + count):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _worker(rank: int, world: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_state_dict,
    )

    out: dict = {"keys": {}, "load": {}}
    reference, ref_net, ref_opt = _model("eager", seed=0)
    _steps(reference, ref_opt, rank, 0, STEPS_BEFORE + STEPS_AFTER)

    for kind in KINDS:
        model, _, opt = _model(kind, seed=0)
        _steps(model, opt, rank, 0, STEPS_BEFORE)
        msd, osd = get_state_dict(model, opt)
        out["keys"][kind] = (
            sorted(msd),
            sorted(osd["state"]),
            sorted(get_model_state_dict(model)),
            sorted(get_optimizer_state_dict(model, opt)["state"]),
            [name for name, _ in model.named_parameters()],
            sorted(model.state_dict()),
        )
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/{kind}")

    for source in KINDS:
        for target in KINDS:
            model, net, opt = _model(target, seed=1)  # other initial values: the load must set them
            msd, osd = get_state_dict(model, opt)
            loaded = {"model": msd, "optim": osd}
            dcp.load(loaded, checkpoint_id=f"{root}/{source}")
            set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
            _steps(model, opt, rank, STEPS_BEFORE, STEPS_AFTER)
            out["load"][(source, target)] = max(
                (p - q).abs().max().item() for p, q in zip(net.parameters(), ref_net.parameters())
            )

    # functional_call with the names the compiled object gives its parameters.
    model, net, _ = _model("bw-fused", seed=0)
    x = torch.randn(4, 16)
    zeros = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    with torch.no_grad():
        out["functional_call"] = torch.func.functional_call(model, zeros, (x,)).abs().max().item()
        out["functional_call_eager"] = model(x).abs().max().item()
    return out


def test_dcp_checkpoints_load_across_eager_torch_compile_and_bucketwise(tmp_path):
    r0, r1 = run_distributed(_worker, tmp_path, args=(str(tmp_path / "ckpt"),), timeout=600)
    for r in (r0, r1):
        eager_keys = r["keys"]["eager"]
        assert eager_keys[0][0] == "blocks.0.bias" and not any(k.startswith("module.") for k in eager_keys[0])
        for kind in KINDS[2:]:
            ours = r["keys"][kind]
            # get_state_dict, get_model_state_dict and get_optimizer_state_dict give eager DDP's keys.
            assert ours[:4] == eager_keys[:4], (kind, ours[:4], eager_keys[:4])
            # named_parameters() and state_dict() are the DDP module's own ("module." prefix).
            assert ours[4:] == eager_keys[4:], (kind, ours[4:], eager_keys[4:])
        for (source, target), diff in r["load"].items():
            assert diff <= 1e-6, f"checkpoint of {source} loaded into {target}: {diff:.3g} from eager DDP"
        assert len(r["load"]) == len(KINDS) ** 2
        # All-zero parameters through functional_call give a zero output; the module's own do not.
        assert r["functional_call"] == 0.0 and r["functional_call_eager"] > 0
