"""The rank-side guard: a step whose loss or gradient norm is not finite applies no update, on every rank alike.

How it refuses, and what it costs: docs/design/trainer.md, The step guard.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class StepCheck:
    """What `StepGuard.check` decided, and the figures it decided on (on the host)."""

    refused: bool
    """True when the step's update was refused (its loss or gradient norm was not finite)."""
    loss: float
    """This rank's loss as given (NaN or infinite as it was)."""
    mean_loss: float
    """The mean over the ranks of the losses given: the same on every rank."""
    grad_norm: float | None
    """The total gradient norm as given (None: not given, or an overflow the scaler handles)."""

    def __bool__(self) -> bool:
        """True when the step may be applied."""
        return not self.refused

    def figures(self) -> dict[str, float | int]:
        """The step's heartbeat figures: `loss`, `grad_norm`, and `step_skipped` = 1 when refused."""
        out: dict[str, float | int] = {"loss": self.loss}
        if self.grad_norm is not None:
            out["grad_norm"] = self.grad_norm
        if self.refused:
            out["step_skipped"] = 1
        return out


class StepGuard:
    """Refuses the optimizer update of a step whose loss or gradient norm is not finite (see the
    module docstring). `refused`: the steps refused since it was made."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any = None, scaler: Any = None) -> None:
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.refused = 0
        self._before: tuple[Any, list[dict[str, Any]]] | None = None  # what a refused step put aside

    def check(self, loss: torch.Tensor | float, grad_norm: torch.Tensor | float | None = None) -> StepCheck:
        """Decide whether this step may be applied (every rank, after backward, before the update).

        `loss`: this rank's loss of the step (a tensor of one element, or a number); `grad_norm`:
        the total gradient norm (what `clip_grad_norm_` returns), None when the loop measured none
        (then only the loss is checked). Refused: the gradients are dropped, so that the update
        which follows changes nothing, and the hyperparameters are put back before the next one."""
        self.settle()
        values = [_scalar(loss), _scalar(grad_norm if grad_norm is not None else 0.0)]
        device = next((v.device for v in values if isinstance(v, torch.Tensor) and v.device.type != "cpu"), None)
        mine = torch.stack([_as_tensor(v, device) for v in values])
        summed = mine
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            summed = mine.clone()
            dist.all_reduce(summed, group=_group_for(summed.device))
        own_loss, own_norm, sum_loss, sum_norm = torch.cat([mine, summed]).tolist()  # the one synchronisation
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        overflow = self.scaler is not None and grad_norm is not None and not math.isfinite(sum_norm)
        refused = not math.isfinite(sum_loss) or (
            grad_norm is not None and not overflow and not math.isfinite(sum_norm)
        )
        if refused:
            self._refuse()
        shown = None if grad_norm is None or (overflow and not math.isfinite(own_norm)) else own_norm
        return StepCheck(refused, own_loss, sum_loss / world, shown)

    def clip_and_step(
        self, parameters: Iterable[torch.Tensor] | None, max_norm: float | None, loss: torch.Tensor | float
    ) -> StepCheck:
        """The whole update of a step: unscale (with a scaler), clip the gradients to `max_norm`
        (None: measure their norm only), `check`, then step the optimizer (through the scaler)
        and the scheduler unless refused, and zero the gradients (set to None). `parameters`:
        those to clip (None: every parameter the optimizer holds)."""
        params = (
            [p for g in self.optimizer.param_groups for p in g["params"]] if parameters is None else list(parameters)
        )
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if max_norm is None:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        result = self.check(loss, norm)
        if self.scaler is not None:  # refused: its gradients are gone; the scaler still closes its step
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif not result.refused:
            self.optimizer.step()
        if self.scheduler is not None and not result.refused:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return result

    def settle(self) -> None:
        """Put the scheduler's state and the optimizer's hyperparameters back as they were before
        a refused step (a no-op otherwise, and when done already)."""
        if self._before is None:
            return
        scheduler_state, groups = self._before
        self._before = None
        if self.scheduler is not None and scheduler_state is not None:
            self.scheduler.load_state_dict(scheduler_state)
        for group, saved in zip(self.optimizer.param_groups, groups, strict=True):
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and isinstance(group.get(key), torch.Tensor):
                    group[key].copy_(value)  # a tensor lr is updated in place by schedulers
                else:
                    group[key] = value

    def _refuse(self) -> None:
        self.refused += 1
        scheduler_state = copy.deepcopy(self.scheduler.state_dict()) if self.scheduler is not None else None
        groups = [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in self.optimizer.param_groups]
        self._before = (scheduler_state, groups)
        self.optimizer.zero_grad(set_to_none=True)


def _scalar(value: Any) -> torch.Tensor | float:
    if isinstance(value, torch.Tensor):
        full = getattr(value, "full_tensor", None)  # a DTensor norm (FSDP2): the same on every rank
        t = full() if callable(full) else value
        if t.numel() != 1:
            raise ValueError(
                f"a step's loss and gradient norm are single numbers, not a tensor of shape {tuple(t.shape)}"
            )
        return t.detach().reshape(())
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"a step's loss and gradient norm are numbers, not {type(value).__name__}") from None


def _as_tensor(value: torch.Tensor | float, device: torch.device | None) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(dtype=torch.float64, device=device if device is not None else value.device)
    return torch.tensor(value, dtype=torch.float64, device=device)


def _group_for(device: torch.device) -> Any:
    """The default group when it reduces tensors of `device`, else a CPU (gloo) group over the same ranks."""
    if device.type != "cpu" or "gloo" in str(dist.get_backend()):
        return None
    from ftsup.trainer.runtime import cpu_group

    return cpu_group()
