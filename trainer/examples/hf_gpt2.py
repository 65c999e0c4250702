"""A Hugging Face Trainer script under ftsup: a tiny GPT-2, one callback, one line to resume.

`python -m ftsup.trainer.examples.hf_gpt2`, alone or under torchrun: docs/hf.md, The full example; `--no-ftsup` runs
it without its two `# ftsup` lines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

from ftsup.protocol import CHECKPOINT_DIR_ENV
from ftsup.trainer.examples.corpus import generate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ftsup.trainer.examples.hf_gpt2", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--output-dir", default=os.environ.get(CHECKPOINT_DIR_ENV) or "hf-out")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-pad-s", type=float, default=0.0, help="make each evaluation last this much longer")
    p.add_argument("--min-step-s", type=float, default=0.0, help="pad each step to at least this long")
    p.add_argument("--batch", type=int, default=4, help="per device")
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--corpus-bytes", type=int, default=200_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--loss-log")
    p.add_argument("--logits-out")
    p.add_argument(
        "--no-ftsup",
        action="store_true",
        help="the same script without its ftsup lines: no callback, the Trainer's own resume",
    )
    return p.parse_args(argv)


class Windows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Sample i: `seq_len` byte tokens starting at i * seq_len, as a causal LM's input and labels."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.tokens[i * self.seq_len : (i + 1) * self.seq_len]
        return {"input_ids": x, "labels": x}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    class LossLog(TrainerCallback):
        """Rank 0: one line per optimizer step; `--min-step-s` pads each step."""

        def __init__(self) -> None:
            self.t0 = time.monotonic()

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t0 = time.monotonic()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            time.sleep(max(0.0, a.min_step_s - (time.monotonic() - self.t0)))

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if a.loss_log and state.is_world_process_zero and logs and "loss" in logs:
                loss = float(logs["loss"])
                line = {"step": state.global_step, "loss": loss, "loss_hex": loss.hex(), "world_size": args.world_size}
                with open(a.loss_log, "a") as f:
                    f.write(json.dumps(line) + "\n")

    def metrics(pred: Any) -> dict[str, float]:
        time.sleep(a.eval_pad_s)  # a metric that takes a while
        hits = (pred.predictions[:, :-1] == pred.label_ids[:, 1:]).mean()
        return {"accuracy": float(hits)}

    tokens = generate(a.corpus_bytes)
    cut = len(tokens) * 9 // 10
    train, val = Windows(tokens[:cut], a.seq_len), Windows(tokens[cut:][: a.seq_len * 16], a.seq_len)
    config = GPT2Config(
        vocab_size=256,
        n_positions=a.seq_len,
        n_embd=a.n_embd,
        n_layer=a.n_layer,
        n_head=4,
        resid_pdrop=a.dropout,
        embd_pdrop=a.dropout,
        attn_pdrop=a.dropout,
    )
    torch.manual_seed(a.seed)
    model = GPT2LMHeadModel(config)
    backend = ("gloo" if a.device == "cpu" else "nccl") if "WORLD_SIZE" in os.environ else None  # torchrun's ranks
    args = TrainingArguments(
        output_dir=a.output_dir,
        max_steps=a.steps,
        per_device_train_batch_size=a.batch,
        gradient_accumulation_steps=a.accumulation,
        learning_rate=a.lr,
        warmup_steps=max(1, a.steps // 10),
        lr_scheduler_type="cosine",
        weight_decay=0.1,
        max_grad_norm=1.0,
        seed=a.seed,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=a.eval_every,
        per_device_eval_batch_size=8,
        save_strategy="steps",
        save_steps=a.save_every,
        report_to="none",
        disable_tqdm=True,
        use_cpu=a.device == "cpu",
        ddp_backend=backend,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
    )
    callbacks: list[TrainerCallback] = [LossLog()]
    if not a.no_ftsup:
        from ftsup import FtsupCallback

        ftsup_cb = FtsupCallback()  # ftsup
        callbacks.append(ftsup_cb)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=val,
        compute_metrics=metrics,
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
        callbacks=callbacks,
    )
    if a.no_ftsup:  # as a Trainer script is written without ftsup: from its newest checkpoint-N/, if any
        from transformers.trainer_utils import get_last_checkpoint

        resume = get_last_checkpoint(a.output_dir) if os.path.isdir(a.output_dir) else None
    else:
        resume = ftsup_cb.latest_checkpoint()  # ftsup
    trainer.train(resume_from_checkpoint=resume)
    if a.logits_out and trainer.is_world_process_zero():
        model.eval()
        with torch.no_grad():
            logits = model(torch.arange(a.seq_len).unsqueeze(0) % 256).logits
        torch.save(logits, a.logits_out)
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as e:  # FtsupCallback's, after the save a stop request asked for
        code = e.code if isinstance(e.code, int) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the interpreter's teardown of torch: seconds that would only delay a restart
