"""The policy's training-health rules (`policy_anomaly` through `policy.step`), driven by a fake clock: a NaN or a
confirmed spike stops the attempt and rolls back past its onset with a data skip; a repeat or a spent budget
escalates (exit 7); an operator's request is served once; stragglers are reported, never stopped."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ftsup.protocol import Phase
from ftsup.supervisor.config.anomaly import AnomalyConfig
from ftsup.supervisor.policy import machine as P
from ftsup.supervisor.policy.events import WriteJournal
from ftsup.supervisor.telemetry.logs import EVENTS
from tests.settings import settings
from tests.unit.test_policy import Driver

G = 12  # global batch: the data position after step s is s * G (no skips before)
NO_EXTRA = AnomalyConfig(skip_extra_steps=0)  # a skip from the onset to the detection, in these tests
S = settings(nproc_max=2, backoff_initial_s=1, backoff_max_s=8, max_restarts=5, window_s=1000, anomaly=NO_EXTRA)


def anomaly_settings(**keys: Any) -> P.Settings:
    return dataclasses.replace(S, anomaly=dataclasses.replace(NO_EXTRA, **keys))


class Health(Driver):
    def steps(self, steps: range, loss: float = 2.0, offset: int = 0, **figures: float) -> None:
        """Every rank's beat of each step, with its loss and data position (`offset` positions skipped before)."""
        att = self.st.attempt
        assert att is not None and len(steps) > 0
        for s in steps:
            self.now += 0.5
            for r in range(2):
                fig = {"loss": loss, "samples": s * G + offset, "step_s": 0.5, **figures}
                figs = tuple(sorted(fig.items()))
                self.feed(P.Heartbeat(att.number, r, s, Phase.TRAIN, rank=r, figures=figs, sent=self.now))

    def relaunch(self, resume: int | None, samples: int | None = None) -> P.Launch:
        """The stopped attempt exits; the prepared launch resumes from `resume`."""
        att = self.st.attempt
        assert att is not None
        acts = self.feed(P.WorkersExited(att.number, -9))
        (prep,) = [a for a in acts if isinstance(a, P.PrepareLaunch)]
        acts = self.feed(P.LaunchReady(2, resume, at_most=prep.at_most, resume_samples=samples))
        (launch,) = [a for a in acts if isinstance(a, P.Launch)]
        self.feed(P.WorkersStarted(launch.attempt))
        return launch

    def prepared(self) -> list[int | None]:
        return [a.at_most for a in self.actions if isinstance(a, P.PrepareLaunch)]

    def logged(self, event: str) -> list[dict[str, object]]:
        return [a.as_dict() for a in self.actions if isinstance(a, P.Log) and a.event == event]


def nan_at(d: Health, step: int, first: int = 1) -> None:
    d.steps(range(first, step))
    d.steps(range(step, step + 1), loss=math.nan)


# ---------------------------------------------------------------------- rollback


def test_a_nan_loss_stops_the_attempt_on_its_step():
    d = Health(S)
    d.launch()
    nan_at(d, 31)
    assert ([a.reason for a in d.actions if isinstance(a, P.StopWorkers)], d.st.phase) == (
        [
            "nonfinite at step 31 on rank 0: loss not finite; rolling back to step 30 or before, skipping data "
            "positions [360, 372)"
        ],
        "stopping",
    )


def test_a_nan_rolls_back_to_a_checkpoint_before_its_step_with_a_skip_of_its_batch():
    d = Health(S)
    d.launch()
    nan_at(d, 31)
    launch = d.relaunch(resume=20, samples=240)
    assert (d.prepared(), launch.resume_step, launch.skips) == ([None, 30], 20, ((360, 372),))


def test_a_confirmed_loss_spike_rolls_back_before_its_onset_and_skips_to_its_detection():
    d = Health(S)
    d.launch()
    d.steps(range(1, 41))
    d.steps(range(41, 45), loss=9.0)  # onset 41, confirmed on step 44 (patience 4)
    launch = d.relaunch(resume=40, samples=480)
    assert (d.prepared()[-1], launch.skips) == (40, ((480, 528),))


def test_the_skip_reaches_skip_extra_steps_past_the_detection_by_default():
    d = Health(settings(nproc_max=2))
    d.launch()
    nan_at(d, 31)
    launch = d.relaunch(resume=20, samples=240)
    assert launch.skips == ((360, 372 + AnomalyConfig().skip_extra_steps * G),)


def test_the_rollback_margin_and_the_extra_steps_widen_the_rollback_and_the_skip():
    d = Health(anomaly_settings(rollback_margin_steps=10, skip_extra_steps=5))
    d.launch()
    nan_at(d, 31)
    launch = d.relaunch(resume=20, samples=240)
    assert (d.prepared()[-1], launch.skips) == (20, ((360, 372 + 5 * G),))


def test_the_incident_names_the_step_the_rollback_resumed_from():
    d = Health(S)
    d.launch()
    nan_at(d, 31)
    d.relaunch(resume=20, samples=240)
    inc = d.st.anomaly.incident
    assert (inc.kind, inc.rollback_to, inc.resumed_from) == ("nonfinite", 30, 20)


