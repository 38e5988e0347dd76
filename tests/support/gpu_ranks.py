"""Run a GPU test's worker on spawned ranks (one GPU each) and fail with every rank's error."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_worker_script(tmp_path: Path, source: str, *args: str, timeout: float = 600) -> list[str]:
    """``source`` run as a script of its own (a new interpreter, one rank) with ``args`` and no
    progress lines; the lines it printed, of which at least one ``RESULT`` line (the last is
    printed here), or a failure with the end of its stderr."""
    return run_worker_scripts(tmp_path, source, {"worker": args}, timeout=timeout)["worker"]


def run_worker_scripts(
    tmp_path: Path, source: str, cases: dict[str, Sequence[str]], *, timeout: float = 600
) -> dict[str, list[str]]:
    """``source`` run as a script of its own, once per case with the case's args (a new
    interpreter, one rank, no progress lines), all at once (compiling, one thread each, is most of
    their time); each case's printed lines. Fails naming every case that printed no ``RESULT``
    line, with the end of its stderr."""
    script = tmp_path / "worker.py"
    script.write_text(source)
    env = {**os.environ, "BUCKETWISE_PROGRESS": "0"}
    procs = {}
    for name, args in cases.items():
        out, err = (open(tmp_path / f"{name}.{kind}", "w") for kind in ("out", "err"))
        with out, err:
            procs[name] = subprocess.Popen([sys.executable, str(script), *args], stdout=out, stderr=err, env=env)
    failed, printed = [], {}
    deadline = time.monotonic() + timeout  # for all of them: they run at once
    for name, proc in procs.items():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        printed[name] = (tmp_path / f"{name}.out").read_text().splitlines()
        results = [line for line in printed[name] if line.startswith("RESULT")]
        if not results:
            failed.append(f"{name} (exit {proc.returncode}):\n{(tmp_path / f'{name}.err').read_text()[-3000:]}")
        else:
            print(name, results[-1])
    assert not failed, "\n\n".join(failed)
    return printed


def run_two_ranks(worker: Callable[..., None], store: str, *args: Any, timeout: float = 400) -> None:
    """``worker(rank, 2, store, *args, errors)`` on ranks 0 and 1; a rank puts its traceback into
    ``errors`` (a queue) when it fails."""
    run_ranks(2, worker, store, *args, timeout=timeout)


def run_ranks(world: int, worker: Callable[..., None], store: str, *args: Any, timeout: float = 400) -> None:
    """``worker(rank, world, store, *args, errors)`` on ranks ``0 .. world - 1``, as
    :func:`run_two_ranks`."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    procs = [ctx.Process(target=worker, args=(r, world, store, *args, errors)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout  # for all of them: they run at once
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            pytest.fail(f"{getattr(worker, '__module__', '')}: a rank did not finish within {timeout:.0f} s")
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures, "\n".join(failures)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def world_of_one(store: str, device: torch.device) -> None:
    """This process as the one rank of a process group through the file ``store`` (NCCL on a GPU,
    gloo on the CPU), with NVLink multicast off as on the device machines, float32 matmuls in
    full precision (TF32 off) and no progress lines."""
    os.environ.update(
        NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1", BUCKETWISE_PROGRESS="0"
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"file://{store}",
        rank=0,
        world_size=1,
        device_id=device if cuda else None,
    )


def step_side_by_side(pairs: Sequence[tuple[Any, Any]], *inputs: Any) -> list[float]:
    """One training step of each ``(model, optimizer)`` pair on the same inputs (the model returns
    the loss); the losses, in order."""
    losses = []
    for model, opt in pairs:
        opt.zero_grad(set_to_none=True)
        loss = model(*inputs)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
