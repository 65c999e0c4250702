"""A user's training script beside their own `trainer.py` and `supervisor.py`, run as `python train.py
CKPT_DIR STEPS`: it trains a linear model and checkpoints it through `from ftsup import ...` alone,
resuming from the latest checkpoint, and prints `resumed=<step or None> step=<last step>`.

Python puts this script's directory first on sys.path, so the two modules beside it shadow any
top-level package of the same name.
"""

from __future__ import annotations

import sys

import supervisor  # the user's own: ftsup's packages must not be looked for under these names
import torch
import trainer

from ftsup import CheckpointEngine, GlobalBatchSchedule, TrainingState, runtime


def main(ckpt_dir: str, steps: int) -> int:
    assert trainer.SHADOW and supervisor.SHADOW
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = GlobalBatchSchedule(dataset_size=64, global_batch=8, micro_batch=8, world_size=1, rank=0, seed=0)
    state = TrainingState(model, optimizer, schedule=schedule, config={"in": 4})
    engine = CheckpointEngine(ckpt_dir)
    rt = runtime()
    loaded = state.resume(engine)
    for step in range(state.step + 1, steps + 1):
        x = torch.randn(8, 4)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        state.step, state.samples = step, schedule.position_after(step)
        rt.beat(step, "train", loss=float(loss))
    state.save(engine, kind="final", block=True)
    engine.close()
    print(f"resumed={loaded.step if loaded else None} step={state.step}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
