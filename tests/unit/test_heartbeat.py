"""The supervisor's end of the heartbeat channel: the schema every message is checked against,
and the receiver on a real socket in this process (credentials, fairness, caps, counts)."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter

from ftsup.supervisor.heartbeat import DROP_REASONS, Admission, BadBeat, Beat, HeartbeatReceiver, parse_beat
from ftsup.trainer.runtime import MAX_BEAT_BYTES, MAX_FIGURES, PROTOCOL_VERSION, encode_beat
from tests.procs import kill_tree

BASE = {"v": PROTOCOL_VERSION, "attempt": 1, "rank": 0, "local_rank": 0, "pid": 4242, "step": 7, "phase": "train",
        "t": 1_700_000_000.5, "mono": 12.25}  # fmt: skip


def raw(**fields: object) -> bytes:
    return json.dumps({**BASE, **fields}).encode()


def reason_of(message: bytes) -> str:
    with pytest.raises(BadBeat) as e:
        parse_beat(message)
    return e.value.reason


# ---------------------------------------------------------------------- the schema


def test_an_encoded_beat_parses_back_to_its_fields():
    message = encode_beat(attempt=3, rank=5, local_rank=1, pid=99, step=12, phase="save", t=1.5, mono=2.5,
                          figures={"loss": 2.25, "saved_step": 12})  # fmt: skip
    assert parse_beat(message) == Beat(3, 5, 1, 99, 12, "save", 1.5, 2.5, (("loss", 2.25), ("saved_step", 12.0)))


def test_a_step_of_infinity_is_malformed():
    assert reason_of(raw().replace(b'"step": 7', b'"step": Infinity')) == "malformed"


def test_a_400_digit_integer_is_malformed():
    assert reason_of(raw().replace(b'"step": 7', b'"step": ' + b"9" * 400)) == "malformed"


def test_60_kb_of_nested_lists_is_refused_before_parsing_in_microseconds():
    message = b'{"v": 2, "step": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"
    t0 = time.perf_counter()
    assert reason_of(message) == "malformed"
    assert time.perf_counter() - t0 < 0.01


def test_a_message_longer_than_the_cap_is_malformed():
    assert reason_of(raw(note_s=1.0)[:-1] + b" " * MAX_BEAT_BYTES + b"}") == "malformed"


def test_a_beat_of_another_protocol_version_is_dropped_as_version():
    assert reason_of(raw(v=1)) == "version"


def test_a_phase_outside_the_set_is_malformed():
    assert reason_of(raw(phase="training")) == "malformed"


def test_a_boolean_is_not_an_integer():
    assert reason_of(raw(step=True)) == "malformed"


@pytest.mark.parametrize(("field", "value"), [("pid", 0), ("pid", 2**22 + 1), ("step", -1), ("step", 10**13),
                                              ("local_rank", 2**16 + 1), ("attempt", -3), ("mono", -1.0)])  # fmt: skip
def test_integers_and_times_out_of_range_are_malformed(field, value):
    assert reason_of(raw(**{field: value})) == "malformed"


def test_a_figure_that_was_not_finite_at_the_rank_arrives_as_nan():
    (name, value), = parse_beat(raw(loss=None)).figures  # fmt: skip
    assert (name, value != value) == ("loss", True)


@pytest.mark.parametrize("figures", [{"bad-name": 1.0}, {"x" * 65: 1.0}, {"loss": "high"}, {"loss": 1e999},
                                     {f"f{i}": 1.0 for i in range(MAX_FIGURES + 1)}])  # fmt: skip
def test_figures_outside_the_schema_make_the_beat_malformed(figures):
    text = json.dumps({**BASE, **figures}).replace("Infinity", "1e999").encode()
    assert reason_of(text) == "malformed"


def test_a_key_given_twice_is_malformed():
    assert reason_of(raw()[:-1] + b', "step": 8}') == "malformed"


HOSTILE = [
    b"", b"\x00" * 100, b"\xff\xfe{", b"null", b"[]", b"{}", b'"beat"', b"1e999", b"{" * 5000, b"[" * 60_000,
    b'{"v": 2}', b'{"v": "2"}', b'{"v": 2.0}', b'{"v": NaN}', b'{"v": 2, "step": -Infinity}',
    raw().replace(b'"t": 1700000000.5', b'"t": NaN'), raw().replace(b"12.25", b"1" + b"0" * 400),
    raw(pid="4242"), raw(phase=None), raw(rank=[0]), raw(local_rank={"a": 1}), raw(attempt=2**31),
    raw(loss={"nested": 1}), raw(**{"": 1.0}), raw(**{"ü": 1.0}), raw()[:-1], raw() + b"}", raw() + b" trailing",
    raw().replace(b"train", b"tr\\u0000in"), raw().replace(b"train", b"\\ud800"), b'{"v": 2' + b", " * 2000 + b"}",
]  # fmt: skip


def test_every_hostile_payload_and_thousands_of_mutations_give_badbeat_and_nothing_else():
    rnd = random.Random(13)
    valid = raw(loss=2.5, save_s=0.25)
    payloads = list(HOSTILE)
    for _ in range(5000):  # flips, cuts, splices and repeats of a valid beat
        b = bytearray(valid)
        for _ in range(rnd.randint(1, 4)):
            op, i = rnd.randrange(4), rnd.randrange(len(b))
            if op == 0:
                b[i] = rnd.randrange(256)
            elif op == 1:
                del b[i : i + rnd.randint(1, 8)]
            elif op == 2:
                b[i:i] = rnd.choice([b"[", b"{", b"}", b'"', b"\\", b"9" * 30, b"Infinity", b"-", b"e999", b"\x80"])
            else:
                b[i:i] = b[i : i + 16] * rnd.randint(2, 50)
        payloads.append(bytes(b))
    outcomes = {"beat": 0, **dict.fromkeys(DROP_REASONS, 0)}
    for p in payloads:
        try:
            parse_beat(p)
            outcomes["beat"] += 1
        except BadBeat as e:
            outcomes[e.reason] += 1
    assert sum(outcomes.values()) == len(payloads) and outcomes["malformed"] > len(payloads) // 2


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
        [{"dropped": {"malformed": 1}, "reason": "1 malformed"}, None,
         {"dropped": {"malformed": 2}, "reason": "2 malformed"}],
    )  # fmt: skip


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
        got = (admission.admits(attempt, child.pid), admission.admits(attempt, os.getppid()),
               Admission().admits(None, child.pid))  # fmt: skip
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
