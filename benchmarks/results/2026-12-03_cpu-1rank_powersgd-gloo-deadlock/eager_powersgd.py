"""Eager DDP with torch's powerSGD_hook on one gloo rank: prints a line per round, or the threads' stacks after 30 s."""

import faulthandler
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P
from torch.nn.parallel import DistributedDataParallel as DDP

# The model file alone, from the repository root: bucketwise is not imported.
sys.path.insert(0, "launch")
from models import GPT, GPTConfig, synthetic_tokens  # noqa: E402

faulthandler.dump_traceback_later(30, exit=True)
torch.set_num_threads(int(os.environ.get("T", "1")))
d = tempfile.mkdtemp()
dist.init_process_group("gloo", init_method=f"file://{d}/s", rank=0, world_size=1)
cfg = GPTConfig(vocab=512, seq=64, layers=2, d_model=64, heads=4)
for rnd in range(int(sys.argv[1])):
    m = DDP(GPT(cfg), bucket_cap_mb=0.05)
    m.register_comm_hook(
        P.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=0.5
        ),
        P.powerSGD_hook,
    )
    for step in range(5):
        x, y = synthetic_tokens(cfg, 4, seed=step)
        m(x, y).backward()
    print("round", rnd, "ok", flush=True)
