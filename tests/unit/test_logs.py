"""Events are defined once, in ftsup.supervisor.telemetry.logs.EVENTS: every event the supervisor emits is listed.

The events are captured as emitted (`structlog.testing.capture_logs()`): the policy is driven
through its decisions with a fake clock and its log actions go through the daemon's `_execute`,
as in a run; the daemon's own events come from its real handlers (watcher reports, the health
probe, the checkpoint choice, the requeue command). Nothing here launches torchrun.
"""

from __future__ import annotations

import math
import re
import sys
from collections import Counter
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml
from structlog.testing import capture_logs

from ftsup.protocol import Phase
from ftsup.supervisor.config.job import load_config
from ftsup.supervisor.eviction.notices import Blind, Seeing
from ftsup.supervisor.eviction.requeue import requeue
from ftsup.supervisor.policy import machine as P
from ftsup.supervisor.policy.events import RanksStarted
from ftsup.supervisor.policy.nodes import NodeFault
from ftsup.supervisor.run.admission import Admission
from ftsup.supervisor.run.daemon import Daemon
from ftsup.supervisor.state.nodes import ClearRequest
from ftsup.supervisor.telemetry.logs import EVENTS
from tests.helpers import default_files, make_fake_checkpoint
from tests.settings import settings

S = settings(
    nproc_max=2,
    startup_timeout_s=60,
    backoff_initial_s=1,
    backoff_max_s=8,
    max_restarts=5,
    window_s=1000,
    max_attempts_without_progress=3,
)


class Drive:
    """A policy machine whose actions the daemon carries out as in a run, minus processes:
    only its log actions are executed (launch and stop would start and signal torchrun)."""

    def __init__(self, daemon: Daemon, settings: P.Settings = S) -> None:
        self.daemon = daemon
        self.m = P.Machine(settings)
        self.now = 0.0

    def feed(self, ev: P.Event, dt: float = 0.0) -> list[P.Action]:
        self.now += dt
        self.m, acts = self.m.feed(ev, self.now)
        self.daemon._execute([a for a in acts if isinstance(a, P.Log)])
        return acts

    def launch(self, slots: int = 2, resume: int | None = None) -> None:
        if self.m.state.phase == "init":
            self.feed(P.Start())
        else:
            self.feed(P.Tick(), dt=max(0.0, self.m.state.resume_at - self.now))
        self.feed(P.LaunchReady(slots, resume))
        self.feed(P.WorkersStarted(self.m.state.attempt_no))

    def train(self, steps: range, **figures: float) -> None:
        for s in steps:
            for r in range(2):
                self.feed(P.Heartbeat(self.m.state.attempt_no, r, s, Phase.TRAIN, r, tuple(figures.items())), dt=0.25)

    def exit(self, code: int) -> None:
        self.feed(P.WorkersExited(self.m.state.attempt_no, code))


def _success(d: Drive) -> None:
    d.launch()
    d.train(range(1, 4))
    d.feed(P.WorkersRestarted(1, new_ranks=True))  # torchrun re-formed its worker group
    d.train(range(4, 6))
    d.exit(0)


def _crash_then_crash_loop(d: Drive) -> None:
    d.launch()
    d.train(range(1, 4))
    d.exit(1)  # worker_exited, restart_scheduled
    for _ in range(3):  # no new step in any later attempt
        d.launch(resume=0)
        d.feed(P.RankExited(d.m.state.attempt_no, 4242, 1))
        d.exit(1)


def _hang_and_startup_and_progress_timeouts(d: Drive) -> None:
    d.launch()
    d.train(range(1, 4))
    d.feed(P.Tick(), dt=120)  # silent far past the learned timeout
    d.exit(-9)
    d.launch(resume=0)
    d.feed(P.Tick(), dt=S.startup_timeout_s + 1)  # never reached a training step
    d.exit(-9)
    d.launch(resume=0)
    d.train(range(4, 8))
    for _ in range(40):  # beating, but stuck on one step
        for r in range(2):
            d.feed(P.Heartbeat(d.m.state.attempt_no, r, 7, Phase.TRAIN, r), dt=0.25)
        d.feed(P.Tick())
    d.exit(-9)


