"""ftsup: a fault-tolerant training supervisor for PyTorch (its packages: DESIGN.md, Layout).

The names a training script needs (`from ftsup import Session`, `CheckpointEngine`, ...) are imported on first
use, so that `import ftsup` pulls in no torch; those that need torch come with `pip install 'ftsup[trainer]'`.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "CheckpointEngine": "ftsup.trainer.checkpoint",
    "RetentionPolicy": "ftsup.trainer.checkpoint",
    "TrainingState": "ftsup.trainer.state",
    "GlobalBatchSchedule": "ftsup.trainer.data",
    "RankBatchSampler": "ftsup.trainer.data",
    "micro_batch_seed": "ftsup.trainer.rng",
    "runtime": "ftsup.trainer.runtime",
    "agree": "ftsup.trainer.runtime",
    "Session": "ftsup.trainer.session",
    "Agreement": "ftsup.trainer.runtime",
    "FtsupCallback": "ftsup.trainer.hf.callback",  # needs transformers
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ftsup' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:  # torch or numpy: name the extra that installs them
        from ftsup import extras

        raise extras.explained(e, f"ftsup.{name}") from None
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
