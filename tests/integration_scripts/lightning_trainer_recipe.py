"""Lightning Trainer with bucketwise (docs/integrations-recipes.md), next to the same eager Trainer.

Run by tests/test_integration_lightning_trainer.py as ``python lightning_trainer_recipe.py``: the
Trainer's own launcher starts the second rank (``devices=2``, strategy ``ddp``, gloo on CPU).
"""

from __future__ import annotations

import lightning as L
import torch
from _lightning_model import Net, batch, loss_of
from _recipe_io import INNER, save

STEPS = 4


class Tokens(torch.utils.data.Dataset):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, step: int) -> torch.Tensor:
        return batch(step, self.rank)


class LM(L.LightningModule):
    def __init__(self, compiled: bool) -> None:
        super().__init__()
        self.net = Net()
        if compiled:
            # The recipe: compile the network inside the LightningModule.
            self.net = torch.compile(self.net, backend="bucketwise", options=INNER)
        self.losses: list[float] = []

    def training_step(self, ids: torch.Tensor, index: int) -> torch.Tensor:
        loss = loss_of(self.net(ids), ids)
        self.log("loss", loss)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    for run in ("eager", "bucketwise"):
        torch.manual_seed(0)
        lm = LM(run == "bucketwise")
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        # batch_size=None: each item is a whole batch, this rank's own (no sampler reshuffling)
        loader = torch.utils.data.DataLoader(Tokens(trainer.global_rank), batch_size=None)
        trainer.fit(lm, loader)
        net = getattr(lm.net, "_orig_mod", lm.net)
        save(run, trainer.global_rank, net.named_parameters(), lm.losses)


if __name__ == "__main__":
    main()