def _budget_spent(d: Drive) -> None:
    d.launch()
    d.train(range(1, 3))
    d.exit(1)


def _evicted_after_an_emergency_save(d: Drive) -> None:
    d.launch()
    d.train(range(1, 4), save_s=0.1)
    d.feed(P.EvictionNoticed("aws", d.now + 30, "spot rebalance", advisory=True))
    d.feed(P.EvictionNoticed("aws", d.now + 120, "spot interruption"))
    d.feed(P.Heartbeat(1, 0, 3, Phase.TRAIN, 0, (("save_s", 0.2), ("saved_step", 3.0))))
    d.exit(0)


def _evicted_without_time_to_save(d: Drive) -> None:
    d.launch()
    d.train(range(1, 4), save_s=30.0)
    d.feed(P.EvictionNoticed("signal:SIGTERM", d.now + 5, "SIGTERM"))  # a save of 30 s does not fit
    d.exit(-15)


def _evicted_before_any_step(d: Drive) -> None:
    d.launch()
    d.feed(P.EvictionNoticed("gcp", d.now + 60, "preempted"))
    d.exit(-15)


def _deadline_reached_while_saving(d: Drive) -> None:
    d.launch()
    d.train(range(1, 4), save_s=0.1)
    d.feed(P.EvictionNoticed("azure", d.now + 20, "Preempt"))
    d.feed(P.Tick(), dt=20)


def _operator_stops(d: Drive) -> None:
    d.launch()
    d.train(range(1, 3))
    d.feed(P.OperatorStop("SIGINT"))
    d.exit(-15)
    idle = Drive(d.daemon)
    idle.feed(P.OperatorStop("SIGINT"))  # before anything was launched


def _a_standby_released_then_joined(d: Drive) -> None:
    d.launch()
    d.exit(1)  # its rendezvous round ended before its ranks started: standby_released
    d.launch()
    d.feed(RanksStarted(d.m.state.attempt_no))  # standby_joined
    d.train(range(1, 3))
    d.exit(0)


def _no_slot_to_launch_on(d: Drive) -> None:
    d.feed(P.Start())
    d.feed(P.LaunchReady(0, None))


def _anomalies_rolled_back_then_escalated(d: Drive) -> None:
    d.launch()
    d.train(range(1, 40), loss=2.0, step_s=0.1)
    d.train(range(40, 41), loss=math.nan)  # anomaly_detected, rollback_started, data_skipped
    d.exit(-9)
    d.feed(P.LaunchReady(2, 30, at_most=39))
    d.feed(P.WorkersStarted(d.m.state.attempt_no))
    d.train(range(31, 41), loss=math.nan)  # the same again: anomaly_escalated
    d.exit(-9)
    d2 = Drive(d.daemon)
    d2.feed(P.RollbackRequested("00c0ffee", 20, ((0, 12),), "ops", "why"))  # rollback_requested, before a start
    d2.feed(P.Start())
    d2.feed(P.LaunchReady(2, 20, at_most=20))
    d2.feed(P.WorkersStarted(d2.m.state.attempt_no))
    for s in range(21, 41):  # a straggler
        for r, t in ((0, 0.1), (1, 0.5)):
            d2.feed(P.Heartbeat(d2.m.state.attempt_no, r, s, Phase.TRAIN, r, (("step_s", t),)), dt=0.1)


