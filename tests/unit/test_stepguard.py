"""The rank-side step guard (`ftsup.trainer.stepguard`) on one process: a step whose loss or
gradient norm is not finite changes nothing a checkpoint holds, whichever way the loop steps."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ftsup.trainer.stepguard import StepCheck, StepGuard


def make(scaler: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    amp = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaler else None
    return model, optimizer, scheduler, StepGuard(optimizer, scheduler, amp)


def backward(model: torch.nn.Module, poison: float = 1.0, scale: float = 1.0, scaler=None) -> torch.Tensor:
    loss = model(torch.ones(2, 4)).pow(2).mean() * poison
    scaled = loss * scale
    (scaler.scale(scaled) if scaler is not None else scaled).backward()
    return loss.detach()


def snapshot(model, optimizer, scheduler) -> tuple:
    return (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()), scheduler.state_dict())


def same(a: tuple, b: tuple) -> bool:
    (ma, oa, sa), (mb, ob, sb) = a, b
    tensors_equal = all(torch.equal(ma[k], mb[k]) for k in ma)
    return tensors_equal and repr(oa) == repr(ob) and sa == sb


def test_a_step_with_a_nan_loss_changes_nothing_when_the_loop_steps_the_optimizer_itself():
    model, optimizer, scheduler, guard = make()
    backward(model)
    optimizer.step(), scheduler.step(), optimizer.zero_grad()  # one real step: the optimizer has state
    before = snapshot(model, optimizer, scheduler)
    loss = backward(model, poison=math.nan)
    guard.check(loss, torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    optimizer.step(), scheduler.step(), optimizer.zero_grad()
    guard.settle()
    assert same(snapshot(model, optimizer, scheduler), before)


def test_a_step_with_an_infinite_gradient_norm_applies_no_update_through_clip_and_step():
    model, optimizer, scheduler, guard = make()
    before = snapshot(model, optimizer, scheduler)
    backward(model, scale=math.inf)
    check = guard.clip_and_step(None, 1.0, loss=1.0)
    guard.settle()
    assert (check.refused, same(snapshot(model, optimizer, scheduler), before)) == (True, True)


def test_a_refused_step_leaves_the_learning_rate_the_scheduler_had():
    model, optimizer, scheduler, guard = make()
    backward(model, poison=math.nan)
    guard.check(1.0, math.nan)
    optimizer.step(), scheduler.step()
    guard.settle()
    assert (optimizer.param_groups[0]["lr"], scheduler.last_epoch) == (1e-2, 0)


def test_a_finite_step_through_clip_and_step_is_the_loops_own_update():
    a_model, a_opt, a_sched, guard = make()
    b_model, b_opt, b_sched, _ = make()
    for _ in range(3):
        check = guard.clip_and_step(a_model.parameters(), 0.1, backward(a_model))
        backward(b_model)
        torch.nn.utils.clip_grad_norm_(b_model.parameters(), 0.1)
        b_opt.step(), b_sched.step(), b_opt.zero_grad()
    assert (check.refused, same(snapshot(a_model, a_opt, a_sched), snapshot(b_model, b_opt, b_sched))) == (False, True)


def test_the_figures_of_a_refused_step_say_so_and_an_applied_ones_do_not():
    model, _, _, guard = make()
    backward(model)
    applied = guard.check(torch.tensor(2.5), torch.tensor(0.5)).figures()
    refused = guard.check(torch.tensor(math.nan), torch.tensor(0.5)).figures()
    assert (applied, math.isnan(refused.pop("loss")), refused) == (
        {"loss": 2.5, "grad_norm": 0.5},
        True,
        {"grad_norm": 0.5, "step_skipped": 1},
    )


def test_the_check_is_the_loss_and_norm_as_numbers_on_the_host():
    _, _, _, guard = make()
    got = guard.check(torch.tensor(2.0, dtype=torch.float16), torch.tensor([0.25]))
    assert got == StepCheck(refused=False, loss=2.0, mean_loss=2.0, grad_norm=0.25)


def test_without_a_norm_only_the_loss_is_checked():
    _, _, _, guard = make()
    assert (guard.check(1.0).refused, guard.check(math.inf).refused, guard.check(1.0).grad_norm) == (False, True, None)


def test_a_loss_of_more_than_one_number_is_refused_with_a_clear_error():
    _, _, _, guard = make()
    with pytest.raises(ValueError, match="single numbers"):
        guard.check(torch.ones(3))


def test_with_a_scaler_an_overflow_is_the_scalers_to_skip_and_no_anomaly():
    model, optimizer, scheduler, guard = make(scaler=True)
    before = snapshot(model, optimizer, scheduler)
    backward(model, scale=math.inf, scaler=guard.scaler)
    check = guard.clip_and_step(None, 1.0, loss=0.5)
    model_unchanged = all(torch.equal(before[0][k], v) for k, v in model.state_dict().items())
    assert (check.refused, check.figures(), model_unchanged, guard.scaler.get_scale()) == (
        False,
        {"loss": 0.5},
        True,
        2.0**9,
    )


def test_with_a_scaler_a_nan_loss_is_refused_and_the_scaler_closes_its_step():
    model, optimizer, scheduler, guard = make(scaler=True)
    before = snapshot(model, optimizer, scheduler)
    backward(model, scaler=guard.scaler)
    check = guard.clip_and_step(None, 1.0, loss=math.nan)
    guard.settle()
    backward(model, scaler=guard.scaler)  # the scaler takes the next step: its state was closed
    after = guard.clip_and_step(None, 1.0, loss=0.5)
    changed = not all(torch.equal(before[0][k], v) for k, v in model.state_dict().items())
    assert (check.refused, after.refused, changed) == (True, False, True)
