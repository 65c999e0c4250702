"""The supervisor's end of the heartbeat channel: the receiver on a real socket in this process
(credentials, fairness, caps, counts) and admission. The schema is tests/unit/test_protocol.py's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter

from ftsup.supervisor.run.heartbeat import Admission, HeartbeatReceiver
from tests.procs import kill_tree
from tests.unit.test_protocol import raw

# ---------------------------------------------------------------------- the receiver, on a real socket


@pytest.fixture
def receiver(tmp_path: Path):
    with HeartbeatReceiver(tmp_path / "run") as r:
        yield r


def connect(receiver: HeartbeatReceiver) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(str(receiver.path))
    return s


def test_the_socket_and_its_directory_are_private_to_this_user(receiver):
    assert (receiver.dir.stat().st_mode & 0o777, receiver.path.stat().st_mode & 0o777) == (0o700, 0o600)


def test_a_beat_of_this_process_comes_out_with_its_verified_pid(receiver):
    with connect(receiver) as s:
        s.send(raw(pid=os.getpid()))
        assert [b.pid for b in receiver.drain()] == [os.getpid()]


def test_a_beat_claiming_another_pid_is_dropped_as_spoofed(receiver):
    with connect(receiver) as s:
        s.send(raw(pid=1, local_rank=7))
        assert (receiver.drain(), receiver.dropped["spoofed"]) == ([], 1)


def test_a_sender_that_is_not_admitted_is_dropped_as_foreign(receiver):
    with connect(receiver) as s:
        s.send(raw(pid=os.getpid()))
        assert (receiver.drain(admit=lambda pid: False), receiver.dropped["foreign"]) == ([], 1)


def test_a_peer_that_sent_garbage_is_disconnected_and_its_queue_discarded(receiver):
    with connect(receiver) as s:
        s.send(b"garbage")
        s.send(raw(pid=os.getpid()))
        receiver.drain()
        assert (receiver.connections, receiver.dropped["malformed"]) == (0, 1)


def test_a_datagram_sender_cannot_reach_the_receiver(receiver):
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s, pytest.raises(OSError):
        s.sendto(raw(pid=os.getpid()), str(receiver.path))


def test_a_flooding_connection_neither_starves_a_rank_nor_makes_a_drain_unbounded(tmp_path):
    with HeartbeatReceiver(tmp_path / "run", per_connection=8) as r, connect(r) as flood, connect(r) as rank:
        flood.setblocking(False)
        sent = 0
        try:
            while True:  # until the kernel refuses more: the flood's own queue is full
                flood.send(raw(pid=os.getpid(), step=1))
                sent += 1
        except BlockingIOError:
            pass
        rank.send(raw(pid=os.getpid(), step=99))
        steps = [b.step for b in r.drain()]
        assert (sent > 8, steps.count(1), 99 in steps) == (True, 8, True)


def test_connections_beyond_the_cap_are_refused(tmp_path):
    with HeartbeatReceiver(tmp_path / "run", max_connections=2) as r:
        socks = [connect(r) for _ in range(4)]
        r.drain()
        for s in socks:
            s.close()
        assert (r.connections, r.dropped["refused"]) == (2, 2)


def test_drops_feed_the_counter_and_are_logged_at_most_once_per_interval(tmp_path):
    registry = CollectorRegistry()
    counter = Counter("ftsup_heartbeats_dropped_total", "t", ["reason"], registry=registry)
    with HeartbeatReceiver(tmp_path / "run", counter=counter) as r:
        logged = []
        for now in (0.0, 1.0, 10.5):
            with connect(r) as s:
                s.send(b"garbage")
                r.drain()
            logged.append(r.drops_to_log(now, every_s=10.0))
    assert (registry.get_sample_value("ftsup_heartbeats_dropped_total", {"reason": "malformed"}), logged) == (
        3.0,
        [
            {"dropped": {"malformed": 1}, "reason": "1 malformed"},
            None,
            {"dropped": {"malformed": 2}, "reason": "2 malformed"},
        ],
    )


# ---------------------------------------------------------------------- admission


class FakeAttempt:
    def __init__(self, number: int, pid: int, started_at: float) -> None:
        self.number, self.pid, self.started_at = number, pid, started_at
        self.known_pids: set[int] = set()


def test_admission_takes_descendants_of_the_attempt_and_no_one_else():
    attempt = FakeAttempt(1, os.getpid(), time.time() - 5)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        admission = Admission()
        got = (
            admission.admits(attempt, child.pid),
            admission.admits(attempt, os.getppid()),
            Admission().admits(None, child.pid),
        )
    finally:
        kill_tree(child.pid)
        child.wait()
    assert got == (True, False, False)


def test_after_an_attempt_its_ranks_last_beats_are_still_admitted_and_no_one_elses():
    admission = Admission()
    attempt = FakeAttempt(1, -1, 0.0)
    attempt.known_pids.add(os.getpid())
    admission.admits(attempt, os.getpid())
    assert (admission.admits(None, os.getpid()), admission.admits(None, os.getppid())) == (True, False)


def test_admission_verdicts_start_afresh_with_each_attempt():
    admission = Admission()
    first, second = FakeAttempt(1, -1, 0.0), FakeAttempt(2, -1, 0.0)  # a torchrun that is no one's parent
    first.known_pids.add(os.getpid())
    assert (admission.admits(first, os.getpid()), admission.admits(second, os.getpid())) == (True, False)
