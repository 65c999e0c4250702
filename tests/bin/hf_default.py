"""A Hugging Face Trainer script as it is written without ftsup: a small GPT-2 built from a config (no downloads), the
Trainer's defaults but for the few arguments a short run sets, and `trainer.train()` with no resume point.

    hf_default.py --output-dir DIR --loss-log FILE [--steps N] [--save-steps K] [--pause-s S]

Rank 0 appends `{"step", "loss_hex"}` to the loss log at each logged step (every step), from a callback of its own.
`--pause-s` sleeps after each step, so that a test can act mid-run.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed


class Windows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Fixed windows of a seeded stream of byte tokens, as a causal LM's input and labels."""

    def __init__(self, n: int, seq_len: int) -> None:
        self.tokens = torch.randint(0, 256, (n * seq_len,), generator=torch.Generator().manual_seed(1234))
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.tokens[i * self.seq_len : (i + 1) * self.seq_len]
        return {"input_ids": x, "labels": x}


class LossLog(TrainerCallback):
    def __init__(self, path: str, pause_s: float) -> None:
        self.path, self.pause_s = path, pause_s

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(self.pause_s)

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        if state.is_world_process_zero and logs and "loss" in logs:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": state.global_step, "loss_hex": float(logs["loss"]).hex()}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--loss-log", required=True)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--save-steps", type=int, default=4)
    p.add_argument("--pause-s", type=float, default=0.0)
    a = p.parse_args()
    torch.set_num_threads(1)
    set_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=a.output_dir,
        max_steps=a.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_steps=a.save_steps,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=Windows(512, 32), callbacks=[LossLog(a.loss_log, a.pause_s)]
    )
    trainer.train()


if __name__ == "__main__":
    main()
