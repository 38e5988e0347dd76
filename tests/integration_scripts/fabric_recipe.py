"""Lightning Fabric with bucketwise (docs/integrations-recipes.md), next to the same eager loop.

Run by tests/test_integration_lightning_fabric.py as ``python fabric_recipe.py``: Fabric's own
launcher starts the second rank (``devices=2``, strategy ``ddp``, gloo on CPU).
"""

from __future__ import annotations

import lightning as L  # before torch.compile: Fabric records its arguments to re-apply them
import torch
from _lightning_model import Net, batch, loss_of
from _recipe_io import INNER, save

STEPS = 4


def train(fabric: L.Fabric, compiled: bool) -> tuple[torch.nn.Module, list[float]]:
    torch.manual_seed(0)
    model = net = Net()
    if compiled:
        # The recipe: compile, then setup(); Fabric re-applies the compile over its DDP module.
        model = torch.compile(model, backend="bucketwise", options=INNER)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    losses = []
    for step in range(STEPS):
        ids = batch(step, fabric.global_rank)
        loss = loss_of(model(ids), ids)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return net, losses


def main() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    for run in ("eager", "bucketwise"):
        model, losses = train(fabric, run == "bucketwise")
        save(run, fabric.global_rank, model.named_parameters(), losses)


if __name__ == "__main__":
    main()
