"""Run one zoo model on N fresh processes and merge what the ranks found.

Each rank is a ``spawn``ed interpreter joined through a file store (no ports): gloo on CPU,
NCCL on its own GPU. A rank writes ``rank<R>.json``; a rank that raises writes
``rank<R>.error``. Ranks still running at the timeout, or some seconds after another rank
failed (blocked in a collective), are killed.
"""

from __future__ import annotations

import datetime
import functools
import json
import time
import traceback
from pathlib import Path
from typing import Any

from bucketwise.benchmarks.core import procs

WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TORCHINDUCTOR_COMPILE_THREADS": "1",
    "BUCKETWISE_PROGRESS": "0",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
"""On CPU; on CUDA only the last three (Inductor compiles with its worker pool)."""
GRACE_S = 20.0
ORDER = {"pass": 0, "fallback": 1, "mismatch": 2, "error": 3}


def _rank_main(rank: int, nproc: int, store: str, name: str, opts: dict[str, Any], out: str) -> None:
    import torch
    import torch.distributed as dist

    from bucketwise.benchmarks.zoo.run import run_model
    from bucketwise.distributed.gloo_exit import end_process_group

    try:
        if opts["device"] == "cuda":
            torch.cuda.set_device(rank)
            backend = "nccl"
        else:
            torch.set_num_threads(1)
            backend = "gloo"
        dist.init_process_group(
            backend, init_method=f"file://{store}", rank=rank, world_size=nproc, timeout=datetime.timedelta(seconds=600)
        )
        try:
            result = run_model(rank, nproc, name, opts)
        finally:
            end_process_group()
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        Path(out, f"rank{rank}.error").write_text(traceback.format_exc())
        raise SystemExit(1) from None


@functools.cache
def importable(package: str) -> str | None:
    """``None`` if ``import package`` works in a fresh interpreter, else its last error line."""
    done = procs.run([procs.Proc(procs.python("-c", f"import {package}"))], timeout_s=300, capture=procs.Capture.ALL)
    if done.code == 0:
        return None
    lines = done.stderr.strip().splitlines()
    return lines[-1][:300] if lines else f"exit code {done.code}"


def run_ranks(
    name: str, opts: dict[str, Any], *, nproc: int, device: str, work: Path, timeout_s: float
) -> dict[str, Any]:
    run_dir = Path(work) / f"{name}-{time.monotonic_ns()}"
    run_dir.mkdir(parents=True)
    env = (
        WORKER_ENV
        if device == "cpu"
        else {k: WORKER_ENV[k] for k in ("BUCKETWISE_PROGRESS", "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM")}
    )
    done = procs.spawn_ranks(
        _rank_main,
        (name, opts, str(run_dir)),
        nproc=nproc,
        run_dir=run_dir,
        env=env,
        timeout_s=timeout_s,
        failed=lambda: any(run_dir.glob("*.error")),
        grace_s=GRACE_S,
    )
    errors = {
        r: (run_dir / f"rank{r}.error").read_text() for r in range(nproc) if (run_dir / f"rank{r}.error").exists()
    }
    ranks = [
        json.loads((run_dir / f"rank{r}.json").read_text())
        for r in range(nproc)
        if (run_dir / f"rank{r}.json").exists()
    ]
    if len(ranks) == nproc:
        return {"model": name, "status": "ran", **merge(ranks)}
    why = f"timed out after {timeout_s:g} s" if done.timed_out else "a rank failed"
    first = next(iter(errors.values()), "")
    last = [ln for ln in first.strip().splitlines() if ln.strip()][-1:] or [f"exit codes {done.codes}"]
    out = {"model": name, "status": "error", "reason": f"{why}: {last[0][:400]}", "traceback": first[-4000:]}
    return {**out, "timed_out": True} if done.timed_out else out


def merge(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's record per config, with the worst status and check over every rank."""
    configs = []
    for i, rec in enumerate(ranks[0]["configs"]):
        per_rank = [r["configs"][i] for r in ranks]
        merged = dict(rec)
        merged["status"] = max((c["status"] for c in per_rank), key=lambda s: ORDER.get(s, 0))
        worst_err = next((c for c in per_rank if c["status"] == "error"), None)
        if worst_err is not None:
            merged.update({k: worst_err[k] for k in ("error", "traceback")})
        checks = [c["check"] for c in per_rank if "check" in c]
        if checks:
            merged["check"] = max(checks, key=lambda c: c["ratio"])
        configs.append(merged)
    return {"configs": configs}
