"""``cudagraphs=True`` on zoo models whose graphs record in an order other than they replay
(one GPU, one NCCL rank): T5 and Whisper break into several graphs, and one backward records a
step after the others. With one memory pool shared by every recording, the gradients it wrote
were overwritten by the scratch of the backwards replayed after it (NOTE [a forward and its
backward share a pool]: now only a backward recorded right after its forward joins that
forward's pool). Each model trains under eager DDP, ``bw-fused`` and ``bw-fused-cg``, through the
zoo's own command; the parameters after training must match eager DDP's.

Skipped without CUDA or transformers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("model", ["t5", "whisper"])
def test_graphs_recorded_out_of_order_keep_gradients(tmp_path, model):
    pytest.importorskip("transformers")
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "zoo.py"),
        "--device",
        "cuda",
        "--models",
        model,
        "--configs",
        "bw-fused,bw-fused-cg",
        "--out",
        str(tmp_path),
    ]
    subprocess.run(cmd, check=True, timeout=600)
    (rec,) = json.loads((tmp_path / "zoo.json").read_text())["models"]
    statuses = {c["config"]: c["status"] for c in rec.get("configs", [])}
    assert statuses == {"eager": "pass", "bw-fused": "pass", "bw-fused-cg": "pass"}, json.dumps(rec)[:4000]
    cg = next(c for c in rec["configs"] if c["config"] == "bw-fused-cg")["cuda_graphs"]
    assert cg["replays"] > 0, cg
