"""CUDA graphs holding NCCL kernels are released before NCCL is torn down, without user action.

NOTE [cuda graphs at teardown] (distributed/teardown.py): with ``strategy="fused"`` and
``cudagraphs=True`` the backward graphs capture the bucket allreduces, and a live recording makes
``destroy_process_group()`` hang on NCCL. On CPU the graphs are emulated
(tests/support/cudagraph_emulator.py), so these tests check the release itself: at
``destroy_process_group()`` on every rank, and at interpreter exit. tests/gpu/test_gpu_exit.py
runs the plain script on 2 GPUs and requires it to exit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from support.cudagraph_emulator import use_emulated_graphs
from support.dist import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP


def _train_fused_with_graphs(steps: int = 3):
    import bucketwise

    use_emulated_graphs()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    compiled = bucketwise.compile(
        DDP(model, bucket_cap_mb=0.0005), backend="inductor", strategy="fused", cudagraphs=True
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        compiled(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return compiled


def _destroy_worker(rank: int, world_size: int, bound_device: bool = False) -> dict:
    import bucketwise

    if bound_device:
        # What init_process_group(device_id=torch.device("cuda", rank)) leaves on the default group:
        # new_group() then asks every new group for that device's backend.
        dist.group.WORLD.bound_device_id = torch.device("cuda", rank)
    compiled = _train_fused_with_graphs()
    stats = bucketwise.report(compiled).cudagraphs
    before = {s.name: s.captured for s in stats}
    dist.destroy_process_group()
    return {
        "before": before,
        "after": {s.name: (s.captured, s.reason) for s in stats},
        "graphs": [g["strategy"] for g in bucketwise.report(compiled).to_dict()["graphs"]],
    }


@pytest.mark.parametrize("bound_device", [False, True], ids=["plain", "init-with-device-id"])
def test_destroy_process_group_releases_captured_graphs(tmp_path, bound_device):
    for r in run_distributed(_destroy_worker, tmp_path, args=(bound_device,), timeout=400):
        assert r["graphs"] == ["fused"], r
        assert any(r["before"].values()), r["before"]  # something was captured ...
        for name, (captured, reason) in r["after"].items():  # ... and nothing is left
            assert not captured, (name, reason)
        assert any("released at destroy_process_group()" in (reason or "") for _, reason in r["after"].values()), r


_EXIT_SCRIPT = textwrap.dedent("""
    import logging, sys
    sys.path[:0] = [{tests!r}, __import__('os').path.dirname({tests!r})]
    import torch.distributed as dist
    from test_teardown import _train_fused_with_graphs
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
    compiled = _train_fused_with_graphs()
    assert any(s.captured for s in __import__("bucketwise").report(compiled).cudagraphs)
    if {fail!r}:
        raise RuntimeError("the training loop failed")
    print("end of script", flush=True)
""")


def _run_script(tmp_path, *, fail: bool) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    tests = os.path.dirname(os.path.abspath(__file__))
    script.write_text(_EXIT_SCRIPT.format(tests=tests, store=tmp_path / "store", fail=fail))
    env = {**os.environ, "BUCKETWISE_PROGRESS": "0", "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)


def test_interpreter_exit_releases_captured_graphs(tmp_path):
    # The script ends without destroy_process_group(): the atexit handler releases.
    done = _run_script(tmp_path, fail=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "end of script" in done.stdout
    assert "released 2 CUDA graph recording(s) at interpreter exit" in done.stderr, done.stderr[-3000:]


def test_exception_in_the_loop_releases_captured_graphs(tmp_path):
    done = _run_script(tmp_path, fail=True)
    assert done.returncode == 1 and "the training loop failed" in done.stderr, done.stderr[-3000:]
    assert "at interpreter exit" in done.stderr, done.stderr[-3000:]


def test_at_exit_parts_run_in_their_order_whatever_the_registration_order(monkeypatch):
    """NOTE [at-exit order]: profile, reports, job stats, CUDA graphs, however the script made
    them register; a part that fails does not stop the next."""
    from bucketwise.distributed import at_exit

    monkeypatch.setattr(at_exit, "_parts", {phase: [] for phase in at_exit.PHASES})
    ran = []

    def part(name, fail=False):
        def fn():
            ran.append(name)
            if fail:
                raise RuntimeError(name)

        return fn

    for phase in reversed(at_exit.PHASES):
        at_exit.at_exit(phase, part(phase, fail=phase == "reports"))
    at_exit.run_all()
    assert ran == list(at_exit.PHASES)
    with pytest.raises(AssertionError, match="at-exit phase"):
        at_exit.at_exit("later", part("x"))


def test_a_job_on_gloo_gives_gloo_threads_the_gil_before_finalization(single_rank_group, monkeypatch):
    """NOTE [gloo at exit]: compiling a DDP model over a gloo group adds the last at-exit phase,
    which sleeps (the GIL released) before the interpreter finalizes."""
    import bucketwise
    from bucketwise.distributed import at_exit, gloo_exit

    monkeypatch.setattr(at_exit, "_parts", {phase: [] for phase in at_exit.PHASES})
    monkeypatch.setattr(at_exit, "_registered", True)
    assert gloo_exit.uses_gloo(single_rank_group) and not gloo_exit.uses_gloo(object())
    bucketwise.compile(DDP(nn.Linear(4, 4)), backend="aot_eager")
    assert at_exit._parts["gloo threads"] == [gloo_exit._settle]

    monkeypatch.setattr(gloo_exit, "SETTLE_S", 0.2)
    started = time.monotonic()
    at_exit.run_all()
    assert time.monotonic() - started >= 0.2


def test_end_process_group_waits_on_gloo_then_destroys(single_rank_group, monkeypatch):
    """What the benchmarks end their groups with (NOTE [gloo at exit]): the wait, then the teardown."""
    from bucketwise.distributed import gloo_exit

    monkeypatch.setattr(gloo_exit, "SETTLE_S", 0.2)
    started = time.monotonic()
    gloo_exit.end_process_group()
    assert time.monotonic() - started >= 0.2 and not dist.is_initialized()
    gloo_exit.end_process_group()  # no group: nothing to do