SCENARIOS: dict[str, tuple[Callable[[Drive], None], P.Settings]] = {
    "success": (_success, S),
    "crash, then a crash loop": (_crash_then_crash_loop, S),
    "timeouts": (_hang_and_startup_and_progress_timeouts, S),
    "restart budget": (_budget_spent, settings(nproc_max=2, max_restarts=0)),
    "emergency save": (_evicted_after_an_emergency_save, S),
    "no time to save": (_evicted_without_time_to_save, S),
    "nothing to save": (_evicted_before_any_step, S),
    "deadline while saving": (_deadline_reached_while_saving, S),
    "operator": (_operator_stops, S),
    "no slot": (_no_slot_to_launch_on, S),
    "standby": (_a_standby_released_then_joined, settings(nproc_max=2, nnodes_max=2, standby=True)),
    "anomalies": (_anomalies_rolled_back_then_escalated, S),
}


def _daemon(tmp: Path, **sections: dict[str, Any]) -> Daemon:
    cfg: dict[str, Any] = {
        "job": {"command": ["true"], "state_dir": str(tmp / "state")},
        "checkpoint": {"dir": str(tmp / "ckpt")},
        "launch": {"nproc_per_node": 2},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    (tmp / "job.yaml").write_text(yaml.safe_dump(cfg))
    return Daemon(load_config(tmp / "job.yaml"))


def _daemons_own_events(tmp: Path) -> None:
    daemon = _daemon(
        tmp,
        launch={"health_command": [sys.executable, "-c", "print('slot 0 is fine')"]},
        eviction={"requeue_command": [sys.executable, "-c", "exit(3)"]},
    )
    daemon.sources.report(Blind("gcp", "connection refused"))
    daemon.sources.report(Seeing("gcp"))
    make_fake_checkpoint(tmp / "ckpt", 4, default_files(1))
    bad = make_fake_checkpoint(tmp / "ckpt", 8, default_files(2))
    (bad / "shard-00001.safetensors").write_bytes(b"torn")  # not the size its manifest records
    daemon.resume.prepare(1)  # the node passes, the slot probe is blind; step 8 is quarantined, step 4 chosen
    requeue(daemon.cfg.eviction.requeue_command, {}, daemon._emit)  # requested, and failed (exit 3)
    (tmp / "cpu").mkdir()
    _daemon(tmp / "cpu").resume.prepare(1)  # probed: CPU slots; no checkpoint: a fresh start
    make_fake_checkpoint(tmp / "ckpt", 12, default_files(3))
    daemon.resume.prepare(2, at_most=6)  # a rollback: step 12 is abandoned
    (tmp / "state").mkdir(exist_ok=True)
    (tmp / "state" / "rollback.json").write_text("not a request")
    daemon.rollbacks.poll()  # rollback_request_ignored
    (tmp / "sick").mkdir()
    sick = _daemon(tmp / "sick", launch={"health_command": [sys.executable, "-c", "exit(1)"]})
    sick.resume.prepare(1)  # node_checked, failed: launch_deferred
    (tmp / "q" / "state").mkdir(parents=True)
    (tmp / "q" / "state" / "quarantine.json").write_text("[not a quarantine")
    (tmp / "q" / "state" / "quarantine-clear.json").write_text("{}")
    q = _daemon(tmp / "q", launch={"quarantine_failures": 1, "quarantine_s": 10})
    wall = iter([100.0, 100.0, 100.0, 100.0, 200.0, 200.0, 200.0, 200.0])
    keeper = Admission(q.cfg, emit=q._emit, metrics=q.metrics, outages=q.outages, wall=lambda: next(wall, 300.0))
    keeper.adopt()  # quarantine_ignored, the file set aside
    keeper.fault(NodeFault(1, 0, "rank 0 was killed by SIGKILL"))  # node_fault_recorded, node_quarantined
    keeper.admit(2)  # still held: launch_deferred
    keeper.admit(3)  # its time is up: quarantine_expired
    keeper.poll()  # quarantine_clear_ignored
    keeper.clear(ClearRequest("c1ea7", None, "ops", 0.0))  # quarantine_cleared


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[MutableMapping[str, Any]]]:
    """Every event emitted, by who decided it: the policy (through the daemon) or the daemon."""
    tmp = tmp_path_factory.mktemp("logs")
    old = structlog.get_config()
    try:
        with capture_logs() as policy_events:
            for i, (scenario, settings) in enumerate(SCENARIOS.values()):
                (tmp / f"p{i}").mkdir()
                scenario(Drive(_daemon(tmp / f"p{i}"), settings))
        with capture_logs() as daemon_events:
            (tmp / "d").mkdir()
            _daemons_own_events(tmp / "d")
    finally:
        structlog.configure(**old)
    return {"policy": policy_events, "daemon": daemon_events}


