"""A training loop under Lightning Fabric, compiled by bucketwise (`fused`).

    python fabric_loop.py

Fabric starts the 2 processes itself; without GPUs they are CPU ranks (gloo).
"""

import lightning as L  # before torch.compile: Fabric records its arguments and re-applies them
import torch
import torch.nn as nn

import bucketwise


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 64)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3)
        )
        self.head = nn.Linear(64, 64)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def main():
    fabric = L.Fabric(accelerator="auto", devices=2, strategy="ddp")  # auto: GPUs where there are, else CPU
    fabric.launch()
    torch.manual_seed(0)
    model = torch.compile(Net(), backend="bucketwise")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)  # DDP, then torch.compile(DDP(net), backend="bucketwise")
    for step in range(4):
        gen = torch.Generator().manual_seed(100 * step + fabric.global_rank)  # each rank its own batch
        ids = torch.randint(0, 64, (4, 12), generator=gen).to(fabric.device)
        logits = model(ids)
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        fabric.print(f"step {step}: loss {loss.item():.6f}")
    fabric.print(bucketwise.report(model).table())
    fabric.save("fabric-out.ckpt", {"model": model})


if __name__ == "__main__":
    main()
