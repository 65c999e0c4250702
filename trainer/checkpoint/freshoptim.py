"""A fresh optimizer's state made to be loaded into, without the optimizer's arithmetic over the parameters: the step
torch's `get_state_dict` takes over zero gradients to make one runs here over meta-device twins of the parameters
(shapes only), and each tensor it makes is allocated as zeros on the parameter's device (trainer/checkpoint/
DESIGN.md, Loading into a fresh optimizer).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import structlog
import torch

from ftsup.trainer.checkpoint import codec

log = structlog.get_logger("ftsup.checkpoint")


def flat_state(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], list[torch.optim.Optimizer]]:
    """`codec.flatten(codec.state_dicts(state))`, the state a load reads into, with each fresh optimizer's state made
    here (`prepare`) where the flattened state holds it all; and those optimizers, which the caller clears again
    (`clear_made`) where the load fails."""
    made = prepare(state)
    flat, _ = codec.flatten(codec.state_dicts(state))
    if stale := unused(made, flat):
        clear_made(stale)
        made = [o for o in made if o not in stale]
        flat, _ = codec.flatten(codec.state_dicts(state))
    return flat, made


def prepare(state: Mapping[str, Any]) -> list[torch.optim.Optimizer]:
    """The fresh optimizers of `state`'s Stateful values (an `optimizer` attribute that is a torch optimizer with no
    state and no gradient on any parameter), each given the state its first step would make, of zeros; any one
    whose step cannot run over meta tensors (a fused or capturable implementation, a hook that reads values) is
    left as it was, for torch's own way. The caller clears them again (`clear_made`) unless the load filled them."""
    made = []
    for value in state.values():
        optimizer = getattr(value, "optimizer", None)
        if codec.is_stateful(value) and isinstance(optimizer, torch.optim.Optimizer) and _fresh(optimizer):
            try:
                _make(optimizer)
            except Exception as e:  # adapter boundary (any optimizer's step): torch's way is taken instead
                optimizer.state.clear()
                log.debug("checkpoint_fresh_optimizer_skipped", optimizer=type(optimizer).__name__, reason=str(e))
                continue
            made.append(optimizer)
    return made


def unused(made: Iterable[torch.optim.Optimizer], flat: Mapping[str, torch.Tensor]) -> list[torch.optim.Optimizer]:
    """Those of `made` a tensor of whose state is not among the flattened state `flat` (a Stateful that does not
    save its optimizer's state): the load would not fill it, so it must not stay."""
    loaded = {_address(t) for t in flat.values()}
    return [o for o in made if any(_address(t) not in loaded for s in o.state.values() for t in _tensors(s))]


def clear_made(made: Iterable[torch.optim.Optimizer]) -> None:
    """Each of `made` fresh again, as before `prepare`."""
    for optimizer in made:
        optimizer.state.clear()


def _fresh(optimizer: torch.optim.Optimizer) -> bool:
    # As torch's own: an optimizer with state, or a parameter with a gradient, is not made up (`_init_optim_state`).
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return not optimizer.state and bool(params) and all(p.grad is None for p in params)


def _make(optimizer: torch.optim.Optimizer) -> None:
    groups = [g["params"] for g in optimizer.param_groups]
    twins: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for params in groups:
        for p in params:
            twin = _meta_like(p).requires_grad_(p.requires_grad)
            if p.requires_grad:
                twin.grad = torch.zeros_like(twin)
            twins[id(p)] = (p, twin)
    try:
        for g, params in zip(optimizer.param_groups, groups, strict=True):
            g["params"] = [twins[id(p)][1] for p in params]
        optimizer.step()
    finally:
        for g, params in zip(optimizer.param_groups, groups, strict=True):
            g["params"] = params
    made = dict(optimizer.state)
    optimizer.state.clear()
    by_twin = {id(twin): p for p, twin in twins.values()}
    if any(id(k) not in by_twin for k in made):
        raise RuntimeError("the step kept state under something other than a parameter")
    for twin, entry in made.items():
        p = by_twin[id(twin)]
        optimizer.state[p] = {k: _real(v, p) if isinstance(v, torch.Tensor) else v for k, v in entry.items()}


def _meta_like(p: Any) -> torch.Tensor:
    # A DTensor's twin is a plain tensor of its local shard: DTensor's dispatch of each op, not the arithmetic, is
    # most of a sharded step's time; each state tensor of the shard's shape is sharded as its parameter (`_real`).
    local = p._local_tensor if codec.is_dtensor(p) else p.detach()
    return torch.empty_like(local, device="meta")


def _real(v: torch.Tensor, p: Any) -> torch.Tensor:
    if not v.is_meta:
        return v  # made on a device by the step itself (Adam's step count)
    if not codec.is_dtensor(p):
        return torch.zeros(v.shape, dtype=v.dtype, device=p.device)
    from torch.distributed.tensor import DTensor

    local = p._local_tensor
    if v.shape != local.shape:  # not one value per element of the parameter: how to shard it is not known here
        raise RuntimeError(f"a state tensor of shape {tuple(v.shape)} for a shard of shape {tuple(local.shape)}")
    zeros = torch.zeros(v.shape, dtype=v.dtype, device=local.device)
    return DTensor.from_local(zeros, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _address(t: Any) -> int:
    local = t._local_tensor if codec.is_dtensor(t) else t
    return local.untyped_storage().data_ptr() if local.numel() else 0


def _tensors(entry: Mapping[str, Any]) -> list[torch.Tensor]:
    return [v for v in entry.values() if isinstance(v, torch.Tensor)]