def test_every_event_the_policy_logs_through_the_daemon_is_listed(captured):
    assert {e["event"] for e in captured["policy"]} - EVENTS == set()


def test_every_event_the_daemon_logs_itself_is_listed(captured):
    assert {e["event"] for e in captured["daemon"]} - EVENTS == set()


def test_the_capture_sees_every_decision_of_the_policy_and_the_daemons_handlers(captured):
    # Without this, the two tests above would pass on a capture that saw nothing.
    seen = {e["event"] for e in captured["policy"] + captured["daemon"]}
    expected = {
        "world_size_chosen",
        "workers_launched",
        "workers_restarted",
        "job_succeeded",
        "worker_exited",
        "restart_scheduled",
        "crash_loop_detected",
        "heartbeat_timed_out",
        "startup_timed_out",
        "progress_timed_out",
        "restart_budget_exhausted",
        "eviction_noticed",
        "save_requested",
        "checkpoint_committed",
        "save_skipped",
        "stop_requested",
        "job_stopped",
        "job_failed",
        "watcher_went_blind",
        "watcher_recovered",
        "health_probe_failed",
        "health_probed",
        "checkpoint_quarantined",
        "checkpoint_chosen",
        "requeue_requested",
        "requeue_failed",
        "anomaly_detected",
        "rollback_started",
        "data_skipped",
        "anomaly_escalated",
        "rollback_requested",
        "straggler_detected",
        "checkpoint_abandoned",
        "rollback_request_ignored",
        "node_checked",
        "launch_deferred",
        "node_fault_recorded",
        "node_quarantined",
        "quarantine_expired",
        "quarantine_cleared",
        "quarantine_ignored",
        "quarantine_clear_ignored",
        "standby_joined",
        "standby_released",
    }
    assert expected - seen == set()


def test_every_emitted_event_is_counted_under_its_name(tmp_path):
    daemon = _daemon(tmp_path)
    with capture_logs() as cap:
        _success(Drive(daemon))
        _evicted_after_an_emergency_save(Drive(daemon))
    text = daemon.metrics.render().decode()
    counted = {m[0]: float(m[1]) for m in re.findall(r'^ftsup_events_total\{event="([a-z_]+)"\} (\S+)$', text, re.M)}
    emitted = Counter(e["event"] for e in cap)
    assert {e: counted.get(e) for e in emitted} == {e: float(n) for e, n in emitted.items()}


def test_event_names_are_snake_case_past_tense():
    assert [e for e in EVENTS if not re.fullmatch(r"[a-z]+(_[a-z]+)*", e)] == []
    assert [e for e in EVENTS if not re.search(r"(ed|lost|chosen|found|out|blind)$", e)] == []


def test_logging_after_the_daemon_closed_its_log_file_still_works(tmp_path, capsys):
    from ftsup.supervisor.telemetry import logs

    old = structlog.get_config()
    try:
        handle = logs.configure("info", "json", tmp_path / "supervisor.jsonl")
        assert handle is not None
        structlog.get_logger("t").info("supervisor_started")
        handle.close()  # what Daemon.run does when it returns
        structlog.get_logger("t").info("checkpoint_committed")  # e.g. a checkpoint engine in the same process
    finally:
        structlog.configure(**old)
    lines = (tmp_path / "supervisor.jsonl").read_text().splitlines()
    err = capsys.readouterr().err
    assert "supervisor_started" in err and "checkpoint_committed" in err
    assert len(lines) == 1 and "supervisor_started" in lines[0]
