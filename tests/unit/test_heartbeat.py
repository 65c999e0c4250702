"""The supervisor's end of the heartbeat channel: the receiver on a real socket in this process
(credentials, fairness, caps, counts) and admission. The schema is tests/unit/test_protocol.py's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter

from ftsup import procs
from ftsup.protocol import Beat, Phase
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

MARK = procs.Mark("run-t", "node-t", 1)
RANK_0 = {**MARK.environ(), "RANK": "0", "LOCAL_RANK": "0"}


class FakeAttempt:
    def __init__(self, number: int, pid: int, started_at: float, mark: procs.Mark = MARK) -> None:
        self.number, self.pid, self.started_at, self.mark = number, pid, started_at, mark
        self.known_pids: set[int] = set()


@pytest.fixture
def child() -> Iterator[Callable[[dict[str, str]], subprocess.Popen[bytes]]]:
    """Starts children of this process (so: of a FakeAttempt whose torchrun is this process) with more environment;
    each is killed and reaped at the end."""
    started: list[subprocess.Popen[bytes]] = []

    def start(env: dict[str, str]) -> subprocess.Popen[bytes]:
        code = "print('ready', flush=True); import time; time.sleep(60)"
        p = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **env}, stdout=subprocess.PIPE)
        started.append(p)
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        return p

    yield start
    for p in started:
        kill_tree(p.pid)
        p.wait()


def attempt_of_this_process(number: int = 1) -> FakeAttempt:
    return FakeAttempt(number, os.getpid(), time.time() - 5, procs.Mark("run-t", "node-t", number))


def beat(pid: int, *, rank: int = 0, local_rank: int = 0, attempt: int = 1, step: int = 1) -> Beat:
    return Beat(attempt, rank, local_rank, pid, step, Phase.TRAIN, 0.0, 0.0)


def test_admission_takes_the_ranks_of_the_attempt_and_no_one_else(child):
    attempt = attempt_of_this_process()
    rank = child(RANK_0)
    admission = Admission()
    got = (
        admission.admits(attempt, rank.pid),
        admission.admits(attempt, os.getppid()),
        Admission().admits(None, rank.pid),
    )
    assert got == (True, False, False)


def test_a_descendant_without_the_attempts_mark_is_not_admitted(child):
    stranger = child({"RANK": "0", "LOCAL_RANK": "0"})
    assert Admission().admits(attempt_of_this_process(), stranger.pid) is False


def test_a_process_of_the_attempt_that_is_not_a_rank_is_not_admitted(child):
    torchrun_like = child(MARK.environ())  # the mark, but no RANK: torchrun itself, or a helper it started
    assert Admission().admits(attempt_of_this_process(), torchrun_like.pid) is False


def test_a_rank_of_another_attempt_is_not_admitted(child):
    earlier = child({**procs.Mark("run-t", "node-t", 1).environ(), "RANK": "0", "LOCAL_RANK": "0"})
    assert Admission().admits(attempt_of_this_process(2), earlier.pid) is False


@pytest.mark.parametrize(
    "claims",
    [{"rank": 5, "local_rank": 5}, {"rank": 1}, {"local_rank": 1}, {"attempt": 2}],
    ids=["rank 5 of a 2-rank job", "another rank", "another local rank", "another attempt"],
)
def test_a_beat_claiming_a_rank_its_process_does_not_have_is_dropped_as_forged(child, claims):
    attempt = attempt_of_this_process()
    rank = child(RANK_0)
    admission = Admission()
    admission.launched(1, None, 0.0)
    assert (admission.vet(attempt, beat(rank.pid, **claims), 1.0), admission.vet(attempt, beat(rank.pid), 1.0)) == (
        "forged",
        None,
    )


def test_a_beat_claiming_a_step_further_ahead_than_a_step_can_be_is_dropped(child):
    attempt = attempt_of_this_process()
    rank = child(RANK_0)
    admission = Admission()
    admission.launched(1, 100, 0.0)
    verdicts = [admission.vet(attempt, beat(rank.pid, step=s), t) for s, t in ((101, 1.0), (10**12, 1.1), (102, 1.2))]
    assert verdicts == [None, "ahead", None]


def test_a_ranks_environment_is_read_once_then_its_beats_need_no_look_at_its_process(child):
    attempt = attempt_of_this_process()
    rank = child(RANK_0)
    admission = Admission()
    admitted = admission.admits(attempt, rank.pid)
    kill_tree(rank.pid)
    rank.wait()  # gone: its environment cannot be read any more
    assert (admitted, admission.vet(attempt, beat(rank.pid), 1.0)) == (True, None)


def test_after_an_attempt_its_ranks_last_beats_are_still_admitted_and_no_one_elses(child):
    attempt = attempt_of_this_process()
    rank = child(RANK_0)
    admission = Admission()
    admission.admits(attempt, rank.pid)
    assert (admission.admits(None, rank.pid), admission.admits(None, os.getppid())) == (True, False)


def test_admission_verdicts_start_afresh_with_each_attempt(child):
    rank = child(RANK_0)
    admission = Admission()
    assert (
        admission.admits(attempt_of_this_process(1), rank.pid),
        admission.admits(attempt_of_this_process(2), rank.pid),
    ) == (
        True,
        False,
    )


def test_a_beat_ahead_is_dropped_and_counted_and_its_connection_kept(receiver):
    def vet(b: Beat) -> str | None:
        return "ahead" if b.step > 10 else None

    with connect(receiver) as s:
        s.send(raw(pid=os.getpid(), step=1))
        s.send(raw(pid=os.getpid(), step=10**12))
        s.send(raw(pid=os.getpid(), step=2))
        got = [b.step for b in receiver.drain(vet=vet)]
        assert (got, receiver.dropped["ahead"], receiver.connections) == ([1, 2], 1, 1)


def test_a_forged_beat_is_dropped_and_counted_and_its_connection_closed(receiver):
    with connect(receiver) as s:
        s.send(raw(pid=os.getpid(), local_rank=5))
        s.send(raw(pid=os.getpid()))
        got = receiver.drain(vet=lambda b: "forged" if b.local_rank == 5 else None)
        assert (got, receiver.dropped["forged"], receiver.connections) == ([], 1, 0)
