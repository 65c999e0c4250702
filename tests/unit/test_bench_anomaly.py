"""`ftsup bench anomaly`'s reading of the supervisor's log and its targets, over synthetic events."""

from __future__ import annotations

from typing import Any

from ftsup.tools.bench import anomaly
from ftsup.tools.faults.chaos import LogEvent


def ev(t: float, event: str, **fields: Any) -> LogEvent:
    return LogEvent(t, event, {"event": event, **fields})


NAN_RUN = [
    ev(0.0, "workers_launched", attempt=1),
    ev(2.0, "first_step_reached", attempt=1, step=1),
    ev(10.0, "anomaly_detected", kind="nonfinite", step=40, onset_step=40, rank=1),
    ev(10.1, "rollback_started", to_step=35, skips=[[468, 492]]),
    ev(10.2, "data_skipped", skips=[[468, 492]]),
    ev(13.5, "first_step_reached", attempt=2, step=36),
]


def test_a_nan_caught_on_its_step_is_0_steps_late_and_its_rollback_is_timed_to_the_first_resumed_step() -> None:
    got = anomaly.incident(NAN_RUN, fault_step=40)
    want = {"delay_steps": 0, "onset_error": 0, "to_step": 35, "rollback_s": 3.4, "resumed_step": 36, "attempt": 2}
    assert {k: got[k] for k in want} == want


def test_a_spike_detected_later_than_its_onset_counts_the_steps_between() -> None:
    events = [ev(1.0, "anomaly_detected", kind="loss_spike", step=45, onset_step=41)]
    got = anomaly.incident(events, fault_step=40)
    assert (got["delay_steps"], got["onset_error"], "rollback_s" in got) == (5, 1, False)


def test_a_run_without_an_anomaly_has_no_delay() -> None:
    assert anomaly.incident(NAN_RUN[:2], fault_step=40) == {"rollbacks": 0, "escalated": False}


def test_a_crash_is_timed_from_its_failure_event_to_the_next_first_step() -> None:
    events = [
        ev(2.0, "first_step_reached", attempt=1, step=1),
        ev(9.0, "worker_exited", rank=1),
        ev(12.25, "first_step_reached", attempt=2, step=36),
    ]
    assert anomaly.crash(events) == {
        "detected_by": "worker_exited",
        "recover_s": 3.25,
        "resumed_step": 36,
        "attempt": 2,
    }


def test_every_alarm_of_a_clean_run_is_a_false_positive() -> None:
    events = [
        ev(1.0, "first_step_reached", step=1),
        ev(5.0, "straggler_detected", rank=1),
        ev(6.0, "anomaly_detected", kind="loss_spike", step=9),
    ]
    assert [a["event"] for a in anomaly.alarms(events)] == ["straggler_detected", "anomaly_detected"]


def rows(**overrides: Any) -> list[dict[str, Any]]:
    nan = [{"exit": 0, "delay_steps": 0, "rollback_s": 3.0, "load_s": 0.5}] * 3
    spike = [{"exit": 0, "delay_steps": 4, "rollback_s": 3.2, "load_s": 0.5}] * 3
    kill = [{"exit": 0, "recover_s": 3.0}] * 3
    slow = [{"exit": 0, "reported_step": 12, "failures": []}] * 3
    clean = [{"exit": 0, "alarms": []}] * 3
    runs = {"nan": nan, "spike": spike, "kill": kill, "slow": slow, "clean": clean, **overrides}
    return [anomaly.summarize(name, r) for name, r in runs.items()]


def test_targets_met_pass_every_check() -> None:
    assert {k: c["pass"] for k, c in anomaly.checks(rows(), patience=4).items()} == {
        "nan_detected_on_its_step": True,
        "spike_detected_within_patience": True,
        "rollback_within_crash_recovery_plus_load": True,
        "straggler_reported_and_not_killed": True,
        "no_false_positives": True,
        "every_job_finished": True,
    }


def test_a_nan_caught_one_step_late_fails_its_check() -> None:
    late = [{"exit": 0, "delay_steps": 0}, {"exit": 0, "delay_steps": 1}]
    assert anomaly.checks(rows(nan=late), patience=4)["nan_detected_on_its_step"]["pass"] is False


def test_a_nan_never_detected_fails_its_check() -> None:
    assert anomaly.checks(rows(nan=[{"exit": 0}]), patience=4)["nan_detected_on_its_step"]["pass"] is False


def test_a_spike_past_patience_fails_and_an_unknown_patience_is_not_measured() -> None:
    got = [anomaly.checks(rows(), patience=p)["spike_detected_within_patience"]["pass"] for p in (3, None)]
    assert got == [False, None]


def test_a_rollback_slower_than_crash_recovery_plus_load_fails() -> None:
    slow = [{"exit": 0, "delay_steps": 0, "rollback_s": 4.0, "load_s": 0.5}]
    check = anomaly.checks(rows(nan=slow, spike=slow), patience=4)["rollback_within_crash_recovery_plus_load"]
    assert (check["pass"], check["rollback_s"], check["recover_s"], check["load_s"]) == (False, 4.0, 3.0, 0.5)


def test_a_straggler_reported_after_20_steps_fails_its_check() -> None:
    late = [{"exit": 0, "reported_step": 21, "failures": []}]
    assert anomaly.checks(rows(slow=late), patience=4)["straggler_reported_and_not_killed"]["pass"] is False


def test_a_straggler_killed_as_a_hang_fails_its_check() -> None:
    killed = [{"exit": 0, "reported_step": 12, "failures": ["heartbeat_timed_out"]}]
    assert anomaly.checks(rows(slow=killed), patience=4)["straggler_reported_and_not_killed"]["pass"] is False


def test_a_slowed_rank_is_read_as_its_first_report_and_every_failure() -> None:
    events = [
        ev(1.0, "straggler_detected", rank=1, ratio=2.9, steps=10, step=14),
        ev(2.0, "straggler_detected", rank=1, ratio=3.1, steps=10, step=30),
        ev(3.0, "heartbeat_timed_out"),
    ]
    assert anomaly.straggler(events) == {
        "failures": ["heartbeat_timed_out"],
        "reported_step": 14,
        "rank": 1,
        "ratio": 2.9,
    }


def test_one_alarm_in_a_clean_run_fails_no_false_positives() -> None:
    clean = [{"exit": 0, "alarms": []}, {"exit": 0, "alarms": [{"event": "straggler_detected"}]}]
    assert anomaly.checks(rows(clean=clean), patience=4)["no_false_positives"] == {
        "pass": False,
        "false_positives": 1,
        "runs": 2,
    }


def test_a_job_that_escalated_fails_every_job_finished() -> None:
    nan = [{"exit": 7, "delay_steps": 0}]
    assert anomaly.checks(rows(nan=nan), patience=4)["every_job_finished"]["pass"] is False


def test_the_table_names_every_row_and_check() -> None:
    out = {"results": rows(), "checks": anomaly.checks(rows(), patience=4)}
    text = anomaly.table(out)
    assert [name in text for name in ("nan", "spike", "kill", "clean", "no_false_positives: PASS")] == [True] * 5


def test_slow_runs_without_a_report_are_counted_in_the_note() -> None:
    row = anomaly.summarize("slow", [{"exit": 0, "failures": []}, {"exit": 0, "reported_step": 9, "failures": []}])
    assert row["note"] == "1 of 2 runs without a straggler reported"
