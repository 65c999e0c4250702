"""An eviction's emergency save as the policy sees it (`policy.saves`), with a fake clock: a save the ranks report
failed, or that never commits before the deadline, is an event naming the steps lost and exit 8; one committed in
the fallback directory goes to the durable tier from there; a directory the ranks made again is an event."""

from __future__ import annotations

from ftsup.protocol import Phase
from ftsup.supervisor.policy import machine as P
from ftsup.supervisor.policy import saves
from ftsup.supervisor.policy.events import CheckpointCommitted
from ftsup.supervisor.telemetry import console
from ftsup.supervisor.telemetry.metrics import Metrics
from tests.settings import settings
from tests.unit.test_policy import Driver


def evicting(resume: int | None = 4, reached: int = 10, committed: int | None = None) -> Driver:
    """A job resumed from `resume`, trained to `reached` (its engine committed `committed` meanwhile), and an
    eviction notice with time for a save."""
    d = Driver(settings(nproc_max=2, save_margin_s=5.0))
    d.launch(resume=resume)
    d.train(range((resume or 0) + 1, reached + 1), dt=0.2)
    figures = (("save_s", 0.5),) + ((("committed_step", float(committed)),) if committed is not None else ())
    d.feed(P.Heartbeat(1, 0, reached, Phase.TRAIN, figures=figures))
    acts = d.feed(P.EvictionNoticed("aws", d.now + 30, "terminate"))
    assert any(isinstance(a, P.RequestSave) for a in acts)
    return d


def failed_beat(step: int, local_rank: int = 0) -> P.Heartbeat:
    return P.Heartbeat(1, local_rank, step, Phase.TRAIN, figures=(("save_failed_step", float(step)),))


def logged(actions: list[P.Action], event: str) -> list[dict[str, object]]:
    return [a.as_dict() | {"level": a.level} for a in actions if isinstance(a, P.Log) and a.event == event]


def exits(actions: list[P.Action]) -> list[int]:
    return [a.code for a in actions if isinstance(a, P.Exit)]


def test_a_failed_emergency_save_is_an_error_naming_the_steps_lost_since_the_newest_checkpoint() -> None:
    d = evicting(resume=4, reached=10, committed=8)
    (failed,) = logged(d.feed(failed_beat(11)), "emergency_save_failed")
    assert (failed["level"], failed["step"], failed["checkpoint_step"], failed["lost_steps"]) == (
        "error",
        11,
        8,
        [9, 11],
    )
    assert "steps 9-11 are lost (the newest checkpoint is step 8)" in str(failed["reason"])


def test_a_failed_emergency_save_ends_the_job_with_exit_8_once_the_workers_are_gone() -> None:
    d = evicting(resume=4, reached=10)
    d.feed(failed_beat(11))
    d.feed(P.Heartbeat(1, 0, 11, Phase.TRAIN))
    acts = d.feed(P.WorkersExited(1, 1))
    assert (exits(acts), logged(acts, "emergency_save_failed")) == ([saves.EXIT_SAVE_LOST], [])  # said once
    (final,) = [a for a in acts if isinstance(a, P.Exit)]
    lost = "the emergency save failed: steps 5-11, after the newest checkpoint, step 4, are lost"
    assert final.reason == f"evicted: aws: terminate; {lost}"


def test_only_the_first_local_rank_speaks_for_the_save() -> None:
    d = evicting()
    assert logged(d.feed(failed_beat(11, local_rank=1)), "emergency_save_failed") == []


def test_a_save_that_never_commits_before_the_deadline_is_exit_8_saying_so() -> None:
    d = evicting(resume=None, reached=6)
    assert d.st.eviction is not None
    deadline = d.st.eviction.deadline
    assert any(isinstance(a, P.StopWorkers) for a in d.feed(P.Tick(), at=deadline - 0.5))
    acts = d.feed(P.WorkersExited(1, -9))
    (failed,) = logged(acts, "emergency_save_failed")
    assert (exits(acts), failed["lost_steps"], failed["checkpoint_step"]) == ([8], [1, 6], None)
    assert "it did not commit before the eviction deadline" in str(failed["reason"])


def test_workers_that_end_without_reporting_the_save_are_exit_8() -> None:
    d = evicting()
    acts = d.feed(P.WorkersExited(1, 0))
    (failed,) = logged(acts, "emergency_save_failed")
    assert (exits(acts), "ended without reporting it committed" in str(failed["reason"])) == ([8], True)


def test_a_committed_emergency_save_is_exit_5() -> None:
    d = evicting()
    d.feed(P.Heartbeat(1, 0, 11, Phase.TRAIN, figures=(("saved_step", 11.0), ("save_s", 0.4))))
    assert exits(d.feed(P.WorkersExited(1, 0))) == [P.EXIT_EVICTED]


def test_nothing_is_lost_when_the_newest_checkpoint_is_the_step_reached() -> None:
    d = evicting(resume=4, reached=10, committed=10)
    d.feed(failed_beat(10))
    assert exits(d.feed(P.WorkersExited(1, 1))) == [P.EXIT_EVICTED]


