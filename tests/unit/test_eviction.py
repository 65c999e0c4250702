"""Eviction notices: provider protocols against a local metadata server, and the policy's
deadline-aware decisions with a fake clock."""

from __future__ import annotations

import socket

import pytest

from ftsup.protocol import Phase
from ftsup.supervisor.eviction import notices
from ftsup.supervisor.eviction.local import CommandWatcher, FileWatcher
from ftsup.supervisor.eviction.providers import AwsWatcher, AzureWatcher, GcpWatcher, WatchError
from ftsup.supervisor.eviction.runner import WatcherThreads
from ftsup.supervisor.policy import machine as P
from ftsup.supervisor.policy.events import CheckpointCommitted
from tests.metadata_server import MetadataServer
from tests.settings import settings
from tests.unit.test_policy import Driver

NOW = 1_800_000_000.0


@pytest.fixture
def server():
    with MetadataServer() as srv:
        yield srv


def test_aws_reports_nothing_until_an_instance_action_then_its_time(server):
    w = AwsWatcher(server.url, 30)
    assert w.poll(NOW) is None
    server.state.evict_aws(in_s=120)
    n = w.poll(NOW)
    assert n is not None and n.source == "aws" and "terminate" in n.detail and not n.advisory
    assert "PUT /latest/api/token" in server.state.requests  # IMDSv2: a session token first


def test_aws_rebalance_recommendation_is_advisory(server):
    server.state.set(aws_rebalance={"noticeTime": "2026-11-30T00:00:00Z"})
    n = AwsWatcher(server.url, 30).poll(NOW)
    assert n is not None and n.advisory and n.deadline_unix == NOW + 30


def test_gcp_long_poll_returns_when_preempted(server):
    w = GcpWatcher(server.url, 30, long_poll_s=5)
    assert w.poll(NOW) is None
    server.state.evict_gcp()
    n = w.poll(NOW)
    assert n is not None and n.source == "gcp"
    assert any("wait_for_change=true" in r for r in server.state.requests)


def test_azure_preempt_event_has_its_not_before_deadline_and_is_acknowledged(server):
    w = AzureWatcher(server.url, 30)
    assert w.poll(NOW) is None
    server.state.evict_azure(in_s=45, event_id="ev-1")
    n = w.poll(NOW)
    assert n is not None and n.ack_id == "ev-1"
    w.ack(n)
    assert server.state.acks == ["ev-1"]


@pytest.mark.parametrize("mode", ["garbage", "error"])
@pytest.mark.parametrize("cls", [AwsWatcher, GcpWatcher, AzureWatcher])
def test_a_misbehaving_endpoint_makes_the_watcher_blind_never_quiet(server, mode, cls):
    server.state.set(mode=mode)
    with pytest.raises(WatchError):
        cls(server.url, 30).poll(NOW)


@pytest.mark.parametrize("cls", [AwsWatcher, GcpWatcher, AzureWatcher])
def test_a_slow_endpoint_makes_the_watcher_blind(server, cls):
    server.state.set(mode="slow", slow_s=2.0)
    with pytest.raises(WatchError):
        cls(server.url, 30, timeout_s=0.3).poll(NOW)


@pytest.mark.parametrize("cls", [AwsWatcher, GcpWatcher, AzureWatcher])
def test_an_unreachable_endpoint_makes_the_watcher_blind(cls):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(WatchError):
        cls(f"http://127.0.0.1:{port}", 30, timeout_s=0.5).poll(NOW)


def test_file_watcher_reads_an_optional_deadline(tmp_path):
    w = FileWatcher(tmp_path / "evict", 30)
    assert w.poll(NOW) is None
    (tmp_path / "evict").write_text('{"deadline_s": 7}')
    assert w.poll(NOW).deadline_unix == NOW + 7


def test_command_watcher_output_is_a_notice_and_failure_is_blind():
    assert CommandWatcher(["true"], 30).poll(NOW) is None
    assert CommandWatcher(["echo", "preempted"], 30).poll(NOW).detail == "preempted"
    with pytest.raises(WatchError):
        CommandWatcher(["false"], 30).poll(NOW)


def test_watcher_threads_report_blindness_once_and_a_notice_once(server):
    server.state.set(mode="error")
    threads = WatcherThreads([AzureWatcher(server.url, 30)], poll_interval_s=0.01).start()
    try:
        first = threads.reports.get(timeout=10)
        assert isinstance(first, notices.Blind)
        server.state.set(mode="ok")
        assert isinstance(threads.reports.get(timeout=10), notices.Seeing)
        server.state.evict_azure()
        assert isinstance(threads.reports.get(timeout=10), notices.Notice)
    finally:
        threads.close()
    assert [r for r in threads.drain() if not isinstance(r, notices.Blind | notices.Seeing)] == []


# --------------------------------------------------------------------------- policy


