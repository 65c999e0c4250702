"""`ftsup bench goodput`'s pure parts: the seeded fault schedule and the goodput arithmetic (every second of a
timeline in exactly one bucket), on timelines written by hand."""

from __future__ import annotations

import math
import signal
from pathlib import Path
from typing import Any

import pytest

from ftsup.tools.bench.goodput.account import CAUSES, Interruption, Line, Timeline, account
from ftsup.tools.bench.goodput.contenders import NAMES, Contender, NvrxTimeouts, contenders
from ftsup.tools.bench.goodput.report import checks, fired, not_run, table
from ftsup.tools.bench.goodput.schedule import DEFAULT_MIX, KINDS, parse_mix, plan
from ftsup.tools.faults.refjob import TrainerJob

MIX = parse_mix(DEFAULT_MIX)

# --------------------------------------------------------------------------- the schedule


def test_a_seed_gives_the_same_schedule_every_time() -> None:
    assert plan(7, 60, MIX, nproc=2, horizon_s=3600) == plan(7, 60, MIX, nproc=2, horizon_s=3600)


def test_another_seed_gives_another_schedule() -> None:
    assert plan(7, 60, MIX, nproc=2, horizon_s=3600) != plan(8, 60, MIX, nproc=2, horizon_s=3600)


def test_a_longer_horizon_only_appends_faults() -> None:
    short, long = plan(3, 60, MIX, nproc=2, horizon_s=600), plan(3, 60, MIX, nproc=2, horizon_s=6000)
    assert (len(long) > len(short), long[: len(short)]) == (True, short)


def test_faults_are_in_order_within_the_horizon_and_numbered() -> None:
    faults = plan(1, 60, MIX, nproc=2, horizon_s=6000)
    times = [f.at_s for f in faults]
    assert (times == sorted(times), 0 < times[0], times[-1] <= 6000, [f.index for f in faults]) == (
        True,
        True,
        True,
        list(range(len(faults))),
    )


def test_the_mean_interval_is_the_one_asked_for_over_a_long_horizon() -> None:
    faults = plan(11, 60, MIX, nproc=2, horizon_s=600_000)
    assert abs(600_000 / len(faults) - 60) < 3


def test_the_default_mix_gives_each_kind_about_a_third_and_every_rank_some() -> None:
    faults = plan(5, 60, MIX, nproc=2, horizon_s=600_000)
    shares = [sum(f.kind == k for f in faults) / len(faults) for k in KINDS]
    assert all(abs(s - 1 / 3) < 0.03 for s in shares) and {f.rank for f in faults} == {0, 1}, shares


def test_a_kind_of_weight_zero_never_comes() -> None:
    faults = plan(5, 60, parse_mix("kill=1,hang=0"), nproc=2, horizon_s=60_000)
    assert {f.kind for f in faults} == {"kill"}


def test_a_kind_named_alone_weighs_one_and_the_others_zero() -> None:
    assert parse_mix("hang") == {"kill": 0.0, "hang": 1.0, "evict": 0.0}


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("kill=1,oops=2", "'oops'"),
        ("kill=x", "'x'"),
        ("kill=-1", "finite number >= 0"),
        ("kill=0", "no kind"),
        ("kill=inf", "finite"),
    ],
)
def test_a_bad_mix_is_refused_naming_what_is_wrong(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_mix(text)


def test_a_mean_interval_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="mean interval"):
        plan(0, 0, MIX, nproc=2, horizon_s=60)


# --------------------------------------------------------------------------- the arithmetic


def steps(first: int, last: int, t0: float, dt: float) -> list[Line]:
    """Steps first..last, one every dt seconds, the first at t0."""
    return [Line(t0 + i * dt, s) for i, s in enumerate(range(first, last + 1))]


def total(acc: object) -> float:
    return acc.productive_s + sum(acc.badput_s.values())  # type: ignore[attr-defined]


def test_an_uninterrupted_run_is_productive_but_for_its_startup_and_its_end() -> None:
    tl = Timeline(start=0.0, end=12.0, lines=tuple(steps(1, 10, 2.0, 1.0)))  # steps at 2..11 s
    acc = account(tl)
    assert (acc.productive_s, acc.badput_s["startup"], acc.badput_s["other"], acc.goodput) == (10.0, 1.0, 1.0, 10 / 12)


def test_the_badput_causes_are_the_shared_names() -> None:
    assert tuple(account(Timeline(0.0, 1.0, ())).badput_s) == CAUSES


def test_a_periodic_save_s_excess_over_the_median_step_is_checkpoint_save() -> None:
    lines = steps(1, 4, 1.0, 1.0) + steps(5, 8, 5.5, 1.0)  # step 4 saved: step 5 comes 1.5 s after it
    acc = account(Timeline(0.0, 8.5, tuple(lines), save_every=4))
    assert (acc.badput_s["checkpoint_save"], acc.productive_s) == (0.5, 8.0)


