"""How ``ddp_bench.py`` starts its ranks: one torchrun job, or two node agents (``--net 2node``).

``--net 2node`` emulates two machines on one host: two ``bucketwise launch --nnodes 2
--nproc-per-node 1`` agents meet through a c10d rendezvous on loopback, each owning one GPU
(its own ``CUDA_VISIBLE_DEVICES``), and NCCL talks over TCP sockets only (``SOCKET_ENV``: no
NVLink P2P, no shared memory), as between two nodes on Ethernet. Each agent keeps its own stats
folder (``OUT/stats-node<i>``); node 0's prints the job-wide table.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Sequence

Command = tuple[list[str], dict[str, str]]
"""A process to start: its argv and the environment it adds to the job's."""


def commands(script: str, *, nproc: int, net: str, out: str, device: str) -> list[Command]:
    """The launcher processes of one job."""
    if net != "2node":
        return [
            (
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), script],
                {},
            )
        ]
    if nproc != 2:
        raise ValueError(f"--net 2node runs 2 ranks (one per node), got --nproc {nproc}")
    port = _free_port()
    gpus = _node_gpus(device)
    return [
        (
            [
                sys.executable,
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
            ],
            {"CUDA_VISIBLE_DEVICES": gpus[node]} if gpus[node] is not None else {},
        )
        for node in range(2)
    ]


def run(job: Sequence[Command], env: dict[str, str]) -> int:
    """Start every launcher of the job and wait for all; once one fails, the others are stopped
    (a node agent would otherwise wait for its peer until the rendezvous times out)."""
    procs = [subprocess.Popen(cmd, env={**env, **extra}) for cmd, extra in job]
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            time.sleep(10)  # the others get to fail on their own first
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            break
        time.sleep(0.2)
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c != 0), 0)


def _node_gpus(device: str) -> list[str | None]:
    """The GPU of each node agent: the first two visible ones."""
    if device != "cuda":
        return [None, None]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else ["0", "1"]
    if len(ids) < 2:
        raise ValueError(f"--net 2node needs 2 visible GPUs (one per node), CUDA_VISIBLE_DEVICES={visible!r}")
    return ids[:2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
