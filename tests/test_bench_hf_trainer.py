"""benchmarks/hf_trainer_bench.py on CPU with tiny sizes: the JSON it writes (the bucketwise
config only, to stay quick; tests/test_integration_hf_trainer.py compares the recipe with eager)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _entry_point import entry_point_dir  # noqa: E402

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "hf_trainer_bench.py"


def test_hf_trainer_bench_tiny(tmp_path):
    out = tmp_path / "hf.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BUCKETWISE_PROGRESS": "0",
           "PYTHONPATH": os.pathsep.join([str(entry_point_dir(tmp_path))] + [p for p in sys.path if p])}
    cmd = [sys.executable, str(BENCH), "--tiny", "--configs", "bucketwise", "--steps", "4", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(out.read_text())
    meta = result["meta"]
    assert meta["command"].endswith(f"--out {out}") and meta["torch"] and meta["date"], meta
    assert list(result["configs"]) == ["bucketwise"], result["configs"].keys()
    bw = result["configs"]["bucketwise"]
    assert len(bw["losses"]) == 4 and len(bw["step_seconds"]) == 4 and bw["median_step_ms"] > 0, bw
    assert bw["bucketwise"]["strategies"] == ["split"], bw["bucketwise"]
