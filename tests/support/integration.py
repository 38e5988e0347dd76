"""Run a framework recipe (tests/integrations/scripts/) on 2 CPU ranks, launched the way the
framework launches, and read back what it saved (``_recipe_io.save``) and bucketwise's per-rank
stats (``BUCKETWISE_STATS_DIR``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from support.entry_point import entry_point_dir

SCRIPTS = Path(__file__).resolve().parents[1] / "integrations" / "scripts"
TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_recipe(launcher: list[str], script: str, tmp_path: Path) -> Path:
    """``launcher + [script]`` with the bucketwise entry point visible; returns the output folder."""
    out = Path(tmp_path) / "out"
    (out / "stats").mkdir(parents=True)
    env = dict(os.environ)
    env.update(
        {
            # the entry points pyproject.toml declares, and this checkout, for every rank
            "PYTHONPATH": os.pathsep.join([str(entry_point_dir(tmp_path)), str(SCRIPTS)] + [p for p in sys.path if p]),
            "BUCKETWISE_RECIPE_OUT": str(out),
            "BUCKETWISE_STATS_DIR": str(out / "stats"),
            "BUCKETWISE_PROGRESS": "0",
            "HF_HUB_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    cmd = launcher + [str(SCRIPTS / script)]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )
    return out


def load(out: Path, run: str, rank: int) -> dict:
    return torch.load(out / f"{run}-rank{rank}.pt", weights_only=True)


def assert_same_training(out: Path, *, atol: float = 1e-6, ranks: int = 2) -> None:
    """bucketwise's run ended with the eager run's parameters (and losses), on every rank."""
    for rank in range(ranks):
        eager, compiled = load(out, "eager", rank), load(out, "bucketwise", rank)
        assert eager["params"].keys() == compiled["params"].keys()
        for name, p in eager["params"].items():
            torch.testing.assert_close(
                compiled["params"][name], p, rtol=1e-5, atol=atol, msg=lambda m: f"rank {rank} {name}: {m}"
            )
        torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-5, atol=atol)
        assert len(eager["losses"]) >= 3, eager["losses"]


def strategies(out: Path, ranks: int = 2) -> list[list[str]]:
    """Per rank, the strategy bucketwise applied to each graph (its rank<R>.json)."""
    result = []
    for rank in range(ranks):
        stats = json.loads((out / "stats" / f"rank{rank}.json").read_text())
        result.append([g["strategy"] for g in stats["graphs"] if g.get("variant") is None])
    return result