def test_a_rollback_is_relaunched_at_once_and_counts_no_restart():
    d = Health(S)
    d.launch()
    nan_at(d, 31)
    d.relaunch(resume=20, samples=240)
    assert (d.st.restarts, d.st.phase, "restart_scheduled" in d.events()) == ((), "running", False)


def test_a_rollback_logs_the_anomaly_the_rollback_and_the_skip():
    d = Health(S)
    d.launch()
    nan_at(d, 31)
    told = (
        d.logged("anomaly_detected")[0]["kind"],
        d.logged("rollback_started")[0]["to_step"],
        d.logged("data_skipped")[0]["samples"],
    )
    assert told == ("nonfinite", 30, 12)


def test_a_crash_after_a_rollback_that_reached_no_step_of_the_abandoned_timeline_is_progress():
    d = Health(S)
    d.launch()
    nan_at(d, 31)
    d.relaunch(resume=20, samples=240)
    d.steps(range(21, 26), offset=12)  # below step 31, which the timeline rolled back from reached
    d.feed(P.WorkersExited(d.st.attempt.number, 1))
    assert d.st.no_progress_streak == 0


def test_the_skips_in_force_go_to_every_later_launch():
    d = Health(S)
    d.launch()
    nan_at(d, 31)
    d.relaunch(resume=20, samples=240)
    d.steps(range(21, 40), offset=12)
    d.feed(P.WorkersExited(d.st.attempt.number, 1))  # a crash: restarted as usual, from the newest checkpoint
    d.now += 2  # past the backoff
    launch = d.launch(resume=30)
    assert (d.prepared()[-1], launch.skips) == (None, ((360, 372),))


def test_a_spike_after_a_rollback_is_judged_against_the_steps_before_the_resume_point():
    d = Health(S)
    d.launch()
    d.steps(range(1, 41))
    d.steps(range(41, 45), loss=9.0)
    d.relaunch(resume=40, samples=480)
    d.steps(range(41, 45), loss=9.0, offset=48)  # the skip did not help: the same kind again
    assert d.logged("anomaly_escalated") != []


def test_a_step_the_rank_guard_refused_rolls_back():
    d = Health(S)
    d.launch()
    d.steps(range(1, 6))
    d.steps(range(6, 7), step_skipped=1)
    assert [a["figure"] for a in d.logged("anomaly_detected")] == ["step_skipped"]


# ---------------------------------------------------------------------- escalation


def test_the_same_anomaly_again_after_its_skip_stops_the_job_with_exit_7():
    d = Health(S)
    d.launch()
    nan_at(d, 31)
    d.relaunch(resume=20, samples=240)
    nan_at(d, 35, first=21)
    acts = d.feed(P.WorkersExited(d.st.attempt.number, -9))
    (exit_,) = [a for a in acts if isinstance(a, P.Exit)]
    assert (exit_.code, d.st.phase) == (7, "done")


def test_an_escalation_names_the_anomaly_and_the_skip_that_did_not_help():
    d = Health(S)
    d.launch()
    nan_at(d, 31)
    d.relaunch(resume=20, samples=240)
    nan_at(d, 35, first=21)
    assert [a["reason"] for a in d.logged("anomaly_escalated")] == [
        "nonfinite at step 35 on rank 0: loss not finite, again after the data skip up to step 31 did not help"
    ]


def test_an_anomaly_of_another_kind_after_a_skip_rolls_back_again():
    d = Health(S)
    d.launch()
    nan_at(d, 31)
    d.relaunch(resume=20, samples=240)
    d.steps(range(21, 41), offset=12)
    d.steps(range(41, 45), loss=9.0, offset=12)
    assert (d.logged("anomaly_escalated"), len(d.logged("rollback_started"))) == ([], 2)


def test_a_rollback_past_the_budget_escalates():
    d = Health(anomaly_settings(max_rollbacks=1, detection_window_steps=0))
    d.launch()
    nan_at(d, 31)
    d.relaunch(resume=20, samples=240)
    nan_at(d, 40, first=21)  # beyond the repeat detector's reach
    assert [a["reason"].split("; ")[-1] for a in d.logged("anomaly_escalated")] == [
        "the rollback budget is spent (1 within 3600s)"
    ]


def test_the_rollback_budget_is_counted_over_its_window():
    d = Health(anomaly_settings(max_rollbacks=1, detection_window_steps=0, rollback_window_s=10))
    d.launch()
    nan_at(d, 31)
    d.relaunch(resume=20, samples=240)
    d.now += 60
    nan_at(d, 40, first=21)
    assert (d.logged("anomaly_escalated"), len(d.logged("rollback_started"))) == ([], 2)


def test_an_anomaly_while_the_ranks_save_for_an_eviction_leaves_the_eviction_s_exit():
    d = Health(S)
    d.launch()
    d.steps(range(1, 31), save_s=0.1)
    d.feed(P.EvictionNoticed("aws", d.now + 120, "spot interruption"))
    d.steps(range(31, 32), loss=math.nan)
    assert (d.st.final.code if d.st.final else None, d.logged("rollback_started")) == (P.EXIT_EVICTED, [])


