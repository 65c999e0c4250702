"""Supervisor metrics: what the policy's events and states turn into, as a scrape sees it.

The policy is driven by a fake clock (no processes, no sleeps); the exposition text is parsed
back with prometheus_client's own parser.
"""

from __future__ import annotations

import math
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ftsup.protocol import Phase
from ftsup.store import layout
from ftsup.supervisor.config.job import ConfigError, load_config
from ftsup.supervisor.policy import machine as P
from ftsup.supervisor.run.daemon import Daemon
from ftsup.supervisor.telemetry.metrics import FAILURE_KINDS, Metrics, MetricsServer
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
WALL = 1_800_000_000.0  # the Unix time at fake-clock 0


class Run:
    """A policy machine whose log actions and states feed a Metrics, as the daemon does."""

    def __init__(self) -> None:
        self.metrics = Metrics("job-1", "node-a", started_unix=WALL)
        self.m = P.Machine(S)
        self.now = 0.0

    def feed(self, ev: P.Event, at: float | None = None) -> list[P.Action]:
        if at is not None:
            self.now = at
        self.m, acts = self.m.feed(ev, self.now)
        self.metrics.state(self.m.state, self.m.settings, self.now, WALL + self.now)
        for a in acts:
            if isinstance(a, P.Log):
                self.metrics.event(a.event, a.as_dict())
        return acts

    def launch(self, resume: int | None = None) -> None:
        self.feed(P.Start()) if self.m.state.phase == "init" else self.feed(P.Tick(), at=self.m.state.resume_at)
        self.feed(P.LaunchReady(2, resume))
        self.feed(P.WorkersStarted(self.m.state.attempt_no))

    def train(self, steps: range, loss: float = 2.0) -> None:
        for s in steps:
            self.now += 0.5
            for r in range(2):
                self.feed(P.Heartbeat(self.m.state.attempt_no, r, s, Phase.TRAIN, r, (("loss", loss),)))

    def samples(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        out = {}
        for fam in text_string_to_metric_families(self.metrics.render().decode()):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def value(self, name: str, **labels: str) -> float:
        return self.samples()[(name, tuple(sorted(labels.items())))]


def test_a_crash_counts_one_failure_one_restart_two_attempts_and_the_steps_done_again():
    run = Run()
    run.launch()
    run.train(range(1, 8))
    run.feed(P.WorkersExited(1, 1))  # torchrun failed after step 7; the newest checkpoint is step 4
    run.launch(resume=4)
    run.train(range(5, 9))
    assert run.value("ftsup_failures_total", kind="crash") == 1
    assert run.value("ftsup_failures_total", kind="hang") == 0
    assert run.value("ftsup_restarts_total") == 1
    assert run.value("ftsup_attempts_total") == 2
    assert run.value("ftsup_steps_lost_total") == 3  # steps 5, 6, 7 are trained again
    assert run.value("ftsup_events_total", event="worker_exited") == 1
    assert (run.value("ftsup_attempt"), run.value("ftsup_world_size"), run.value("ftsup_step")) == (2, 2, 8)
    assert run.value("ftsup_restart_budget_remaining") == S.max_restarts - 1


def test_a_hang_counts_as_kind_hang_and_the_phase_gauge_follows_the_policy():
    run = Run()
    run.launch()
    run.train(range(1, 4))
    assert run.value("ftsup_phase", phase="running") == 1
    run.feed(P.Tick(), at=run.now + 120)  # silent far past the learned timeout
    assert run.value("ftsup_failures_total", kind="hang") == 1
    assert run.value("ftsup_phase", phase="stopping") == 1
    assert sum(run.value("ftsup_phase", phase=p) for p in ("init", "preparing", "running", "backoff", "done")) == 0


def test_progress_timestamp_is_unix_time_of_the_last_new_step():
    run = Run()
    run.launch()
    run.train(range(1, 4))
    stepped_at = run.now
    run.feed(P.Heartbeat(1, 0, 3, Phase.TRAIN, 0), at=run.now + 5)  # a heartbeat, but no new step
    assert run.value("ftsup_last_progress_timestamp_seconds") == WALL + stepped_at


def test_step_duration_and_heartbeat_timeout_follow_the_step_times():
    run = Run()
    run.launch()
    run.train(range(1, 4))
    got = (run.value("ftsup_step_duration_seconds"), run.value("ftsup_heartbeat_timeout_seconds"))
    assert got == (0.5, S.min_timeout_s)  # 3 x 0.5 s is below the floor


def test_heartbeat_timeout_is_nan_until_steps_are_seen():
    run = Run()
    run.launch()
    assert math.isnan(run.value("ftsup_heartbeat_timeout_seconds"))


def test_loss_comes_from_rank_0_only():
    run = Run()
    run.launch()
    run.metrics.heartbeat(1, {"loss": 9.0})
    run.metrics.heartbeat(0, {"loss": 2.25})
    run.metrics.heartbeat(1, {"loss": 7.0})
    assert run.value("ftsup_loss") == 2.25


def test_eviction_notice_counts_by_source_and_exports_the_deadline_in_unix_time():
    run = Run()
    run.launch()
    run.train(range(1, 3))
    run.feed(P.EvictionNoticed("aws", run.now + 120, "spot interruption", False, 1 << 20))
    assert run.value("ftsup_evictions_noticed_total", source="aws") == 1
    assert run.value("ftsup_save_requests_total", stop="true") == 1
    assert run.value("ftsup_eviction_deadline_timestamp_seconds") == WALL + run.now + 120


def test_the_emergency_save_counts_one_emergency_checkpoint_and_its_duration():
    run = Run()
    run.launch()
    run.train(range(1, 3))
    run.feed(P.EvictionNoticed("aws", run.now + 120, "spot interruption", False, 1 << 20))
    run.feed(P.Heartbeat(1, 0, 2, Phase.TRAIN, 0, (("save_s", 0.5), ("saved_step", 2))))
    assert (run.value("ftsup_emergency_checkpoints_total"), run.value("ftsup_save_duration_seconds")) == (1, 0.5)


def test_daemon_only_events_update_their_own_metrics():
    m = Metrics("job", "node", started_unix=WALL)
    m.event("watcher_went_blind", {"source": "gcp", "reason": "connection refused"})
    m.event("checkpoint_quarantined", {"step": 8})
    m.event("orphans_found", {"pids": [11, 12]})
    m.event("health_probed", {"slots": [0, 1, 2]})
    m.event("health_probe_failed", {"reason": "nvidia-smi missing"})
    text = m.render().decode()
    assert 'ftsup_watcher_blind{source="gcp"} 1.0' in text
    assert "ftsup_checkpoints_quarantined_total 1.0" in text
    assert "ftsup_orphans_found_total 2.0" in text
    assert "ftsup_healthy_slots 3.0" in text
    assert "ftsup_health_probe_failures_total 1.0" in text
    m.event("watcher_recovered", {"source": "gcp"})
    assert 'ftsup_watcher_blind{source="gcp"} 0.0' in m.render().decode()


def test_checkpoint_gauges_follow_the_newest_consistent_checkpoint(tmp_path):
    from tests.helpers import default_files, make_fake_checkpoint

    m = Metrics("job", "node", started_unix=WALL)
    m.checkpoint(layout.latest_consistent(tmp_path), 0)
    assert "ftsup_checkpoint_latest_step -1.0" in m.render().decode()
    make_fake_checkpoint(tmp_path, 12, default_files(), created_unix=1_750_000_000.5)
    info = layout.latest_consistent(tmp_path)
    assert info is not None
    m.checkpoint(info, 1)
    text = m.render().decode()
    assert "ftsup_checkpoint_latest_step 12.0" in text and "ftsup_checkpoints 1.0" in text
    assert "ftsup_checkpoint_latest_timestamp_seconds 1.7500000005e+09" in text
    assert f"ftsup_checkpoint_latest_bytes {float(sum(map(len, default_files().values())))!r}" in text


def test_names_follow_the_conventions_prefix_units_and_total_suffix():
    m = Metrics("job", "node", started_unix=WALL)
    for fam in m.registry.collect():
        assert fam.name.startswith("ftsup_"), fam.name
        if fam.type == "counter":  # the family drops the suffix; its sample keeps it
            assert fam.samples == [] or all(s.name.endswith(("_total", "_created")) for s in fam.samples)
        else:
            assert not fam.name.endswith("_total"), fam.name
        assert not any(unit in fam.name for unit in ("_ms", "_milliseconds", "_mib", "_gib", "_minutes"))


def test_failure_kinds_are_the_four_documented_ones():
    assert set(FAILURE_KINDS.values()) == {"crash", "hang", "no_progress", "startup"}


def test_server_serves_the_registry_and_close_frees_the_port():
    m = Metrics("job", "node", started_unix=WALL)
    server = MetricsServer(m, "127.0.0.1:0")
    try:
        with urllib.request.urlopen(f"http://{server.address}/metrics", timeout=10) as r:
            body = r.read().decode()
        assert 'ftsup_supervisor_info{node_id="node",run_id="job"' in body
    finally:
        server.close()
    with socket.socket() as s:
        # Nothing listens there any more (SO_REUSEADDR only overlooks the finished connection).
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", server.port))


def test_a_busy_metrics_port_is_a_config_error_naming_the_key(tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    cfg_path = Path(tmp_path) / "job.yaml"
    cfg_path.write_text(
        f"job: {{command: ['true'], state_dir: {tmp_path / 'state'}}}\n"
        f"checkpoint: {{dir: {tmp_path / 'ckpt'}}}\n"
        f"metrics: {{listen: '127.0.0.1:{port}'}}\n"
    )
    try:
        with pytest.raises(ConfigError, match=rf"metrics.listen='127.0.0.1:{port}': cannot serve /metrics there"):
            Daemon(load_config(cfg_path)).run()
    finally:
        holder.close()
