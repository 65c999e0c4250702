"""A Lightning script as it is written without ftsup: a small GPT-2 (transformers, built from a config) in a
LightningModule, `seed_everything`, a shuffled DataLoader, and a Trainer on CPU with DDP on gloo whose only
checkpoints are the default ones (the end of each epoch); `trainer.fit` with no checkpoint to resume from.

    lightning_default.py --loss-log FILE --root DIR [--epochs E] [--pause-s S]

Under torchrun the Trainer takes its ranks from the environment (`devices` = the local world size). Rank 0 appends
`{"step", "loss_hex"}` to the loss log after each optimizer step; `--pause-s` sleeps after each step, so that a test
can act mid-run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel


class Windows(Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int, seq_len: int) -> None:
        self.tokens = torch.randint(0, 256, (n * seq_len,), generator=torch.Generator().manual_seed(1234))
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i * self.seq_len : (i + 1) * self.seq_len]


class LitGPT(pl.LightningModule):
    def __init__(self, loss_log: str, pause_s: float) -> None:
        super().__init__()
        self.model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2))
        self.loss_log, self.pause_s = loss_log, pause_s

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.global_rank == 0:
            with open(self.loss_log, "a") as f:
                f.write(json.dumps({"step": self.global_step, "loss_hex": float(outputs["loss"]).hex()}) + "\n")
        time.sleep(self.pause_s)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--loss-log", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--pause-s", type=float, default=0.0)
    a = p.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0)
    model = LitGPT(a.loss_log, a.pause_s)
    loader = DataLoader(Windows(64, 32), batch_size=4, shuffle=True)
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(
        max_epochs=a.epochs,
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        default_root_dir=a.root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)


if __name__ == "__main__":
    main()
