import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import bucketwise


def main():
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)).to(device)
    ddp = DDP(model, device_ids=[local_rank] if cuda else None)
    compiled = bucketwise.compile(ddp)  # strategy="auto": fused where it applies
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(rank)  # each rank its own batch (a real job: a DistributedSampler)
    x = torch.randn(64, 32, generator=g).to(device)
    y = torch.randint(0, 8, (64,), generator=g).to(device)
    for step in range(10):
        loss = nn.functional.cross_entropy(compiled(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")

    if rank == 0:
        print(bucketwise.report(compiled).table())
        torch.save(compiled.state_dict(), "model.pt")  # the DDP module's keys
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
