"""Evidence before the kill (`policy.evidence`), driven by a fake clock: a hang's stop comes after the capture of the
ranks' stacks, the capture's time counts as detection, and an operator's or a straggler's capture stops nothing."""

from __future__ import annotations

import dataclasses

from ftsup.protocol import Phase
from ftsup.supervisor.config.forensics import ForensicsConfig
from ftsup.supervisor.policy import goodput
from ftsup.supervisor.policy import machine as P
from ftsup.supervisor.policy.events import CaptureEvidence, CaptureRequested, EvidenceCaptured
from tests.settings import settings
from tests.unit.test_policy import Driver

DEFAULTS = settings(nproc_max=2)  # min_timeout_s 2: a rank silent for 2 s is hung


def hung(d: Driver, states: tuple = ((0, "S"), (1, "T"))) -> list[P.Action]:
    d.launch()
    d.train(range(1, 11), dt=0.1)
    d.now += 0.1
    d.feed(P.Heartbeat(1, 0, 11, Phase.TRAIN, sent=d.now))  # rank 0 steps on; rank 1 is stopped after step 10
    return d.feed(P.Tick(states), at=d.now + 2.1)


def kinds(actions: list[P.Action]) -> list[str]:
    return [a.event if isinstance(a, P.Log) else type(a).__name__ for a in actions]


def test_a_hangs_stop_comes_after_the_capture_of_every_ranks_evidence_which_names_the_blamed_rank():
    d = Driver(DEFAULTS)
    acts = hung(d)
    (capture,) = [a for a in acts if isinstance(a, CaptureEvidence)]
    told = (kinds(acts), capture.trigger, capture.rank, capture.state, capture.waiting, capture.timeout_s)
    assert told == (["heartbeat_timed_out", "CaptureEvidence", "StopWorkers"], "hang", 1, "T", (0,), 3.0)
    assert d.st.capturing == 1


def test_the_capture_over_clears_the_capture_in_progress_and_changes_nothing_else():
    d = Driver(DEFAULTS)
    hung(d)
    before = d.st
    assert (d.feed(EvidenceCaptured(1)), d.st) == ([], dataclasses.replace(before, capturing=None))


def test_with_forensics_off_a_hang_is_stopped_at_once():
    d = Driver(dataclasses.replace(DEFAULTS, forensics=ForensicsConfig(enabled=False)))
    assert (kinds(hung(d)), d.st.capturing) == (["heartbeat_timed_out", "StopWorkers"], None)


def test_a_stall_and_a_slow_start_are_captured_too_with_no_rank_named():
    d = Driver(dataclasses.replace(DEFAULTS, startup_timeout_s=5.0, heartbeat_mode=P.HeartbeatMode.REQUIRED))
    d.launch()
    acts = d.feed(P.Tick(), at=5.1)
    (capture,) = [a for a in acts if isinstance(a, CaptureEvidence)]
    assert (capture.event, capture.rank, kinds(acts)[-1]) == ("startup_timed_out", None, "StopWorkers")


def test_the_eviction_deadlines_stop_captures_nothing():
    d = Driver(DEFAULTS)
    d.launch()
    d.train(range(1, 5), dt=0.1)
    d.feed(P.EvictionNoticed("test", deadline=d.now + 30.0))
    acts = d.feed(P.Tick(), at=d.now + 29.5)
    assert kinds(acts) == ["stop_requested", "StopWorkers"]


def test_the_captures_time_is_detection_not_the_stops():
    d = Driver(DEFAULTS)
    d.launch()
    acc = goodput.start(d.now, 0.0)
    events = [P.Heartbeat(1, r, s, Phase.TRAIN, sent=0.1 * s) for s in range(1, 11) for r in (0, 1)]
    for i, ev in enumerate(events):
        before = d.st
        d.feed(ev, at=0.1 * (i // 2 + 1))
        acc = goodput.feed(acc, before, d.st, ev, d.now)
    trained = d.now
    for ev, at in ((P.Tick((((0, "S"), (1, "T")))), trained + 2.1), (EvidenceCaptured(1), trained + 2.6)):
        before = d.st
        d.feed(ev, at=at)
        acc = goodput.feed(acc, before, d.st, ev, d.now)
    for ev, at in ((P.WorkersExited(1, -9), trained + 3.0),):
        before = d.st
        d.feed(ev, at=at)
        acc = goodput.feed(acc, before, d.st, ev, d.now)
    badput = acc.totals.badput_s()
    assert (round(badput["detection"], 3), round(badput["other"], 3)) == (2.6, 0.4)


def test_an_operators_request_captures_while_an_attempt_runs_and_stops_nothing():
    d = Driver(DEFAULTS)
    d.launch()
    d.train(range(1, 4), dt=0.1)
    acts = d.feed(CaptureRequested("ab" * 8, "ops@host", "slow"))
    (capture,) = [a for a in acts if isinstance(a, CaptureEvidence)]
    assert (kinds(acts), capture.trigger, capture.step, d.st.phase) == (
        ["capture_requested", "CaptureEvidence"],
        "operator",
        3,
        "running",
    )


def test_an_operators_request_with_no_attempt_running_is_said_ignored():
    d = Driver(DEFAULTS)
    assert kinds(d.feed(CaptureRequested("ab" * 8, "ops@host"))) == ["capture_request_ignored"]


def straggling(d: Driver, steps: range) -> list[P.Action]:
    acts: list[P.Action] = []
    for s in steps:
        d.now += 0.5
        for r, t in ((0, 0.1), (1, 0.3)):
            figures = (("loss", 2.0), ("samples", float(s * 8)), ("step_s", t))
            acts += d.feed(P.Heartbeat(1, r, s, Phase.TRAIN, rank=r, figures=figures, sent=d.now))
    return acts


def test_a_rank_newly_reported_as_a_straggler_has_its_stacks_captured_once_and_nothing_is_stopped():
    d = Driver(settings(nproc_max=2))
    d.launch()
    acts = straggling(d, range(1, 21))
    captures = [a for a in acts if isinstance(a, CaptureEvidence)]
    assert ([(c.trigger, c.rank) for c in captures], "straggler_detected" in kinds(acts), d.st.phase) == (
        [("straggler", 1)],
        True,
        "running",
    )


def test_with_on_straggler_off_a_straggler_is_only_reported():
    d = Driver(dataclasses.replace(DEFAULTS, forensics=ForensicsConfig(on_straggler=False)))
    d.launch()
    acts = straggling(d, range(1, 21))
    assert ("straggler_detected" in kinds(acts), [a for a in acts if isinstance(a, CaptureEvidence)]) == (True, [])
