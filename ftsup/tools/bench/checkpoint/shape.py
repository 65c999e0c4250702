"""Size of the synthetic model: torch-free, so the benchmark's parent process can plan it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

FLOAT_BYTES = 4
# parameters + AdamW's exp_avg + exp_avg_sq, all fp32: parameters are a third of the state
STATE_COPIES = 3


@dataclass(frozen=True)
class ModelShape:
    """Layer count and width; every layer is Linear(width, width) with bias."""

    layers: int
    width: int

    @property
    def state_bytes(self) -> int:
        """Bytes of parameters plus both AdamW moments (fp32), over all ranks."""
        return STATE_COPIES * FLOAT_BYTES * self.layers * (self.width * self.width + self.width)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def shape_for(size_mb: float, layers: int) -> ModelShape:
    """The width whose state comes closest to `size_mb` MiB (a multiple of 8, at least 8)."""
    if layers < 1:
        raise ValueError(f"layers must be at least 1, got {layers}")
    params_per_layer = size_mb * 2**20 / (STATE_COPIES * FLOAT_BYTES * layers)
    width = max(8, int(round(math.sqrt(params_per_layer) / 8)) * 8)
    return ModelShape(layers=layers, width=width)
