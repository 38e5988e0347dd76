"""bucketwise.compile(DDP(model)) with torch's powerSGD_hook on one gloo rank (argv[1]: default, fused or split)."""

import faulthandler
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P
from torch.nn.parallel import DistributedDataParallel as DDP

import bucketwise
from bucketwise.launch.models import GPT, GPTConfig, synthetic_tokens

faulthandler.dump_traceback_later(float(os.environ.get("DUMP_AFTER", "150")), exit=True)
torch.set_num_threads(1)
os.environ["BUCKETWISE_PROGRESS"] = "0"
d = tempfile.mkdtemp()
dist.init_process_group("gloo", init_method=f"file://{d}/s", rank=0, world_size=1)
cfg = GPTConfig(vocab=512, seq=64, layers=2, d_model=64, heads=4)
m = DDP(GPT(cfg), bucket_cap_mb=0.05)
m.register_comm_hook(
    P.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=0.5),
    P.powerSGD_hook,
)
kw = {} if sys.argv[1] == "default" else {"strategy": sys.argv[1]}
run = bucketwise.compile(m, **kw)
for step in range(8):
    x, y = synthetic_tokens(cfg, 4, seed=step)
    run(x, y).backward()
    print("step", step, "ok", flush=True)
print("strategy", [g.strategy for g in bucketwise.report(run).graphs], flush=True)
