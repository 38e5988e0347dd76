"""Cold and warm first steps, configs interleaved across fresh processes (``tax --restarts N``).

A config's first step in a new process is what a user waits for at every (re)start. Measured in
the process that already compiled other configs it is not cold (Dynamo, Triton and the compile
workers are warm), so each first step here runs in a process of its own:

- cold: a new process over an empty compile-cache folder (Inductor's FX graph cache, the
  AOTAutograd cache and Triton's kernels, all under it);
- warm: another new process over the same folder, as a restarted job finds it;
- fresh (bucketwise configs): a new process over an empty folder that loads the compiled
  artifacts the cold run saved (``BUCKETWISE_COMPILE_ARTIFACTS``, NOTE [compile artifacts]), as a
  job restarted on a new machine finds them. The cold run saves them at its second step, after
  the first step it is timed on. Loading them is part of building the compiled model, so a
  restart is compared by ``prepare_s`` (building and compiling the model) plus the first step.

Each run also records ``started_s`` (from its spawn to building the model: the interpreter and
the imports) and ``process_s`` (spawn to exit), and is printed as it ends (``TAX_RESTART_RUN``).

Rounds interleave the configs, the order reversed every other round (A B C, C B A, ...), and a
ratio to another config is the median of the per-round ratios. Each child process builds one
config, runs its first step and one more, and prints one JSON line: the first step's seconds,
the second step's, and (bucketwise configs) the report's compile-time breakdown, with its
compile-cache lookups, and first-step breakdown.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from bucketwise.benchmarks.core import procs
from bucketwise.benchmarks.core.configs import recipe_for

ARTIFACTS_ENV = "BUCKETWISE_COMPILE_ARTIFACTS"
"""The default folder of ``bucketwise.compile(artifacts=)`` (docs/user-guide.md)."""

RESULT_MARK = "TAX_FIRST_STEP "
RUN_MARK = "TAX_RESTART_RUN "
SPAWNED_ENV = "BUCKETWISE_TAX_SPAWNED_AT"
"""A child's spawn time (``time.time()``), set by its parent."""


def child_env(cache_dir: str, artifacts: str | None = None) -> dict[str, str]:
    """The environment of a child process: its compile caches on, under ``cache_dir`` only, and
    with ``artifacts`` its compiled artifacts loaded from and saved to that folder."""
    # Its own rendezvous port: the parent's process group still holds the parent's.
    port = str(int(os.environ.get("MASTER_PORT", "29517")) + 1)
    env = {k: v for k, v in os.environ.items() if k != ARTIFACTS_ENV}
    if artifacts is not None:
        env[ARTIFACTS_ENV] = artifacts
    return {
        **env,
        "TORCHINDUCTOR_CACHE_DIR": cache_dir,
        "TRITON_CACHE_DIR": os.path.join(cache_dir, "triton"),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
        "BUCKETWISE_PROGRESS": "0",
        "MASTER_PORT": port,
    }


def run_child(
    model: str,
    config: str,
    backend: str,
    cache_dir: str,
    timeout_s: float,
    extra_args: list[str] = (),
    artifacts: str | None = None,
) -> dict[str, Any]:
    """One new process: ``config``'s first step over ``cache_dir``; its JSON line, or the error."""
    cmd = procs.python(
        "-m",
        "bucketwise.benchmarks",
        "tax",
        "--model",
        model,
        "--configs",
        config,
        "--backend",
        backend,
        "--first-step-only",
        "--out",
        cache_dir,
        *extra_args,
    )
    env = {**child_env(cache_dir, artifacts), SPAWNED_ENV: repr(time.time())}
    t0 = time.perf_counter()
    proc = procs.run([procs.Proc(cmd)], env=env, timeout_s=timeout_s, capture=procs.Capture.ALL)
    if proc.timed_out:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            # The whole process, start to exit: a restart's wait beyond its first step.
            return {**json.loads(line[len(RESULT_MARK) :]), "process_s": time.perf_counter() - t0}
    return {"error": f"exit {proc.code}: {(proc.stderr or proc.stdout)[-1500:]}"}


def started_s() -> float | None:
    """In a child: seconds from its spawn to now (interpreter start and imports)."""
    spawned = os.environ.get(SPAWNED_ENV)
    return time.time() - float(spawned) if spawned else None


