"""``probe symmetric_ddp`` (benchmarks/probes/symmetric_ddp.py): 2 gloo ranks on the CPU, where it
runs ``local``, ``ddp`` and ``ddp-copy``; its comm hook must reduce exactly as DDP does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def test_the_buffered_hook_reduces_as_ddp_does(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "bucketwise.benchmarks",
        "probe",
        "symmetric_ddp",
        "--model",
        "mlp",
        "--rounds",
        "2",
        "--steps",
        "2",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"probe timed out:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    rows = {r["config"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    # No symmetric windows without NCCL: the CPU run leaves ddp-symm out.
    assert set(rows) == {"local", "ddp", "ddp-copy"}
    # Three warm-up steps and four timed ones, the hook's own buffers from the third step on: the
    # same division and sum as DDP's reducer, so the same parameters to the bit.
    assert rows["ddp-copy"]["max_param_diff_vs_ddp"] == 0.0
    assert rows["ddp"]["max_param_diff_vs_ddp"] == 0.0
    assert all(len(r["step_ms"]) == len(r["cpu_ms"]) == 2 for r in rows.values())
    assert rows["local"]["step_ratio"] == 1.0
