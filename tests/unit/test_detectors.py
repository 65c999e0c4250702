"""The training-health detectors (`policy.detectors`) over synthetic heartbeat streams and a recorded one:
non-finite figures at once, spikes after their patience with their onset, stragglers, drift, and beats that come
twice, late or not at all."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

from ftsup.protocol import Phase
from ftsup.supervisor.config.anomaly import AnomalyConfig
from ftsup.supervisor.policy import detectors as D
from ftsup.supervisor.policy.events import Heartbeat

CFG = AnomalyConfig()
G = 12  # global batch
REFERENCE = json.loads((Path(__file__).parent / "reference_figures.json").read_text())


def beat(step: int, local_rank: int = 0, **figures: float) -> Heartbeat:
    figures.setdefault("samples", step * G)
    return Heartbeat(1, local_rank, step, Phase.TRAIN, rank=local_rank, figures=tuple(sorted(figures.items())))


def stream(
    losses: Sequence[float],
    nproc: int = 2,
    start: int = 1,
    grad: Sequence[float] | None = None,
    step_s: Sequence[Sequence[float]] | None = None,
) -> list[Heartbeat]:
    """Every rank's beat of each step, rank by rank; `step_s[i][r]`: rank r's step time at step start + i."""
    out = []
    for i, loss in enumerate(losses):
        for r in range(nproc):
            fig: dict[str, float] = {"loss": loss}
            if grad is not None:
                fig["grad_norm"] = grad[i]
            if step_s is not None:
                fig["step_s"] = step_s[i][r]
            out.append(beat(start + i, r, **fig))
    return out


def run(beats: Iterable[Heartbeat], cfg: AnomalyConfig = CFG, h: D.Health | None = None) -> tuple[D.Health, list]:
    h = D.Health() if h is None else h
    found: list[D.Finding] = []
    for b in beats:
        h, more = D.observe(cfg, h, b)
        found += more
    return h, found


def flat(n: int, value: float = 2.0) -> list[float]:
    rng = random.Random(n)
    return [value * (1 + 0.02 * rng.uniform(-1, 1)) for _ in range(n)]


def anomalies(found: list[D.Finding]) -> list[tuple[str, int, int]]:
    return [(a.kind, a.step, a.onset_step) for a in found if isinstance(a, D.Anomaly)]


# ---------------------------------------------------------------------- non-finite


def test_a_nan_loss_is_an_anomaly_on_the_step_it_appears():
    _, found = run([*stream(flat(30)), beat(31, 1, loss=math.nan)])
    assert found == [D.Anomaly("nonfinite", 31, 31, None, None, 1, "loss")]


def test_a_nan_gradient_norm_is_an_anomaly_on_the_step_it_appears():
    _, found = run([*stream(flat(30)), beat(31, 0, loss=2.0, grad_norm=math.nan)])
    assert anomalies(found) == [("nonfinite", 31, 31)]


def test_a_step_the_rank_guard_refused_is_a_nonfinite_anomaly():
    _, found = run([*stream(flat(3)), beat(4, 0, loss=2.0, step_skipped=1)])
    assert [(a.kind, a.step, a.figure) for a in found] == [("nonfinite", 4, "step_skipped")]


def test_a_nan_during_the_warmup_is_an_anomaly_too():
    _, found = run([beat(1, 0, loss=math.nan)])
    assert anomalies(found) == [("nonfinite", 1, 1)]


def test_nonfinite_false_lets_a_nan_pass():
    _, found = run([*stream(flat(30)), beat(31, 0, loss=math.nan)], dataclasses.replace(CFG, nonfinite=False))
    assert found == []


def test_enabled_false_detects_nothing():
    cfg = dataclasses.replace(CFG, enabled=False)
    _, found = run([*stream(flat(30)), *stream([20.0] * 10, start=31), beat(41, 0, loss=math.nan)], cfg)
    assert found == []


# ---------------------------------------------------------------------- spikes


def test_a_loss_spike_is_confirmed_after_its_patience_with_its_first_high_step_as_onset():
    _, found = run(stream([*flat(40), *[9.0] * 10]))
    assert anomalies(found) == [("loss_spike", 44, 41)]


def test_a_loss_spike_names_its_value_and_threshold():
    _, found = run(stream([*[2.0] * 40, *[9.0] * 4]))
    assert [(a.value, a.threshold, a.figure) for a in found] == [(9.0, 4.0, "loss")]


def test_high_values_fewer_than_the_patience_are_no_spike():
    _, found = run(stream([*flat(40), 9.0, 9.0, 9.0, *flat(20)]))
    assert found == []


def test_a_spike_is_judged_against_the_values_before_it_not_against_itself():
    # With high values in its window, a median would rise with the spike and never confirm it.
    _, found = run(stream([*flat(30), *[9.0] * 3, *flat(3), *[9.0] * 4]))
    assert anomalies(found) == [("loss_spike", 40, 37)]


def test_no_spike_is_judged_during_the_warmup_steps():
    _, found = run(stream([*flat(10), *[9.0] * 10, *flat(5)]))  # steps 11..20: within warmup_steps 20
    assert found == []


def test_a_gradient_norm_spike_is_confirmed_after_the_patience():
    _, found = run(stream(flat(40), grad=[*[1.0] * 30, *[8.0] * 10]))
    assert anomalies(found) == [("grad_norm_spike", 34, 31)]


def test_a_spike_on_one_rank_counts_through_the_mean_of_the_ranks():
    beats = stream(flat(40))
    high = [beat(41 + i, r, loss=9.0 if r == 1 else 2.0) for i in range(4) for r in range(2)]
    _, found = run([*beats, *high], dataclasses.replace(CFG, loss_spike_factor=2.0))
    assert [(a.kind, a.onset_step, a.rank) for a in found] == [("loss_spike", 41, 1)]


def recorded() -> list[Heartbeat]:
    names = REFERENCE["fields"]
    out = []
    for row in REFERENCE["beats"]:
        figures = tuple(sorted(zip(names[2:], row[2:], strict=True)))
        out.append(Heartbeat(1, row[1], row[0], Phase.TRAIN, rank=row[1], figures=figures))
    return out


def test_a_recorded_reference_run_raises_nothing_with_the_defaults():
    beats = recorded()
    assert (max(b.step for b in beats), run(beats)[1]) == (300, [])


def test_the_recorded_reference_run_would_raise_with_tight_thresholds():
    # The test above can fail: the same stream against thresholds just above what it shows.
    cfg = dataclasses.replace(
        CFG, grad_norm_spike_factor=1.2, straggler_ratio=1.1, loss_patience_steps=1, straggler_patience_steps=3
    )
    kinds = {type(f).__name__ if not isinstance(f, D.Anomaly) else f.kind for f in run(recorded(), cfg)[1]}
    assert kinds >= {"grad_norm_spike", "Straggler"}


# ---------------------------------------------------------------------- beats twice, late, lost


def test_duplicate_and_reordered_beats_find_the_same_as_the_plain_stream():
    plain = stream([*flat(40), *[9.0] * 6], grad=[1.0] * 46)
    noisy = []
    for i in range(0, len(plain), 2):
        pair = plain[i : i + 2]
        noisy += [*reversed(pair), pair[0], beat(pair[0].step, 0)]  # a save's beat repeats a step, figureless
    assert run(noisy)[1] == run(plain)[1]


def test_a_beat_of_a_step_already_judged_changes_nothing():
    h, _ = run(stream(flat(30)))
    again, found = D.observe(CFG, h, beat(5, 0, loss=99.0))
    assert (again.loss, found) == (h.loss, [])


def test_a_step_whose_beat_from_one_rank_was_lost_is_judged_once_a_rank_is_pending_steps_past_it():
    beats = [b for b in stream([*flat(40), *[9.0] * 4, *flat(D.PENDING)]) if not (b.local_rank == 1 and b.step >= 41)]
    _, found = run(beats)
    assert anomalies(found) == [("loss_spike", 44, 41)]


def test_a_rank_read_several_steps_ahead_of_another_is_still_compared_with_it():
    # The supervisor reads one rank's queue after the other: rank 1's beats of steps 1-4, then rank 0's.
    times = {0: 0.1, 1: 0.3}
    beats = [
        beat(s, r, loss=2.0, step_s=times[r])
        for first in range(1, 21, 4)
        for r in (1, 0)
        for s in range(first, first + 4)
    ]
    _, found = run(beats)
    assert [(f.rank, f.steps) for f in found if isinstance(f, D.Straggler)] == [(1, 10)]


# ---------------------------------------------------------------------- stragglers, drift


def test_a_rank_three_times_slower_is_a_straggler_within_20_steps():
    _, found = run(stream(flat(20), step_s=[[0.1, 0.3]] * 20))
    stragglers = [(f.rank, f.steps, round(f.ratio, 1)) for f in found if isinstance(f, D.Straggler)]
    assert stragglers == [(1, 10, 3.0)]


def test_a_straggler_is_told_by_its_own_work_when_the_ranks_report_it():
    # In a synchronised job every rank's step lasts as long as the slowest's: only compute_s tells them apart.
    beats = [beat(s, r, loss=2.0, step_s=0.3, compute_s=0.3 if r == 1 else 0.1) for s in range(1, 21) for r in (0, 1)]
    _, found = run(beats)
    assert [(f.rank, f.steps) for f in found if isinstance(f, D.Straggler)] == [(1, 10)]


def test_a_straggler_is_reported_once_while_it_stays_slow():
    _, found = run(stream(flat(100), step_s=[[0.1, 0.1, 0.3]] * 100, nproc=3))
    assert [type(f).__name__ for f in found] == ["Straggler"]


def test_a_straggler_whose_work_dips_now_and_then_is_still_a_straggler():
    times = [[0.1, 0.1 if s % 4 == 0 else 0.3] for s in range(20)]
    _, found = run(stream(flat(20), step_s=times))
    assert [(f.rank, f.steps) for f in found if isinstance(f, D.Straggler)] == [(1, 10)]


def test_a_rank_kept_waiting_by_the_host_on_many_of_its_steps_is_no_straggler():
    # Other work on its core slows a quick rank on 6 steps in 10, 3x each: its median says slow, not every step.
    times = [[0.1, 0.3 if s % 10 < 6 else 0.1] for s in range(40)]
    _, found = run(stream(flat(40), step_s=times))
    assert not any(isinstance(f, D.Straggler) for f in found)


def test_a_straggler_that_is_no_longer_slow_is_recovered():
    times = [[0.1, 0.3]] * 20 + [[0.1, 0.1]] * 10
    h, found = run(stream(flat(30), step_s=times))
    assert ([type(f).__name__ for f in found], h.stragglers) == (["Straggler", "Recovered"], ())


def test_ranks_slow_together_are_no_stragglers():
    _, found = run(stream(flat(60), step_s=[[0.1, 0.1]] * 20 + [[0.5, 0.5]] * 40))
    assert not any(isinstance(f, D.Straggler) for f in found)


def test_a_step_time_that_hovers_at_the_drift_ratio_is_one_drift():
    times = [[0.1, 0.1]] * 52 + [[0.25, 0.25]] * 50 + [[0.19, 0.19]] * 50 + [[0.21, 0.21]] * 50
    _, found = run(stream(flat(202), step_s=times))
    assert [f.back for f in found if isinstance(f, D.Drift)] == [False]


def test_step_time_ratios_are_each_rank_s_median_over_the_median_of_all():
    h, _ = run(stream(flat(10), step_s=[[0.1, 0.1, 0.4]] * 10, nproc=3))
    assert {r: round(x, 2) for r, x in D.step_time_ratios(h).items()} == {0: 1.0, 1: 1.0, 2: 4.0}


def test_the_job_s_step_time_drifting_up_is_reported_and_then_its_return():
    times = [[0.1, 0.1]] * 52 + [[0.25, 0.25]] * 50 + [[0.1, 0.1]] * 50
    _, found = run(stream(flat(152), step_s=times))
    assert [(type(f).__name__, f.back) for f in found if isinstance(f, D.Drift)] == [("Drift", False), ("Drift", True)]


# ---------------------------------------------------------------------- positions, attempts


def test_the_position_before_a_step_is_the_samples_figure_of_the_step_before():
    h, _ = run([beat(7, samples=84), beat(8, samples=96)])
    assert (D.position_before(h, 8), D.position_before(h, 9)) == (84, 96)


def test_the_global_batch_comes_from_consecutive_samples_figures_past_a_skip():
    h, _ = run([beat(1, samples=12), beat(2, samples=40), beat(3, samples=52)])  # 16 positions skipped in step 2
    assert D.global_batch(h) == 12


def test_an_attempt_resumed_from_a_step_knows_the_checkpoint_s_position():
    h, _ = run(stream(flat(30)))
    h = D.restart(h, 20, 240)
    assert (D.position_before(h, 21), D.position_after(h, 25), h.judged) == (240, None, 20)


def test_an_attempt_forgets_what_the_steps_after_its_resume_step_said():
    h, _ = run(stream([*flat(40), 9.0, 9.0, 9.0]))
    h, found = run(stream([9.0], start=41), h=D.restart(h, 40, 480))
    assert (max(s for s, _ in h.loss.normal), h.loss.run[0][0], found) == (40, 41, [])
