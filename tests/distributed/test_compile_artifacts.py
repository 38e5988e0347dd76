"""A job carries its compiled artifacts: a restart with empty compile caches compiles from hits
(NOTE [compile artifacts]).

Two real ranks train a small GPT under ``fused`` with Inductor next to eager DDP. The first job
starts with empty caches and ``artifacts=DIR``: after its first step each rank's file is saved.
The second job starts with other, empty caches and only ``BUCKETWISE_COMPILE_ARTIFACTS=DIR``
(what ``bucketwise launch --compile-artifacts DIR`` sets): it loads the files, its compiles are
cache hits with no miss, it leaves the files as they were, and it trains like eager DDP.
"""

from __future__ import annotations

import copy
import os

import torch
from support.dist import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 3


def _job(rank: int, world: int, cache_dir: str, artifacts: str | None, env_artifacts: str | None) -> dict:
    import bucketwise
    from bucketwise.launch.models import GPT, GPTConfig

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, f"rank{rank}")
    if env_artifacts is not None:
        os.environ["BUCKETWISE_COMPILE_ARTIFACTS"] = env_artifacts
    torch.manual_seed(0)
    net = GPT(GPTConfig(vocab=256, seq=16, layers=2, d_model=32, heads=2))
    eager_net = copy.deepcopy(net)
    eager, compiled = DDP(eager_net), bucketwise.compile(DDP(net), strategy="fused", artifacts=artifacts)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager_net, net)]
    worst = 0.0
    for step in range(STEPS):
        ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(10 * step + rank))
        for model in (eager, compiled):
            model(ids, ids).backward()
        for p, q in zip(eager_net.parameters(), net.parameters()):
            worst = max(worst, ((p.grad - q.grad).abs().max() / (p.grad.abs().max() + 1e-12)).item())
        for opt in opts:
            opt.step()
            opt.zero_grad()
    report = bucketwise.report(compiled)
    times = report.totals["compile_times"]
    folder = artifacts or env_artifacts
    return {
        "worst": worst,
        "notes": [n for n in report.to_dict()["notes"] if n.startswith("compile artifacts")],
        "fx": times["fx_graph_cache"],
        "aot": times["aot_autograd_cache"],
        "files": {f: os.stat(os.path.join(folder, f)).st_mtime_ns for f in sorted(os.listdir(folder))},
    }


def test_a_restart_with_empty_caches_compiles_from_the_artifacts_of_the_first_job(tmp_path):
    folder = str(tmp_path / "artifacts")
    first = run_distributed(_job, tmp_path, args=(str(tmp_path / "cache-a"), folder, None), timeout=900)
    for rank, r in enumerate(first):
        assert r["worst"] <= 1e-4, r
        assert r["fx"]["miss"] > 0 and r["fx"]["hit"] == 0, r["fx"]
        assert r["notes"][0].startswith("compile artifacts: none at"), r["notes"]
        assert r["notes"][1].startswith(f"compile artifacts: saved {folder}/rank{rank}.bin ("), r["notes"]
    assert sorted(first[0]["files"]) == ["rank0.bin", "rank1.bin"], first[0]["files"]
    second = run_distributed(_job, tmp_path, args=(str(tmp_path / "cache-b"), None, folder), timeout=900)
    for rank, r in enumerate(second):
        assert r["worst"] <= 1e-4, r
        assert r["notes"] == [r["notes"][0]], r["notes"]
        assert r["notes"][0].startswith(f"compile artifacts: loaded {folder}/rank{rank}.bin ("), r["notes"]
        assert "Inductor" in r["notes"][0], r["notes"]
        # Every compile a cache hit: nothing missed, nothing saved again.
        assert r["fx"]["hit"] > 0 and r["fx"]["miss"] == 0, r["fx"]
        assert r["aot"]["miss"] == 0, r["aot"]
        assert r["files"] == first[0]["files"], (r["files"], first[0]["files"])