def run_restarts(
    model: str, configs: list[str], backend: str, rounds: int, *, timeout_s: float = 900.0, extra_args: list[str] = ()
) -> dict[str, Any]:
    """``rounds`` interleaved rounds of a cold and a warm first step per config."""
    root = tempfile.mkdtemp(prefix="bucketwise-restarts-")
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    try:
        for r in range(rounds):
            order = configs if r % 2 == 0 else configs[::-1]
            for config in order:
                cache, fresh_cache = os.path.join(root, f"r{r}-{config}"), os.path.join(root, f"r{r}-{config}-fresh")
                artifacts = os.path.join(root, f"r{r}-{config}-artifacts") if carries_artifacts(config) else None
                os.makedirs(cache)
                cold = run_child(model, config, backend, cache, timeout_s, list(extra_args), artifacts)
                run = {"cold": cold, "warm": cold}
                if "error" not in cold:
                    run["warm"] = run_child(model, config, backend, cache, timeout_s, list(extra_args))
                if artifacts is not None and "error" not in cold:
                    os.makedirs(fresh_cache)
                    run["fresh"] = run_child(
                        model, config, backend, fresh_cache, timeout_s, list(extra_args), artifacts
                    )
                runs[config].append(run)
                # Every run as it ends, so a job stopped part-way keeps what it measured.
                print(RUN_MARK + json.dumps({"round": r, "config": config, **run}), flush=True)
                fresh = f", fresh machine {_s(run['fresh'])}" if "fresh" in run else ""
                print(
                    f"restarts round {r + 1}/{rounds} {config}: cold {_s(cold)}, warm {_s(run['warm'])}{fresh}",
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"rounds": rounds, "runs": runs, "summary": summarize(runs)}


def carries_artifacts(config: str) -> bool:
    """Whether ``config`` keeps compiled artifacts (``bucketwise.compile``'s, NOTE [compile artifacts])."""
    return recipe_for(config).compiler == "bucketwise"


def _s(run: dict[str, Any]) -> str:
    return f"{run['first_step_s']:.1f} s" if "first_step_s" in run else f"failed ({run['error'][:200]})"


def _first(runs: list[dict[str, Any]], phase: str) -> list[float | None]:
    return [r[phase].get("first_step_s") for r in runs]


def median_ratio(a: list[float | None], b: list[float | None]) -> float | None:
    """Median over rounds of ``a/b`` (rounds where either failed left out)."""
    pairs = [x / y for x, y in zip(a, b) if x is not None and y]
    return statistics.median(pairs) if pairs else None


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per config: median cold and warm first steps, and the ratios the goals name: cold over
    torch's DDPOptimizer (``torch``), and a CUDA-graph config's warm first step over its
    non-graphed twin's (``bw-fused-cg`` over ``bw-fused``)."""
    out = {}
    for config, rs in runs.items():
        cold, warm = _first(rs, "cold"), _first(rs, "warm")
        row = {
            "cold_s": _median(cold),
            "warm_s": _median(warm),
            "cold_runs": cold,
            "warm_runs": warm,
            "first_step_accounted": _median([_accounted(r["cold"]) for r in rs]),
            "cold_fx_graphs": _median([_fx(r["cold"], "hit", "miss", "bypass") for r in rs]),
            "cold_fx_hits": _median([_fx(r["cold"], "hit") for r in rs]),
        }
        row["warm_restart_s"] = _median([_restart(r["warm"]) for r in rs])
        fresh = [r for r in rs if "fresh" in r]
        if fresh:
            restarts = [_restart(r["fresh"]) for r in fresh]
            row["fresh_s"] = _median([r["fresh"].get("first_step_s") for r in fresh])
            row["fresh_restart_s"] = _median(restarts)
            row["fresh_over_warm"] = median_ratio(restarts, [_restart(r["warm"]) for r in fresh])
            row["fresh_fx_hits"] = _median([_fx(r["fresh"], "hit") for r in fresh])
        if "torch" in runs and config != "torch":
            row["cold_over_torch"] = median_ratio(cold, _first(runs["torch"], "cold"))
        twin = config.removesuffix("-cg")
        if config.endswith("-cg") and twin in runs:
            row["warm_over_uncaptured"] = median_ratio(warm, _first(runs[twin], "warm"))
        out[config] = row
    return out


def _restart(run: dict[str, Any]) -> float | None:
    """A restart's wait: building and compiling the model (artifacts loaded), then the first step."""
    if run.get("first_step_s") is None or run.get("prepare_s") is None:
        return None
    return run["prepare_s"] + run["first_step_s"]


def _accounted(run: dict[str, Any]) -> float | None:
    first = run.get("first_step")
    return first["compiled_calls_s"] / run["first_step_s"] if first and run.get("first_step_s") else None


def _fx(run: dict[str, Any], *keys: str) -> float | None:
    """The sum of a child's FX-graph-cache lookups under ``keys`` (``hit``, ``miss``, ``bypass``)
    as its bucketwise report counts them (None for the other configs, which have no report)."""
    times = run.get("compile_times")
    return float(sum(times["fx_graph_cache"][k] for k in keys)) if times else None


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def print_result(result: dict[str, Any]) -> None:
    """The child's one line for its parent."""
    print(RESULT_MARK + json.dumps(result), flush=True)
