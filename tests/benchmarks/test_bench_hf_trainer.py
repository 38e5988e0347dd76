"""benchmarks/apps/hf_trainer.py on CPU with tiny sizes: the JSON it writes (the two bucketwise
configs only, to stay quick; tests/docs/test_doc_recipes.py and tests/integrations/test_integration_hf_trainer.py
compare them with the eager Trainer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from support.entry_point import entry_point_dir  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "apps" / "hf_trainer.py"


def test_hf_trainer_bench_tiny(tmp_path):
    out = tmp_path / "hf.json"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "BUCKETWISE_PROGRESS": "0",
        "PYTHONPATH": os.pathsep.join([str(entry_point_dir(tmp_path))] + [p for p in sys.path if p]),
    }
    cmd = [sys.executable, str(BENCH), "--tiny", "--configs", "bw-fused,bw-split", "--steps", "4", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(out.read_text())
    meta = result["meta"]
    assert meta["command"].endswith(f"--out {out}") and meta["torch"] and meta["date"], meta
    assert list(result["configs"]) == ["bw-fused", "bw-split"], result["configs"].keys()
    for name, strategies in (("bw-fused", ["fused"]), ("bw-split", ["split"])):
        bw = result["configs"][name]
        assert "error" not in bw, (name, bw)
        assert len(bw["losses"]) == 4 and len(bw["step_seconds"]) == 4 and bw["steps_per_second"] > 0, bw
        assert sorted(bw["bucketwise"]["strategies"]) == strategies, (name, bw["bucketwise"])
    # the same Trainer, the same data: both ways train alike (aot_eager: the same kernels)
    fused, split = (result["configs"][n]["losses"] for n in ("bw-fused", "bw-split"))
    assert max(abs(a - b) for a, b in zip(fused, split)) < 1e-4, (fused, split)


def test_split_without_the_entry_point_says_so(tmp_path, monkeypatch, capsys):
    """A source folder on PYTHONPATH (no ``pip install``) has no backend entry point: the split
    config is recorded with the reason and the fix, without starting a job that would fail."""
    from bucketwise.benchmarks.apps import hf_trainer as bench

    monkeypatch.setattr(bench, "_backend_entry_point", lambda: False)

    def run(job, *a, **k):
        raise AssertionError(f"no job should start: {job}")

    monkeypatch.setattr(bench.procs, "run", run)
    out = tmp_path / "hf.json"
    argv = ["--tiny", "--configs", "bw-split", "--out", str(out)]
    bench.drive(bench.parse(argv), argv)
    assert json.loads(out.read_text())["configs"]["bw-split"]["error"] == bench.NO_ENTRY_POINT
    assert "pip install -e ." in capsys.readouterr().out
