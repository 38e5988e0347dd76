"""Run a worker function on N real processes joined in a gloo process group.

``run_distributed(fn, tmp_path, world_size=2, args=(...))`` starts ``world_size`` processes
(NOTE [ranks from a fork server]), initialises a gloo group
through a file store inside ``tmp_path`` (no ports, nothing shared between tests), calls
``fn(rank, world_size, *args)`` on every rank and returns the per-rank return values
(passed back with ``torch.save``); a rank then runs its at-exit handlers and ends without
tearing its group down (``_leave``). A worker exception is re-raised in the test with the
worker's own traceback; a hang is killed after ``timeout`` seconds.

``fn`` must be a module-level function (it is pickled by reference).

NOTE [ranks from a fork server]: a rank started as a new interpreter spends about 5 s of CPU
importing torch, Dynamo and Inductor before it runs a line of the test: with two ranks per test
and two tests at a time on two cores, most of the suite's time. The ranks are forked instead from
a server process (multiprocessing's ``forkserver``, one per test process) that has imported those
modules once and done nothing else: no thread, no process group, no compile, no tensor, so a rank
starts as a fresh interpreter would after the same imports (``spawn`` would import them again).
What it does not share with a new interpreter is the environment read at import time: the
server's is the one the first ranks of the test process started with (``_WORKER_ENV`` included),
and each rank takes the test's environment of the moment as its own first thing (``_entry``), as a
spawned rank inherits it.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 240.0
# Seconds the other ranks get to finish (or fail on their own) once one rank has failed,
# before they are killed: a rank blocked in a collective waiting for a dead peer never returns.
_GRACE_S = 10.0

# Environment of the worker processes (inherited at spawn time).
_WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    # Inductor: compile in-process (no compile-worker pool on a 2-core machine).
    "TORCHINDUCTOR_COMPILE_THREADS": "1",
    # Compile-progress lines are noise in test logs.
    "BUCKETWISE_PROGRESS": "0",
}


# What the fork server imports once (NOTE [ranks from a fork server]).
_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "torch._inductor.compile_fx"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class WorkerError(AssertionError):
    """A rank raised; the message carries every failed rank's traceback."""


class WorkerTimeout(AssertionError):
    """The ranks did not finish within the timeout (killed)."""


def _entry(
    rank: int,
    world_size: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    store_path: str,
    out_dir: str,
    pg_timeout_s: float,
    environ: dict[str, str],
) -> None:
    # The test's environment, not the fork server's (NOTE [ranks from a fork server]).
    os.environ.clear()
    os.environ.update(environ)
    out = Path(out_dir)
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world_size, *args)
        tmp = out / f"rank{rank}.result.tmp"
        torch.save(result, tmp)
        os.replace(tmp, out / f"rank{rank}.result")
    except BaseException:  # noqa: BLE001 - everything goes back to the test
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        _leave(1)
    _leave(0)


def _leave(code: int) -> None:
    """Run the at-exit handlers (what bucketwise writes at exit), then end the process without
    finalizing the interpreter or tearing the gloo group down: a gloo thread still freeing the
    last collective's work needs the GIL, and gets it in neither (NOTE [gloo at exit] in
    distributed/gloo_exit.py). The group goes with the process."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_distributed(
    fn: Callable[..., Any],
    tmp_path: Path,
    *,
    world_size: int = 2,
    args: Sequence[Any] = (),
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; per-rank results."""
    run_dir = Path(tmp_path) / f"dist-{time.monotonic_ns()}"
    run_dir.mkdir(parents=True)
    store = run_dir / "store"
    ctx = _context()
    saved = {k: os.environ.get(k) for k in _WORKER_ENV}
    procs = []
    try:
        os.environ.update(_WORKER_ENV)
        for rank in range(world_size):
            p = ctx.Process(
                target=_entry,
                args=(
                    rank,
                    world_size,
                    fn,
                    tuple(args),
                    str(store),
                    str(run_dir),
                    min(timeout, 120.0),
                    dict(os.environ),
                ),
                name=f"{getattr(fn, '__name__', 'worker')}-rank{rank}",
                daemon=True,
            )
            p.start()
            procs.append(p)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    deadline = time.monotonic() + timeout
    first_failure: float | None = None
    timed_out = False
    killed: set[int] = set()
    try:
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            failed = any((not p.is_alive() and p.exitcode != 0) for p in procs) or any(
                (run_dir / f"rank{r}.error").exists() for r in range(world_size)
            )
            if failed and first_failure is None:
                first_failure = now
            if now > deadline:
                timed_out = True
                break
            if first_failure is not None and now - first_failure > _GRACE_S:
                break
            time.sleep(0.05)
    finally:
        for rank, p in enumerate(procs):
            if p.is_alive():
                killed.add(rank)
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)

    name = getattr(fn, "__name__", repr(fn))
    errors = []
    for rank, p in enumerate(procs):
        err = run_dir / f"rank{rank}.error"
        if err.exists():
            errors.append(f"--- rank {rank} raised:\n{err.read_text()}")
        elif rank in killed:
            why = "still running at the timeout" if timed_out else "still running after another rank failed"
            errors.append(f"--- rank {rank} killed: {why}")
        elif p.exitcode != 0 or not (run_dir / f"rank{rank}.result").exists():
            errors.append(f"--- rank {rank} exited with code {p.exitcode} without a result")
    if timed_out:
        raise WorkerTimeout(f"{name}: ranks still running after {timeout:.0f} s (killed):\n" + "\n".join(errors))
    if errors:
        raise WorkerError(f"{name} failed on rank(s) {', '.join(e.split()[2] for e in errors)}:\n" + "\n".join(errors))
    return [torch.load(run_dir / f"rank{rank}.result", weights_only=False) for rank in range(world_size)]
