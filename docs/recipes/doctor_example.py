"""A script for `bucketwise doctor` (docs/troubleshooting.md): 3 linear layers with `torch.relu`
between them, split into 2 segments at DDP's buckets, a few steps on CPU ranks (gloo) or GPUs.

    bucketwise doctor --standalone --nproc-per-node 2 doctor_example.py
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import bucketwise


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 300), nn.Linear(300, 300), nn.Linear(300, 4)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def main():
    cuda = torch.cuda.is_available()  # the device switch: GPUs where there are, else CPU ranks (gloo)
    dist.init_process_group("nccl" if cuda else "gloo")
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    ddp = DDP(Net().to(device), device_ids=[local_rank] if cuda else None, bucket_cap_mb=0.3)
    compiled = bucketwise.compile(ddp, strategy="split")
    for _ in range(2):
        compiled(torch.randn(8, 16, device=device)).sum().backward()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