def test_a_kill_splits_its_recovery_into_lost_work_detection_backoff_startup_and_load() -> None:
    # Steps 1..10 at 1..10 s (a checkpoint at 5); SIGKILL at 10.4 s; reaction at 11; new ranks at 12; the
    # resumed attempt loads for 0.5 s and logs step 6 at 15 s, then 7..10 and the new 11..12.
    lines = steps(1, 10, 1.0, 1.0) + steps(6, 12, 15.0, 1.0)
    kill = Interruption(10.4, "kill", reacted_t=11.0, relaunched_t=12.0, load_s=0.5)
    acc = account(Timeline(0.0, 21.0, tuple(lines), (kill,)))
    b = acc.badput_s
    got = (b["wasted_progress"], b["detection"], b["backoff"], b["checkpoint_load"], b["startup"], acc.productive_s)
    # wasted: 0.4 s in flight + steps 6..10 again (1 s of own time for step 6, then 4 gaps); startup: none before
    # step 1 (its own 1 s), then 12 -> 15 less the load and step 6's own time
    assert [round(x, 6) for x in got] == [5.4, 0.6, 1.0, 0.5, 1.5, 12.0]
    assert (acc.steps, acc.redone_steps) == (12, 5)


def test_an_eviction_counts_the_steps_before_the_stop_as_training_and_the_rest_as_eviction() -> None:
    # Notice at 5.5 s; the job trains steps 6 and 7 (an emergency save), exits at 8; requeued at 8.5;
    # resumes with step 8 at 11.
    lines = steps(1, 7, 1.0, 1.0) + steps(8, 9, 11.0, 1.0)
    notice = Interruption(5.5, "evict", reacted_t=8.0, relaunched_t=8.5, load_s=0.5)
    acc = account(Timeline(0.0, 12.0, tuple(lines), (notice,)))
    b = acc.badput_s
    # eviction: 7 (the last step before the exit) -> 8 -> 8.5; startup: 8.5 -> 11 less the load and step 8's 1 s
    assert (round(b["eviction"], 6), round(b["startup"], 6), b["checkpoint_load"], acc.productive_s) == (
        1.5,
        1.0,
        0.5,
        9.0,
    )


def test_every_second_is_attributed_exactly_once_whatever_the_marks() -> None:
    # Marks out of their usual order, missing, past the end, a fault after the last step: still a partition.
    lines = steps(1, 6, 1.0, 1.0) + steps(3, 8, 9.0, 0.5)
    events = (
        Interruption(6.2, "hang", reacted_t=None, relaunched_t=8.0, load_s=5.0),
        Interruption(11.8, "kill", reacted_t=30.0),
        Interruption(12.4, "other", reacted_t=12.4, relaunched_t=12.1),
    )
    acc = account(Timeline(0.5, 13.0, tuple(lines), events, save_every=2))
    parts = [acc.productive_s, *acc.badput_s.values()]
    assert (math.isclose(total(acc), 12.5), min(parts) >= 0) == (True, True), acc


def test_a_step_trained_twice_counts_once_toward_productive_time() -> None:
    once = account(Timeline(0.0, 6.0, tuple(steps(1, 5, 1.0, 1.0))))
    trained_twice = tuple(steps(1, 5, 1.0, 1.0) + steps(1, 5, 6.0, 1.0))
    twice = account(Timeline(0.0, 11.0, trained_twice, (Interruption(5.0, "kill", 5.0, 5.0),)))
    assert (once.productive_s, twice.productive_s, twice.steps, twice.redone_steps) == (5.0, 5.0, 5, 5)


def test_a_run_that_never_logged_a_step_is_all_startup_and_has_goodput_zero() -> None:
    acc = account(Timeline(0.0, 30.0, ()))
    assert (acc.badput_s["startup"], acc.goodput, total(acc)) == (30.0, 0.0, 30.0)


def test_a_hang_that_ended_the_run_is_detection_up_to_the_end() -> None:
    acc = account(Timeline(0.0, 100.0, tuple(steps(1, 5, 1.0, 1.0)), (Interruption(5.0, "hang"),)))
    assert (acc.badput_s["detection"], acc.badput_s["other"]) == (95.0, 0.0)


# --------------------------------------------------------------------------- contenders and the report


def lineup() -> list[Contender]:
    return contenders(list(NAMES), max_restarts=7, evict_deadline_s=30, tuned=NvrxTimeouts(60, 3, 1))


def job(tmp_path: Path) -> TrainerJob:
    return TrainerJob(tmp_path, "r", 100)


def test_every_launcher_gets_the_same_restart_budget(tmp_path: Path) -> None:
    ftsup, torchrun, *nvrx = lineup()
    flags = [[a for a in c.argv(job(tmp_path)) if a.startswith("--max-restarts")] for c in (torchrun, *nvrx)]
    budget = ftsup.job(tmp_path, "r", 100, 20, 0.1).sections["restart"]["max_restarts"]
    assert (flags, budget) == ([["--max-restarts=7"]] * 3, 7)


