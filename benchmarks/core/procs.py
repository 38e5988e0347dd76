"""How every harness starts processes: :func:`run` for commands, :func:`spawn_ranks` for ranks of a
Python function.

- :func:`run` starts commands (fresh interpreters): a ``torchrun`` job (:func:`torchrun`), two
  ``bucketwise launch`` node agents (:func:`node_agents`), one process per config (the memory
  harness, the restart runs). Output goes to the terminal, or is captured (``capture``).
- :func:`spawn_ranks` starts ``nproc`` ranks of a picklable function (``spawn``), joined through a
  file store in ``run_dir`` (no ports): the zoo and the numerics check.

Both wait under one policy (:func:`_wait`): once a process fails, the others get ``grace_s`` to
fail on their own (a rank blocked in a collective would otherwise wait for its peer until NCCL's
or the rendezvous's timeout), then they are stopped; past ``timeout_s`` every process is stopped;
Ctrl-C stops them all before it propagates. Every job gets ``ALWAYS_ENV``.

``--net 2node`` emulates two machines on one host: two ``bucketwise launch --nnodes 2
--nproc-per-node 1`` agents meet through a c10d rendezvous on loopback, each owning one GPU (its
own ``CUDA_VISIBLE_DEVICES``); the ddp harness adds ``SOCKET_ENV`` so that NCCL talks over TCP
only. Each agent keeps its own stats folder (``OUT/stats-node<i>``); node 0's prints the job-wide
table.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

ALWAYS_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""Set for every started process: NVLink multicast (NVLS) off, as the GPU hosts require."""
GRACE_S = 10.0


class Capture(str, enum.Enum):
    """What :func:`run` keeps of the first process's output (the rest goes to the terminal)."""

    NONE = "none"
    STDERR = "stderr"
    ALL = "all"


@dataclasses.dataclass(frozen=True)
class Proc:
    """One process to start: its argv and what it adds to the job's environment."""

    argv: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Finished:
    """How a job ended: every process's exit code, which of them were stopped (after another
    failed, at the timeout or at Ctrl-C), and the first process's output when it was captured."""

    codes: list[int | None]
    stopped: list[bool]
    timed_out: bool
    stdout: str = ""
    stderr: str = ""

    @property
    def code(self) -> int:
        """0 if every process exited 0; 124 at the timeout; else the code of the first process
        that failed on its own."""
        if self.timed_out:
            return 124
        own = [c for c, s in zip(self.codes, self.stopped) if not s and c not in (0, None)]
        return next(iter(own), next((c for c in self.codes if c not in (0, None)), 0))


def python(*args: str) -> list[str]:
    """``python -m ...`` with this interpreter."""
    return [sys.executable, *args]


def torchrun(script: str, *, nproc: int, script_args: Sequence[str] = ()) -> Proc:
    """One ``torch.distributed.run --standalone`` job of ``nproc`` ranks running ``script``."""
    return Proc(
        python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), script, *script_args)
    )


def node_agents(script: str, *, out: str, device: str) -> list[Proc]:
    """Two ``bucketwise launch`` agents, one rank and one GPU each, meeting on loopback."""
    port = free_port()
    gpus = _node_gpus(device)
    return [
        Proc(
            python(
                "-m",
                "bucketwise.launch.cli",
                "launch",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                f"ddp-bench-{port}",
                "--stats-dir",
                os.path.join(out, f"stats-node{node}"),
                script,
            ),  # fmt: skip
            {"CUDA_VISIBLE_DEVICES": gpus[node]} if gpus[node] is not None else {},
        )
        for node in range(2)
    ]


