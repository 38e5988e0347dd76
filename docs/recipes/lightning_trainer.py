"""The Lightning Trainer with a network compiled by bucketwise (`split`).

    python lightning_trainer.py

The Trainer starts the 2 processes itself; without GPUs they are CPU ranks (gloo).
"""

import lightning as L
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


class Tokens(torch.utils.data.Dataset):
    """Synthetic token sequences: use your own dataset."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(i))


class LitModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.compile(Net(), backend="bucketwise")  # compile the network inside the LightningModule

    def training_step(self, ids, batch_idx):
        logits = self.net(ids)
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        self.log("loss", loss)
        self.print(f"step {batch_idx}: loss {loss.item():.6f}")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main():
    torch.manual_seed(0)
    lit = LitModel()
    trainer = L.Trainer(
        accelerator="auto",
        devices=2,
        strategy="ddp",
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(lit, torch.utils.data.DataLoader(Tokens(), batch_size=4))  # the Trainer adds a DistributedSampler
    if trainer.is_global_zero:
        print(bucketwise.report(lit.net).table())
        torch.save(lit.state_dict(), "lightning-out.pt")


if __name__ == "__main__":
    main()
