"""Restarts: the same job again over the same compile caches (``--restart``).

A developer restarts a training script many times a day; each restart pays the first step of a
new process whose Inductor FX graph cache and AOTAutograd cache are warm. With the compile
caches on (``--compile-cache on``, implied by ``--restart``) every job gets a fresh cache root,
never the user's default cache, and every config its own cache dir under it, so no config reads
from disk what another one compiled. What this process keeps in memory from an earlier config
(Inductor's loaded modules, Triton's compiled kernels) stays, torch having no public call that
drops it: a config can still find there a kernel an earlier one built. ``tax --restarts`` runs
every cold and warm first step in a process of its own. With ``--restart`` the launcher then
runs the job a second time over the same root (``--phase warm``): each config's first step and
warm-up steps, whose first-step seconds (and, for bucketwise configs, the report's compile
times with its cache lookups) become ``warm_first_step_s`` and ``warm_compile_times`` of the
first job's records.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Sequence

from bucketwise.benchmarks.core import procs
from bucketwise.benchmarks.core.output import read_jsonl, safe_name, write_jsonl, write_markdown

PHASES = ("cold", "warm")
CACHE_ENV = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}


def new_cache_root() -> str:
    """A fresh, empty cache root for one job (and its restart)."""
    return tempfile.mkdtemp(prefix="bucketwise-bench-cache-")


def use_config_cache(root: str | None, config: str, *, cold: bool) -> None:
    """Point Inductor (and Triton) at ``config``'s own cache dir under ``root`` (``None``: caches
    off, nothing to do). ``cold``: the dir must be new or empty."""
    if root is None:
        return
    path = os.path.join(root, safe_name(config))
    if cold and os.path.isdir(path) and os.listdir(path):
        raise RuntimeError(
            f"compile cache {path} is not empty, so the first step of {config} would not be cold: "
            "pass an empty --cache-dir (or none: a fresh one is made)"
        )
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    os.environ["TRITON_CACHE_DIR"] = os.path.join(path, "triton")


def run_jobs(job: Sequence[procs.Proc], env: dict[str, str], root: str, *, restart: bool, keep: bool) -> int:
    """The launcher with the compile caches on: the job, then (``restart``) the same job as
    ``--phase warm``, over ``root``; ``root`` is removed afterwards unless ``keep``."""
    try:
        code = procs.run(job, env=env).code
        if not restart:
            return code
        if code != 0:
            print(f"ddp: the first job failed (exit {code}); no restart", flush=True)
            return code
        print(f"restart: the same job again over the compile caches in {root}", flush=True)
        warm_env = dict(
            env, **{"BUCKETWISE_BENCH_ARGV": json.dumps([*json.loads(env["BUCKETWISE_BENCH_ARGV"]), "--phase", "warm"])}
        )
        return procs.run(job, env=warm_env).code
    finally:
        if keep:
            print(f"compile caches kept in {root}", flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)


def merge_warm(out: str, warm: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Add each config's warm figures (``config -> merged warm row``) to the first job's records
    in ``out`` and rewrite ``results.jsonl`` and ``results.md``; returns the records."""
    path = os.path.join(out, "results.jsonl")
    meta, rows = read_jsonl(path)
    for row in rows:
        w = warm.get(row["config"])
        if w is None or row.get("status") != "ok":
            continue
        if "error" in w:
            row["warm_error"] = w["error"]
            continue
        row["warm_first_step_s"] = w["first_step_s"]
        row["warm_compile_times"] = w.get("compile_times")
        row["per_rank"]["warm_first_step_s"] = w["per_rank_first_step_s"]
    meta["restart"] = True
    write_jsonl(path, meta, rows)
    write_markdown(os.path.join(out, "results.md"), meta, rows)
    return rows


def merge_warm_ranks(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One config's warm figures from every rank's: the slowest rank's first step and rank 0's
    compile-time breakdown (bucketwise configs)."""
    errors = [d["error"] for d in ranks if "error" in d]
    if errors:
        return {"error": errors[0].strip().splitlines()[-1]}
    return {
        "first_step_s": max(d["first_step_s"] for d in ranks),
        "compile_times": ranks[0].get("compile_times"),
        "per_rank_first_step_s": [d["first_step_s"] for d in ranks],
    }