def test_only_the_tuned_ft_launcher_row_sets_timeouts(tmp_path: Path) -> None:
    *_, default, tuned = lineup()
    timeouts = [[a for a in c.argv(job(tmp_path)) if a.startswith("--ft-")] for c in (default, tuned)]
    assert timeouts == [
        [],
        ["--ft-initial-rank-heartbeat-timeout=60", "--ft-rank-heartbeat-timeout=3", "--ft-workload-check-interval=1"],
    ]


def test_every_contender_runs_the_same_trainer_flags(tmp_path: Path) -> None:
    args = job(tmp_path).trainer_args()
    _, torchrun, default, tuned = lineup()
    assert all(c.argv(job(tmp_path))[-len(args) :] == args for c in (torchrun, default, tuned))


def test_an_ft_launcher_row_without_nvidia_resiliency_ext_says_why_it_cannot_run() -> None:
    reasons = [c.missing(lambda name: None) for c in lineup()]
    assert (reasons[:2], all("nvidia-resiliency-ext is not installed" in str(r) for r in reasons[2:])) == (
        [None, None],
        True,
    )


def test_an_unknown_contender_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown contender.*ftsup, torchrun, nvrx-default, nvrx-tuned"):
        contenders(["ftsup", "slurm"], max_restarts=1, evict_deadline_s=1, tuned=NvrxTimeouts())


def goodputs(**by_name: float | None) -> list[dict[str, object]]:
    return [{"name": n.replace("_", "-"), "goodput": g} for n, g in by_name.items()]


def test_the_targets_pass_when_ftsup_leads_by_their_margins() -> None:
    got = checks(goodputs(ftsup=0.9, torchrun=0.65, nvrx_default=0.5, nvrx_tuned=0.85))
    assert [c["pass"] for c in got.values()] == [True, True, True, True]


def test_a_target_fails_when_its_margin_is_not_met() -> None:
    got = checks(goodputs(ftsup=0.84, torchrun=0.7, nvrx_default=0.84, nvrx_tuned=0.83))
    assert [c["pass"] for c in got.values()] == [False, False, False, True]


def test_a_target_whose_contender_did_not_run_is_not_measured() -> None:
    got = checks(goodputs(ftsup=0.9, torchrun=0.6, nvrx_default=None, nvrx_tuned=None))
    assert [c["pass"] for c in got.values()] == [True, True, None, None]


def test_the_table_shows_a_row_not_run_with_its_reason() -> None:
    out = {
        "results": [not_run("nvrx-tuned", "ft_launcher ...", "nvidia-resiliency-ext is not installed")],
        "schedule": {"hang_cap_s": 120.0},
        "checks": {},
    }
    line = next(ln for ln in table(out).splitlines() if ln.startswith("nvrx-tuned "))
    assert ("not run" in line, line.endswith("nvidia-resiliency-ext is not installed")) == (True, True)


def test_an_eviction_fired_when_its_checkpoint_survived_and_the_rate_counts_only_evictions() -> None:
    faults: list[dict[str, Any]] = [
        {"kind": "evict", "fired": True},
        {"kind": "evict", "fired": False},
        {"kind": "evict", "fired": None},  # never recovered
        {"kind": "kill", "fired": None},
    ]
    assert fired(faults) == {"evictions": 3, "evictions_fired": 1, "fired_rate": 0.3333}
    assert fired([{"kind": "hang", "fired": None}]) == {"evictions": 0, "evictions_fired": 0, "fired_rate": None}


# --------------------------------------------------------------------------- delivery


class _Proc:
    def __init__(self) -> None:
        self.signals: list[int] = []

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)


def test_the_schedule_counts_from_the_first_step_so_a_slow_start_folds_no_fault(tmp_path: Path) -> None:
    # Launched at 100, first step at 112: the eviction (due 3 s in) waits for 115, alone; the kill is due at 120.
    from types import SimpleNamespace

    from ftsup.tools.bench.goodput.drive import SETTLE_STEPS, _Loop
    from ftsup.tools.bench.goodput.schedule import Fault
    from ftsup.tools.faults.chaos import LossLine, LossLogTail

    proc = _Proc()
    faults = [Fault(0, 3.0, "evict", 0), Fault(1, 8.0, "kill", 1)]
    job = SimpleNamespace(nproc=2)
    loop = _Loop(None, job, faults, None, 100.0, LossLogTail(tmp_path / "loss.jsonl"), [proc])  # type: ignore[arg-type, list-item]
    ranks = {r: SimpleNamespace(pid=1000 + r, rank=r) for r in (0, 1)}
    lines = [LossLine(112.0 + 0.5 * i, i + 1, {}) for i in range(2 * SETTLE_STEPS)]
    loop._deliver(114.0, ranks, lines)  # type: ignore[arg-type]  # 14 s after the launch, 2 after the first step
    assert (loop.cur, proc.signals) == (None, [])
    loop._deliver(115.5, ranks, lines)  # type: ignore[arg-type]
    assert loop.cur is not None and proc.signals == [signal.SIGTERM]
    assert (loop.cur.kind, loop.cur.due_t, loop.cur.coalesced, [f.index for f in loop.queue]) == (
        "evict",
        115.0,
        [],
        [1],
    )
