"""A plain ``fused`` + ``cudagraphs=True`` training script exits by itself (2 GPUs, NCCL).

Each case runs the script below under torchrun as a subprocess, exactly as a user would write
it: no release call before ``dist.destroy_process_group()``. The backward graphs capture the
bucket allreduces' NCCL kernels, and a live capture makes NCCL's teardown hang (NOTE [cuda graphs
at teardown] in distributed/teardown.py). Required: once the ranks have trained, the job is over
within 30 s, with exit code 0 (plain end), or the script's own error (an exception in the loop),
or at Ctrl-C. On a host with one GPU the script runs on one rank (the Ctrl-C case then has no
peer whose collective could be left waiting). Run on the device machines: ``pytest tests/gpu/test_gpu_exit.py``; set
``BUCKETWISE_EXIT_LOG`` to a folder to keep each run's output.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

NPROC = min(2, torch.cuda.device_count())

EXIT_WITHIN_S = 30.0

SCRIPT = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import bucketwise
    from bucketwise.launch.models import GPT, GPTConfig, synthetic_tokens

    mode = sys.argv[1]
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    # "device_id": the default group bound to the rank's GPU, as torch recommends
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank) if mode == "device_id" else None)
    cfg = GPTConfig(vocab=1024, seq=64, layers=2, d_model=128, heads=4)
    torch.manual_seed(0)
    model = DDP(GPT(cfg).cuda(), device_ids=[rank])
    compiled = bucketwise.compile(model, strategy="fused", cudagraphs=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = 0
    while mode == "interrupt" or step < 6:
        x, y = synthetic_tokens(cfg, 4, seed=1000 * rank + step, device="cuda")
        compiled(x, y).backward()
        opt.step()
        opt.zero_grad()
        if step == 5:
            captured = [s.name for s in bucketwise.report(compiled).cudagraphs if s.captured]
            print(f"rank {rank}: trained, replaying {captured}", flush=True)
            if mode == "raise":
                raise RuntimeError("an error in the training loop")
        step += 1
    dist.destroy_process_group()
    print(f"rank {rank}: destroyed the process group", flush=True)
""")


def _run(tmp_path, mode: str) -> tuple[int | None, str, float | None]:
    """Run the script; returns (exit code or None if it had to be killed, output, seconds from
    the last rank's "trained" line to the end)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {
        **os.environ,
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
        "BUCKETWISE_PROGRESS": "0",
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(NPROC),
        str(script),
        mode,
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    lines: list[str] = []
    trained: list[float] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if ": trained" in line:
                trained.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 600  # compile time included
    while len(trained) < NPROC and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    start = trained[-1] if len(trained) == NPROC else None
    if start is not None and mode == "interrupt":
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the terminal: the whole process group
    try:
        proc.wait(timeout=EXIT_WITHIN_S if start is not None else 60)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    reader.join(5)
    took = time.monotonic() - start if start is not None and code is not None else None
    out = "".join(lines)
    log_dir = os.environ.get("BUCKETWISE_EXIT_LOG")
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        with open(os.path.join(log_dir, f"exit-{mode}.log"), "w") as f:
            f.write(
                f"$ {' '.join(cmd[1:])}\nexit code {code}, "
                f"{took if took is None else round(took, 2)} s after training\n\n{out}"
            )
    return code, out, took


@pytest.mark.parametrize("mode", ["plain", "device_id"])
def test_plain_script_exits_by_itself(tmp_path, mode):
    code, out, took = _run(tmp_path, mode)
    assert code == 0, f"exit code {code} (None: still running {EXIT_WITHIN_S} s after training, killed)\n{out[-4000:]}"
    assert out.count("destroyed the process group") == NPROC, out[-4000:]
    assert "backward" in out, "nothing was captured: the test would prove nothing\n" + out[-4000:]
    assert took is not None and took < EXIT_WITHIN_S


def test_exception_in_the_loop_exits(tmp_path):
    code, out, took = _run(tmp_path, "raise")
    assert code not in (0, None), f"exit code {code}\n{out[-4000:]}"
    assert "an error in the training loop" in out, out[-4000:]


def test_ctrl_c_exits(tmp_path):
    code, out, took = _run(tmp_path, "interrupt")
    assert code is not None, f"still running {EXIT_WITHIN_S} s after Ctrl-C (killed)\n{out[-4000:]}"
    assert "KeyboardInterrupt" in out or code != 0, out[-4000:]