def run(
    procs: Sequence[Proc],
    *,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
    capture: Capture = Capture.NONE,
    grace_s: float = GRACE_S,
) -> Finished:
    """Start ``procs`` with ``env`` (default: this process's) plus ``ALWAYS_ENV``, wait for all."""
    capture = Capture(capture)
    base = {**(os.environ if env is None else env), **ALWAYS_ENV}
    with tempfile.TemporaryDirectory(prefix="bucketwise-bench-") as tmp:
        files = [(open(Path(tmp, f"{i}.out"), "w+"), open(Path(tmp, f"{i}.err"), "w+")) for i in range(len(procs))]
        try:
            started = [
                subprocess.Popen(
                    p.argv,
                    env={**base, **p.env},
                    stdout=out if capture is Capture.ALL else None,
                    stderr=err if capture is not Capture.NONE else None,
                    text=True,
                )
                for p, (out, err) in zip(procs, files)
            ]
            timed_out, stopped = _wait([_Popen(p) for p in started], timeout_s, grace_s)
            codes = [p.poll() for p in started]
            stdout = stderr = ""
            if capture is not Capture.NONE and files:
                files[0][0].seek(0)
                files[0][1].seek(0)
                stdout, stderr = files[0][0].read(), files[0][1].read()
            return Finished(codes=codes, stopped=stopped, timed_out=timed_out, stdout=stdout, stderr=stderr)
        finally:
            for out, err in files:
                out.close()
                err.close()


def spawn_ranks(
    target: Callable[..., None],
    args: tuple[Any, ...],
    *,
    nproc: int,
    run_dir: Path,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
    failed: Callable[[], bool] = lambda: False,
    grace_s: float = GRACE_S,
) -> Finished:
    """``target(rank, nproc, store, *args)`` in ``nproc`` spawned interpreters; ``store`` is a
    file in ``run_dir`` for ``init_method=f"file://{store}"``. ``env`` is set in this process
    while the ranks start (spawned interpreters inherit it) and restored after; ``failed`` says
    that a rank failed before it exited (e.g. it wrote an error file)."""
    import torch.multiprocessing as mp

    extra = {**ALWAYS_ENV, **(env or {})}
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    ctx = mp.get_context("spawn")
    store = str(Path(run_dir) / "store")
    try:
        procs = [ctx.Process(target=target, args=(r, nproc, store, *args), daemon=True) for r in range(nproc)]
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    timed_out, stopped = _wait([_Spawned(p) for p in procs], timeout_s, grace_s, failed=failed)
    return Finished(codes=[p.exitcode for p in procs], stopped=stopped, timed_out=timed_out)


class _Handle(Protocol):
    def exit_code(self) -> int | None: ...
    def stop(self) -> None: ...
    def kill(self) -> None: ...
    def join(self, timeout_s: float) -> None: ...


@dataclasses.dataclass
class _Popen:
    p: subprocess.Popen

    def exit_code(self) -> int | None:
        return self.p.poll()

    def stop(self) -> None:
        self.p.terminate()

    def kill(self) -> None:
        self.p.kill()

    def join(self, timeout_s: float) -> None:
        try:
            self.p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass


@dataclasses.dataclass
class _Spawned:
    p: Any  # a multiprocessing Process

    def exit_code(self) -> int | None:
        return None if self.p.is_alive() else self.p.exitcode

    def stop(self) -> None:
        self.p.terminate()

    def kill(self) -> None:
        self.p.kill()

    def join(self, timeout_s: float) -> None:
        self.p.join(timeout_s)


def _wait(
    procs: Sequence[_Handle], timeout_s: float | None, grace_s: float, *, failed: Callable[[], bool] = lambda: False
) -> tuple[bool, list[bool]]:
    """Wait for every process under the policy of the module docstring: whether the timeout hit,
    and which processes were stopped."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failed_at, timed_out = None, False
    try:
        while any(p.exit_code() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and (any(p.exit_code() not in (None, 0) for p in procs) or failed()):
                failed_at = now
            if deadline is not None and now > deadline:
                timed_out = True
                break
            if failed_at is not None and now - failed_at > grace_s:
                break
            time.sleep(0.1)
    finally:  # also on Ctrl-C: no process outlives the harness
        stopped = _stop(procs)
    return timed_out, stopped


def _stop(procs: Sequence[_Handle]) -> list[bool]:
    stopped = [p.exit_code() is None for p in procs]
    running = [p for p, s in zip(procs, stopped) if s]
    for p in running:
        p.stop()
    for p in running:
        p.join(10)
        if p.exit_code() is None:
            p.kill()
            p.join(5)
    return stopped


def _node_gpus(device: str) -> list[str | None]:
    """The GPU of each node agent: the first two visible ones."""
    if device != "cuda":
        return [None, None]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else ["0", "1"]
    if len(ids) < 2:
        raise ValueError(f"--net 2node needs 2 visible GPUs (one per node), CUDA_VISIBLE_DEVICES={visible!r}")
    return ids[:2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
