"""``probe host_tax`` on the CPU (one gloo rank): every config's step, and every thread's own time
per part of the step, where DDP's collectives and bucketwise's own Python show for the default
and not for plain ``torch.compile``."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_host_tax_probe_splits_each_threads_time_on_the_cpu(tmp_path):
    tiny = ["--model", "llama", "--layers", "2", "--d-model", "64", "--heads", "2", "--seq", "8", "--batch", "1"]
    cmd = [sys.executable, "-m", "bucketwise.benchmarks", "probe", "host_tax", *tiny, "--vocab", "128"]
    cmd += ["--threads", "1", "--configs", "local,bw-auto", "--rounds", "1", "--steps", "2", "--out", str(tmp_path)]
    env = {**os.environ, "BUCKETWISE_PROGRESS": "0", "MASTER_PORT": "29643", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["meta"]["device"] == "cpu" and data["meta"]["threads"] == 1
    local, default = ({r["config"]: r for r in data["rows"]}[c]["threads"] for c in ("local", "bw-auto"))
    assert local["main"]["ops and kernels"] > 0 and default["main"]["ops and kernels"] > 0
    # DDP's all-reduce and bucketwise's forward path are the default's only.
    assert default["main"]["collectives"] > 0 and "collectives" not in local["main"], (local, default)
    assert default["main"]["bucketwise"] > 0 and "bucketwise" not in local["main"], (local, default)
    assert "Every thread's own time per step" in (tmp_path / "results.md").read_text()


def test_python_events_told_by_name_as_torchs_flag_tells_them():
    # torch 2.11 (the GPU machines') has no is_python_function on profiler events: the probe
    # tells Python functions' events by their names there, which must agree with the flag.
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bucketwise.benchmarks.probes import host_tax

    model = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), backend="aot_eager")
    model(torch.randn(4, 8)).sum().backward()
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        model(torch.randn(4, 8)).sum().backward()
    events = list(prof.events())
    by_flag = [e.is_python_function for e in events]
    by_name = [host_tax._PYTHON_NAME.match(e.name) is not None for e in events]
    assert any(by_flag) and not all(by_flag)
    assert by_name == by_flag, [e.name for e, a, b in zip(events, by_flag, by_name) if a != b][:10]
