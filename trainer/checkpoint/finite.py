"""The finiteness check of a staged save: no checkpoint is committed from a state holding NaN or inf
(trainer/checkpoint/DESIGN.md, "Finite states only").
"""

from __future__ import annotations

import math

import torch

from ftsup.trainer.checkpoint.staging import StagingPlan

_PIECE = 1 << 20  # elements converted at once for the dtypes aminmax does not take
# Formats with no encoding of NaN or infinity (and, in torch, no kernel to convert them): always finite.
_NO_NONFINITE = frozenset(d for d in (getattr(torch, "float4_e2m1fn_x2", None),) if d is not None)


def first_nonfinite(plan: StagingPlan, buf: torch.Tensor) -> str | None:
    """The name (`fqn@offsets`) of the first chunk in `buf` holding a NaN or an infinity, or None."""
    for slot in plan.layout.slots:
        if slot.nbytes == 0 or not (slot.dtype.is_floating_point or slot.dtype.is_complex):
            continue
        values = buf[slot.byte_offset : slot.byte_offset + slot.nbytes].view(slot.dtype)
        if not _finite(values):
            return slot.name
    return None


def _finite(values: torch.Tensor) -> bool:
    if values.dtype in _NO_NONFINITE:
        return True
    if values.dtype.is_complex:
        values = torch.view_as_real(values).reshape(-1)
    try:
        low, high = torch.aminmax(values)
        return math.isfinite(float(low)) and math.isfinite(float(high))
    except (NotImplementedError, RuntimeError):  # float8 and kin: no aminmax kernel
        return all(bool(torch.isfinite(piece.float()).all()) for piece in values.split(_PIECE))
