"""A training script without a line of ftsup, written after PyTorch's torchrun tutorial ("Fault-tolerant Distributed
Training with torchrun", multigpu_torchrun.py) on CPU: DDP on gloo, a DistributedSampler, SGD, and a snapshot that
rank 0 saves every `save_every` epochs and every rank loads at start.

    elastic_ddp.py TOTAL_EPOCHS SAVE_EVERY [--batch_size B] [--snapshot_path P] [--pause_s S]

As in the tutorial, a resumed run starts again at the epoch its snapshot names. `--pause_s` (not the tutorial's)
sleeps after each batch, so that a test can act mid-run on a fast host.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):  # type: ignore[type-arg]
    def __init__(self, size: int):
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index]


def ddp_setup() -> None:
    init_process_group(backend="gloo")


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader,  # type: ignore[type-arg]
        optimizer: torch.optim.Optimizer,
        save_every: int,
        snapshot_path: str,
        pause_s: float,
    ) -> None:
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.model: Any = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        self.pause_s = pause_s
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path: str) -> None:
        snapshot = torch.load(snapshot_path)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        time.sleep(self.pause_s)

    def _run_epoch(self, epoch: int) -> None:
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}", flush=True)
        self.train_data.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}", flush=True)

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs() -> tuple[Dataset, torch.nn.Module, torch.optim.Optimizer]:  # type: ignore[type-arg]
    train_set = MyTrainDataset(2048)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int) -> DataLoader:  # type: ignore[type-arg]
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset))


def main(save_every: int, total_epochs: int, batch_size: int, snapshot_path: str, pause_s: float) -> None:
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path, pause_s)
    trainer.train(total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each device (default: 32)")
    parser.add_argument("--snapshot_path", default="snapshot.pt")
    parser.add_argument("--pause_s", default=0.0, type=float)
    args = parser.parse_args()
    torch.set_num_threads(1)
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path, args.pause_s)
