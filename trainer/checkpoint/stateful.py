"""`ModelOptimState`: a model and its optimizer as one torch `Stateful`, through
`torch.distributed.checkpoint.state_dict` (trainer/checkpoint/DESIGN.md, Modules).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


class ModelOptimState:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"model": get_state_dict(self.model, [])[0]}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer if self.optimizer is not None else [],
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict.get("optim", {}),
        )
