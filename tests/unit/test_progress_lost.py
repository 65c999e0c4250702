"""Progress is never lost silently (`policy.progress`): a relaunch behind the steps earlier attempts reported logs
`progress_lost` naming them, the console says what to do, and an eviction of a script without heartbeats says that
it has no emergency save. Driven by a fake clock."""

from __future__ import annotations

from ftsup.protocol import Phase
from ftsup.supervisor.policy import machine as P
from ftsup.supervisor.policy import progress
from ftsup.supervisor.telemetry import console
from tests.unit.test_policy import Driver
from tests.unit.test_policy_anomaly import REQ, Health


def relaunched(resume: int | None, first: int | None, reached: int = 151) -> Driver:
    """Attempt 1 reported steps 1..`reached`, then a rank was SIGKILLed; attempt 2 launches from `resume` and reports
    `first` as its first step (None: none yet)."""
    d = Driver()
    d.launch()
    d.train(range(1, reached + 1))
    d.feed(P.WorkersExited(1, 1, (P.RankFailure(1, 1, 4242, -9, root=True),)))
    d.launch(resume=resume)
    if first is not None:
        d.train(range(first, first + 1))
    return d


def lost(d: Driver) -> list[P.Log]:
    return [a for a in d.actions if isinstance(a, P.Log) and a.event == "progress_lost"]


def shown(ev: P.Log) -> str | None:
    return console.line({"event": ev.event, "level": ev.level, **ev.as_dict()})


def test_a_relaunch_from_scratch_behind_the_steps_reported_logs_progress_lost_naming_them():
    (ev,) = lost(relaunched(None, 1))
    assert (ev.level, ev.as_dict()) == (
        "warning",
        {
            "attempt": 2,
            "step": 0,
            "resume_step": None,
            "best_step": 151,
            "lost_steps": [1, 151],
            "reason": "attempt 2 started from scratch, behind step 151 that earlier attempts reported: steps 1-151 are "
            "lost and trained again",
        },
    )


def test_a_relaunch_from_an_older_checkpoint_names_the_steps_it_trains_again():
    (ev,) = lost(relaunched(100, 101))
    told = (ev.level, ev.as_dict()["step"], ev.as_dict()["lost_steps"], ev.as_dict()["reason"])
    assert told == (
        "info",
        100,
        [101, 151],
        "attempt 2 resumed from the checkpoint of step 100, behind step 151 that earlier attempts reported: steps "
        "101-151 are lost and trained again",
    )


def test_a_script_that_resumes_from_a_checkpoint_of_its_own_is_judged_by_the_steps_it_reports():
    (ev,) = lost(relaunched(None, 141))
    assert (ev.level, ev.as_dict()["step"], ev.as_dict()["lost_steps"]) == ("info", 140, [141, 151])


def test_a_relaunch_from_the_step_reached_loses_nothing():
    assert lost(relaunched(151, 152)) == []


def test_nothing_is_said_before_the_relaunch_reports_a_step():
    assert lost(relaunched(None, None)) == []


def test_the_first_attempt_loses_nothing():
    d = Driver()
    d.launch()
    d.train(range(1, 3))
    assert lost(d) == []


def test_a_rollback_to_an_earlier_step_is_no_progress_lost():
    d = Health()
    d.launch()
    d.steps(range(1, 31))
    d.feed(REQ)
    d.relaunch(resume=20, samples=240)
    d.steps(range(21, 23))
    assert (d.logged("rollback_started") != [], d.logged("progress_lost")) == (True, [])


def test_the_console_says_what_was_lost_and_what_to_do_when_a_relaunch_starts_from_scratch():
    (ev,) = lost(relaunched(None, 1))
    assert shown(ev) == (
        "ftsup: warning: attempt 2 started from scratch: steps 1-151, which earlier attempts reported, are lost and "
        "trained again. To resume instead, adopt a Session (docs/adopting.md) or save and resume in the script"
    )