def test_no_save_asked_for_is_exit_5_with_the_last_checkpoint() -> None:
    d = Driver(settings(nproc_max=2, save_margin_s=5.0))
    d.launch(resume=4)
    d.train(range(5, 11), dt=0.2)
    d.feed(P.Heartbeat(1, 0, 10, Phase.TRAIN, figures=(("save_s", 9.0),)))
    d.feed(P.EvictionNoticed("gcp", d.now + 8, "preempted"))  # no time for a save
    acts = d.feed(P.WorkersExited(1, -15))
    assert (exits(acts), logged(acts, "emergency_save_failed")) == ([P.EXIT_EVICTED], [])


def test_a_save_in_the_fallback_directory_goes_durable_from_there_and_is_a_warning() -> None:
    d = evicting()
    acts = d.feed(P.Heartbeat(1, 0, 11, Phase.TRAIN, figures=(("fallback_step", 11.0), ("save_s", 0.4))))
    (committed,) = logged(acts, "checkpoint_committed")
    assert (committed["level"], committed["fallback"], committed["step"]) == ("warning", True, 11)
    assert [a for a in acts if isinstance(a, CheckpointCommitted)] == [CheckpointCommitted(11, "emergency", True)]
    assert P.AckEviction("aws") in acts
    assert exits(d.feed(P.WorkersExited(1, 0))) == [P.EXIT_EVICTED]  # 8 instead, if it does not become durable


def test_a_fallback_checkpoint_that_is_not_durable_in_time_is_exit_8() -> None:
    d = evicting(resume=4, reached=10)
    d.feed(P.Heartbeat(1, 0, 11, Phase.TRAIN, figures=(("fallback_step", 11.0),)))
    (final,) = [a for a in d.feed(P.WorkersExited(1, 0)) if isinstance(a, P.Exit)]
    assert d.st.eviction is not None
    said, code = saves.not_durable(d.st.eviction, final, 1, d.st.newest_checkpoint, d.st.best_step)
    (failed,) = logged(said, "emergency_save_failed")
    assert (code.code, failed["lost_steps"]) == (8, [5, 11])
    assert "did not reach the durable tier before the deadline" in str(failed["reason"])


def test_the_newest_checkpoint_is_the_resume_step_then_what_the_engine_commits() -> None:
    d = evicting(resume=4, reached=10)
    assert d.st.newest_checkpoint == 4
    d.feed(P.Heartbeat(1, 1, 10, Phase.TRAIN, figures=(("committed_step", 10.0),)))
    assert d.st.newest_checkpoint == 10


def test_a_failed_save_of_an_advisory_notice_is_a_warning_and_changes_no_exit() -> None:
    d = Driver(settings(nproc_max=2))
    d.launch(resume=2)
    d.train(range(3, 8), dt=0.2)
    d.feed(P.EvictionNoticed("aws", d.now + 30, "rebalance", advisory=True))
    (failed,) = logged(d.feed(failed_beat(8)), "emergency_save_failed")
    assert (failed["level"], d.st.final) == ("warning", None)
    assert "steps 3-8 would be lost to an eviction now" in str(failed["reason"])


def test_a_directory_the_ranks_made_again_is_a_warning_once_per_node() -> None:
    d = Driver(settings(nproc_max=2))
    d.launch()
    d.train(range(1, 4), dt=0.2)
    beat = P.Heartbeat(1, 0, 4, Phase.TRAIN, figures=(("dir_recreated_step", 4.0), ("committed_step", 4.0)))
    (made,) = logged(d.feed(beat), "checkpoint_dir_recreated")
    assert (made["level"], made["step"]) == ("warning", 4)
    assert logged(d.feed(P.Heartbeat(1, 1, 4, Phase.TRAIN, figures=beat.figures)), "checkpoint_dir_recreated") == []


def test_the_console_says_which_steps_are_lost() -> None:
    d = evicting(resume=4, reached=10)
    (failed,) = logged(d.feed(failed_beat(11)), "emergency_save_failed")
    assert console.line({"event": "emergency_save_failed", **failed}) == (
        "ftsup: error: the emergency save of step 11 failed: the ranks' emergency save failed; steps 5-11 are lost "
        "(the newest checkpoint is step 4)"
    )


def test_failed_saves_and_directories_made_again_are_counted() -> None:
    m = Metrics("run", "node", started_unix=0.0)
    m.event("emergency_save_failed", {"step": 3})
    m.event("checkpoint_dir_recreated", {"step": 4})
    text = m.render().decode()
    assert "ftsup_emergency_saves_failed_total 1.0" in text
    assert "ftsup_checkpoint_dir_recreated_total 1.0" in text


def test_a_save_figure_that_is_no_step_number_is_ignored() -> None:
    d = evicting()
    for bad in (-1.0, float("nan"), 1e300):
        assert (
            d.feed(P.Heartbeat(1, 0, 11, Phase.TRAIN, figures=(("save_failed_step", bad), ("saved_step", bad)))) == []
        )
    assert (d.st.eviction is not None and d.st.eviction.committed_step, d.st.newest_checkpoint) == (None, 4)