def running_driver(save_s: float | None = 0.5) -> Driver:
    d = Driver(settings(nproc_max=2, save_margin_s=5.0))
    d.launch()
    d.train(range(1, 11), dt=0.2)
    if save_s is not None:
        d.feed(P.Heartbeat(1, 0, 10, Phase.TRAIN, figures=(("save_s", save_s),)))
    return d


def test_a_notice_with_time_to_save_requests_an_emergency_save_and_stop():
    d = running_driver()
    acts = d.feed(P.EvictionNoticed("aws", d.now + 30, "terminate"))
    (req,) = [a for a in acts if isinstance(a, P.RequestSave)]
    assert (req.seq, req.stop) == (1, True)
    assert not any(isinstance(a, P.StopWorkers) for a in acts)


def test_a_deadline_too_short_for_a_save_stops_at_once_and_says_why():
    d = running_driver(save_s=4.0)
    acts = d.feed(P.EvictionNoticed("gcp", d.now + 8, "preempted"))
    assert not any(isinstance(a, P.RequestSave) for a in acts)
    assert any(isinstance(a, P.StopWorkers) for a in acts)
    (skipped,) = [a for a in acts if isinstance(a, P.Log) and a.event == "save_skipped"]
    assert "would not finish before the deadline" in skipped.as_dict()["reason"]


def test_the_save_estimate_falls_back_to_the_checkpoint_size():
    d = running_driver(save_s=None)
    acts = d.feed(P.EvictionNoticed("gcp", d.now + 10, "preempted", state_bytes=4 * 2**30))  # ~16 s to save
    assert not any(isinstance(a, P.RequestSave) for a in acts)


def test_commit_is_acknowledged_then_the_clean_exit_is_an_eviction():
    d = running_driver()
    d.feed(P.EvictionNoticed("azure", d.now + 30, "Preempt"))
    acts = d.feed(P.Heartbeat(1, 0, 11, Phase.TRAIN, figures=(("saved_step", 11.0), ("save_s", 0.4))))
    assert P.AckEviction("azure") in acts
    acts = d.feed(P.WorkersExited(1, 0))
    assert [a.code for a in acts if isinstance(a, P.Exit)] == [P.EXIT_EVICTED]


def test_an_emergency_commit_is_handed_to_the_durable_tier_as_a_value():
    d = running_driver()
    d.feed(P.EvictionNoticed("azure", d.now + 30, "Preempt"))
    acts = d.feed(P.Heartbeat(1, 0, 11, Phase.TRAIN, figures=(("saved_step", 11.0), ("save_s", 0.4))))
    assert [a for a in acts if isinstance(a, CheckpointCommitted)] == [CheckpointCommitted(11, "emergency")]


def test_ranks_still_running_at_the_deadline_are_stopped():
    d = running_driver()
    deadline = d.now + 30
    d.feed(P.EvictionNoticed("signal:SIGTERM", deadline, ""))
    assert d.feed(P.Tick(), at=deadline - 5) == []  # saving takes long: no hang alarms
    acts = d.feed(P.Tick(), at=deadline - 0.5)
    assert any(isinstance(a, P.StopWorkers) for a in acts)


def test_an_advisory_notice_saves_without_stopping():
    d = running_driver()
    acts = d.feed(P.EvictionNoticed("aws", d.now + 30, "rebalance", advisory=True))
    (req,) = [a for a in acts if isinstance(a, P.RequestSave)]
    assert req.stop is False and d.st.eviction is None


def test_a_second_notice_changes_nothing():
    d = running_driver()
    d.feed(P.EvictionNoticed("aws", d.now + 30, "terminate"))
    assert d.feed(P.EvictionNoticed("signal:SIGTERM", d.now + 30, "")) == []


def test_a_notice_between_attempts_exits_as_evicted():
    d = running_driver()
    d.feed(P.WorkersExited(1, 1))
    acts = d.feed(P.EvictionNoticed("gcp", d.now + 30, "preempted"))
    assert [a.code for a in acts if isinstance(a, P.Exit)] == [P.EXIT_EVICTED]


def test_a_notice_after_training_finished_lets_the_job_succeed():
    d = running_driver()
    for r in range(2):
        d.feed(P.Heartbeat(1, r, 10, Phase.DONE))
    acts = d.feed(P.EvictionNoticed("signal:SIGTERM", d.now + 30, ""))
    assert [a.event for a in acts if isinstance(a, P.Log)] == ["eviction_noticed"]
    assert [a.code for a in d.feed(P.WorkersExited(1, 0)) if isinstance(a, P.Exit)] == [P.EXIT_OK]


def test_ranks_gone_before_torchrun_exits_is_not_logged_as_a_restart():
    d = running_driver()
    assert d.feed(P.WorkersRestarted(1, new_ranks=False)) == []
    assert d.st.attempt.ranks == ()