def test_the_console_names_the_steps_trained_again_after_a_checkpoint():
    (ev,) = lost(relaunched(100, 101))
    assert shown(ev) == (
        "ftsup: attempt 2 resumed at step 100: steps 101-151, which earlier attempts reported, are lost and trained "
        "again"
    )


def test_an_eviction_of_a_script_that_sends_no_heartbeats_says_it_has_no_emergency_save():
    d = Driver()
    d.launch()
    acts = d.feed(P.EvictionNoticed("aws", d.now + 30, "terminate"), at=d.now + 600)
    (skipped,) = [a for a in acts if isinstance(a, P.Log) and a.event == "save_skipped"]
    assert (skipped.level, skipped.as_dict()["reason"]) == ("warning", progress.NO_EMERGENCY_SAVE)
    assert console.line({"event": "save_skipped", "level": "warning", "reason": progress.NO_EMERGENCY_SAVE}) == (
        "ftsup: warning: save_skipped: the script has no emergency save (it sends no heartbeats, so it cannot be "
        "asked for one): the steps since its own last checkpoint are lost"
    )


def evicted_at_the_deadline(*figures: tuple[str, float]) -> list[P.Action]:
    """A fresh job that reported steps 1..10 (the last with `figures`), then an eviction whose save never commits."""
    d = Driver()
    d.launch()
    d.train(range(1, 10), dt=0.2)
    d.feed(P.Heartbeat(1, 0, 10, Phase.TRAIN, figures=figures))
    assert any(isinstance(a, P.RequestSave) for a in d.feed(P.EvictionNoticed("aws", d.now + 30, "terminate")))
    eviction = d.st.eviction
    assert eviction is not None
    d.feed(P.Tick(), at=eviction.deadline - 0.5)
    return d.feed(P.WorkersExited(1, -9))


def test_an_eviction_of_a_script_that_only_counts_its_steps_says_it_has_no_emergency_save():
    (failed,) = [
        a.as_dict() for a in evicted_at_the_deadline() if isinstance(a, P.Log) and a.event == "emergency_save_failed"
    ]
    assert failed["reason"] == (
        "the emergency save of step 10 failed: the script has no emergency save (no rank of the job ever reported a "
        "save or a checkpoint); steps 1-10 are lost (no checkpoint)"
    )


def test_an_eviction_of_a_job_that_saved_before_says_its_save_did_not_commit():
    acts = evicted_at_the_deadline(("save_s", 0.5))
    (failed,) = [a.as_dict() for a in acts if isinstance(a, P.Log) and a.event == "emergency_save_failed"]
    assert "it did not commit before the eviction deadline" in str(failed["reason"])


def test_an_eviction_before_the_first_step_of_a_script_that_beats_has_nothing_to_save():
    d = Driver()
    d.launch()
    d.beat_all(0, "load")
    acts = d.feed(P.EvictionNoticed("aws", d.now + 30, "terminate"))
    (skipped,) = [a.as_dict() for a in acts if isinstance(a, P.Log) and a.event == "save_skipped"]
    assert skipped["reason"] == "no training step since the last checkpoint"


def test_a_job_that_reported_no_step_finishes_saying_so_never_step_minus_one():
    d = Driver()
    d.launch()
    acts = d.feed(P.WorkersExited(1, 0))
    (done,) = [a for a in acts if isinstance(a, P.Log) and a.event == "job_succeeded"]
    said = console.line({"event": done.event, **done.as_dict()})
    assert (done.as_dict()["step"], said) == (None, "ftsup: training finished: attempt 1, no step reported")


def test_a_job_that_reported_steps_finishes_naming_the_last():
    d = Driver()
    d.launch()
    d.feed(P.Heartbeat(1, 0, 7, Phase.TRAIN))
    acts = d.feed(P.WorkersExited(1, 0))
    (done,) = [a for a in acts if isinstance(a, P.Log) and a.event == "job_succeeded"]
    assert console.line({"event": done.event, **done.as_dict()}) == "ftsup: training finished: attempt 1, step 7"
