"""The shared checkpoint engine: `CheckpointEngine` (torch, imported on first use) and the names a training script
catches or configures, re-exported from the torch-free store (`CheckpointError` and its subclasses,
`RetentionPolicy`).
"""

from __future__ import annotations

from typing import Any

from ftsup.store.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    CheckpointSaveError,
    ManifestError,
    NoCheckpointError,
)
from ftsup.store.retention import RetentionPolicy

_LAZY = {
    "CheckpointEngine": "ftsup.trainer.checkpoint.engine",
    "SaveResult": "ftsup.trainer.checkpoint.engine",
    "LoadResult": "ftsup.trainer.checkpoint.engine",
}

__all__ = [
    "CheckpointCorruptError",
    "CheckpointEngine",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "LoadResult",
    "ManifestError",
    "NoCheckpointError",
    "RetentionPolicy",
    "SaveResult",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
