"""ftsup: a fault-tolerant training supervisor for PyTorch.

Everything ftsup ships is imported under this name:

- `ftsup.supervisor`: `ftsup run` (the per-node daemon), `ftsup status`, `ftsup ckpt`; never imports torch.
- `ftsup.trainer`: what a training script uses: the checkpoint engine, the resumable training
  state, the data schedule and the runtime client (heartbeats, save and stop requests).
- The shared core both sides import, which imports neither (stdlib only, no torch):
  `ftsup.store` (the checkpoint store's format: layout, manifests, checksums, retention, the
  resume choice), `ftsup.protocol` (what crosses the rank/supervisor boundary: environment,
  phases, heartbeat and control-file schemas) and process handling (`ftsup.procs`, `ftsup.guard`).

A training script needs only this module's names; each is imported on first use, so that
`import ftsup` costs nothing and pulls in no torch:

    from ftsup import Session                     # the training loop's bookkeeping in one object
    from ftsup import CheckpointEngine, GlobalBatchSchedule, RankBatchSampler, TrainingState, agree, runtime

`pip install ftsup` alone gives the supervisor and the `ftsup` command; the names that need torch and numpy come
with the trainer extra (`pip install 'ftsup[trainer]'`), and asking for one without them raises
`ftsup.extras.MissingExtraError`, which names the extra.
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