def test_nothing_is_rolled_back_when_the_detectors_are_off():
    d = Health(anomaly_settings(enabled=False))
    d.launch()
    nan_at(d, 31)
    assert (d.st.phase, d.logged("anomaly_detected")) == ("running", [])


# ---------------------------------------------------------------------- operator rollback

REQ = P.RollbackRequested("00c0ffee", 20, ((100, 200),), "ops@node1 pid 7", "bad shard")


def test_an_operator_rollback_stops_the_attempt_and_resumes_from_its_step_with_its_skip():
    d = Health(S)
    d.launch()
    d.steps(range(1, 31))
    d.feed(REQ)
    launch = d.relaunch(resume=20, samples=240)
    assert (d.prepared()[-1], launch.resume_step, launch.skips) == (20, 20, ((100, 200),))


def test_an_operator_rollback_is_logged_with_who_and_why():
    d = Health(S)
    d.launch()
    d.feed(REQ)
    assert [(a["who"], a["reason"]) for a in d.logged("rollback_requested")] == [("ops@node1 pid 7", "bad shard")]


def test_only_a_rollbacks_launch_bounds_the_ranks_load_the_next_one_does_not():
    # Ranks restarted in place (a node joining the round) load with their launch's environment: a bound there would
    # hold them to the checkpoint of the attempt's launch, behind the ones it committed since.
    d = Health(S)
    first = d.launch()
    d.feed(REQ)
    rollback = d.relaunch(resume=16)
    d.feed(P.WorkersExited(rollback.attempt, 1))
    d.feed(P.Tick(), at=d.now + S.backoff_max_s)
    (after,) = [a for a in d.feed(P.LaunchReady(2, 40)) if isinstance(a, P.Launch)]
    assert [(x.resume_step, x.resume_bound) for x in (first, rollback, after)] == [(None, None), (16, 16), (40, None)]


def test_an_operator_request_is_served_once():
    d = Health(S)
    d.launch()
    d.feed(REQ)
    d.relaunch(resume=20)
    acts = d.feed(REQ)
    assert (acts, d.st.anomaly.served) == ([], ("00c0ffee",))


def test_an_operator_request_found_at_start_is_the_first_launch_s_resume_point():
    d = Health(S)
    d.feed(REQ)
    acts = d.feed(P.Start())
    assert [a for a in acts if isinstance(a, P.PrepareLaunch)] == [P.PrepareLaunch(1, 20)]


def test_an_operator_request_while_a_launch_is_prepared_has_it_prepared_again():
    d = Health(S)
    d.feed(P.Start())
    d.feed(REQ)
    acts = d.feed(P.LaunchReady(2, 50))  # chosen without the bound
    assert [a for a in acts if isinstance(a, (P.PrepareLaunch, P.Launch))] == [P.PrepareLaunch(1, 20)]


def test_an_operator_request_in_backoff_prepares_at_once():
    d = Health(S)
    d.launch()
    d.steps(range(1, 5))
    d.feed(P.WorkersExited(1, 1))
    d.feed(REQ)
    acts = d.feed(P.Tick())
    assert [a for a in acts if isinstance(a, P.PrepareLaunch)] == [P.PrepareLaunch(2, 20)]


def test_an_operator_request_to_a_job_that_is_stopping_for_good_is_left_for_the_next_run():
    d = Health(S)
    d.launch()
    d.feed(P.OperatorStop("SIGTERM"))
    d.feed(REQ)
    assert d.st.anomaly.served == ()


def test_an_operator_rollback_counts_towards_no_budget():
    d = Health(anomaly_settings(max_rollbacks=0))
    d.launch()
    d.feed(REQ)
    d.relaunch(resume=20)
    assert (d.st.phase, d.logged("anomaly_escalated")) == ("running", [])


# ---------------------------------------------------------------------- reported only


def test_a_straggler_is_reported_and_the_attempt_goes_on():
    d = Health(S)
    d.launch()
    att = d.st.attempt
    for s in range(1, 21):
        d.now += 0.5
        for r, t in ((0, 0.1), (1, 0.3)):
            fig = (("loss", 2.0), ("samples", float(s * G)), ("step_s", t))
            d.feed(P.Heartbeat(att.number, r, s, Phase.TRAIN, rank=r, figures=fig, sent=d.now))
    assert ([a["rank"] for a in d.logged("straggler_detected")], d.st.phase) == ([1], "running")
    assert sum(isinstance(a, WriteJournal) for a in d.actions) == 1  # `ftsup status` reads stragglers from it


def test_every_event_these_rules_log_is_listed():
    d = Health(S)
    d.launch()
    nan_at(d, 31)
    d.relaunch(resume=20, samples=240)
    nan_at(d, 35, first=21)
    d2 = Health(S)
    d2.feed(REQ)
    assert set(d.events() + d2.events()) - EVENTS == set()
