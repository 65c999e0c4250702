"""The rank's end of the channel (`ftsup.trainer.runtime`): heartbeats against a real receiver in this
process (beats never block or raise, what cannot travel is left out, eval keeps beating), and the
control file's reader (a file of another format version is never acted on)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from ftsup.protocol import CONTROL_VERSION, MAX_FIGURES, NO_REQUEST, Request, RuntimeEnv, encode_control
from ftsup.supervisor.run.heartbeat import HeartbeatReceiver
from ftsup.trainer import runtime
from ftsup.trainer.runtime import Agreement, ControlReader, RuntimeClient
from tests.procs import wait_for


@pytest.fixture
def receiver(tmp_path: Path):
    with HeartbeatReceiver(tmp_path / "run") as r:
        yield r


def client(receiver: HeartbeatReceiver | None, interval_s: float = 0.5) -> RuntimeClient:
    path = str(receiver.path) if receiver is not None else "/nonexistent/heartbeat.sock"
    return RuntimeClient(RuntimeEnv(heartbeat_socket=path, heartbeat_interval_s=interval_s, attempt=1))


def test_a_beat_without_a_supervisor_is_dropped_and_counted_never_raised():
    c = client(None)
    c.beat(1, "train", loss=1.0)
    assert (c.sent, c.dropped) == (0, 1)


def test_a_beat_never_blocks_when_the_supervisor_reads_nothing(receiver):
    c = client(receiver)
    t0 = time.monotonic()
    for step in range(20_000):  # far more than the connection's queue holds
        c.beat(step, "train")
    assert (c.dropped > 0, time.monotonic() - t0 < 10) == (True, True)


def test_figures_that_cannot_travel_are_left_out_and_the_beat_goes(receiver):
    c = client(receiver)
    c.beat(3, "train", loss=math.nan, save_s=0.5, big=2**60, note="text", huge=10**400, pid=1, **{"a-b": 1.0})
    (beat,) = receiver.drain()
    assert (beat.pid, [name for name, _ in beat.figures]) == (os.getpid(), ["big", "loss", "save_s"])


def test_at_most_max_figures_travel(receiver):
    client(receiver).beat(3, "train", **{f"f{i:02d}": float(i) for i in range(MAX_FIGURES + 5)})
    (beat,) = receiver.drain()
    assert len(beat.figures) == MAX_FIGURES


def test_an_unknown_phase_keeps_the_last_one_and_warns(receiver):
    c = client(receiver)
    c.beat(1, "train")
    with pytest.warns(RuntimeWarning, match="unknown phase 'evaluate'"):
        c.beat(2, "evaluate")
    assert [b.phase for b in receiver.drain()] == ["train", "train"]


def test_a_beat_without_a_phase_is_a_training_beat_from_init_on(receiver):
    c = client(receiver)
    c.beat(1)
    c.beat(2)
    assert [(b.step, b.phase) for b in receiver.drain()] == [(1, "train"), (2, "train")]


def test_a_beat_without_a_phase_keeps_a_phase_declared_before_it(receiver):
    c = client(receiver)
    c.beat(0, "load")
    c.beat(0)
    assert [b.phase for b in receiver.drain()] == ["load", "load"]


def test_a_report_before_training_leaves_the_rank_in_init(receiver):
    c = client(receiver)
    c.report(save_s=0.5)
    c.beat(0, None)
    assert [b.phase for b in receiver.drain()] == ["init", "train"]


def test_a_rank_that_trained_says_it_is_done_when_its_interpreter_exits(receiver):
    code = "from ftsup import runtime; runtime().beat(3)"
    env = {**os.environ, "FTSUP_HEARTBEAT_SOCKET": str(receiver.path), "FTSUP_ATTEMPT": "1"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    assert [(b.step, b.phase) for b in receiver.drain()] == [(3, "train"), (3, "done")]


def test_a_rank_that_never_trained_says_nothing_when_its_interpreter_exits(receiver):
    code = "from ftsup import runtime; runtime().report(save_s=1.0)"
    env = {**os.environ, "FTSUP_HEARTBEAT_SOCKET": str(receiver.path), "FTSUP_ATTEMPT": "1"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    assert [(b.step, b.phase) for b in receiver.drain()] == [(0, "init")]


def test_a_step_that_is_not_a_count_is_dropped_with_a_warning(receiver):
    c = client(receiver)
    with pytest.warns(RuntimeWarning, match="step"):
        c.beat(-5, "train")
    assert (receiver.drain(), c.dropped) == ([], 1)


def test_the_interval_comes_from_the_environment():
    env = RuntimeEnv.from_environ({"FTSUP_HEARTBEAT_SOCKET": "/x", "FTSUP_HEARTBEAT_INTERVAL_S": "0.25"})
    assert env.heartbeat_interval_s == 0.25


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan", "inf"])
def test_an_interval_that_is_not_a_positive_duration_is_an_error(value):
    with pytest.raises(ValueError, match="FTSUP_HEARTBEAT_INTERVAL_S"):
        RuntimeEnv.from_environ({"FTSUP_HEARTBEAT_INTERVAL_S": value})


def test_in_eval_the_client_beats_every_interval_until_the_block_ends(receiver):
    c = client(receiver, interval_s=0.02)
    beats = []

    def eval_beats() -> int:
        beats.extend(receiver.drain())
        return sum(b.phase == "eval" for b in beats) >= 5

    with c.phase("eval", step=4):
        wait_for(eval_beats, 10, "fewer than 5 eval beats")
    keepalives = [t for t in threading.enumerate() if t.name == "ftsup-keepalive"]
    beats += receiver.drain()
    assert (beats[-1].phase, beats[-1].step, keepalives) == ("init", 4, [])


def test_an_eval_phase_with_a_timeout_stops_beating_once_it_has_passed_while_its_block_still_runs(receiver):
    c = client(receiver, interval_s=0.02)

    def keepalive_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "ftsup-keepalive"]

    with pytest.warns(RuntimeWarning, match="phase eval ran past its timeout_s=0.2"), c.phase("eval", timeout_s=0.2):
        started = time.monotonic()
        wait_for(lambda: not keepalive_threads(), 10, "the keepalive thread beats on past the phase's timeout")
        ended_after = time.monotonic() - started
        last_eval = max(b.sent_mono for b in receiver.drain() if b.phase == "eval")
    assert (ended_after >= 0.2, last_eval - started < 0.2 + 0.1) == (True, True)


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("inf"), "soon"])
def test_a_phase_timeout_that_is_not_a_positive_duration_is_an_error(receiver, timeout_s):
    with (
        pytest.raises(ValueError, match="timeout_s must be a positive number"),
        client(receiver).phase("eval", timeout_s=timeout_s),
    ):
        pass


def test_a_report_carries_its_figures_with_the_current_step_and_phase(receiver):
    c = client(receiver)
    c.beat(7, "train")
    c.report(save_s=1.5)
    last = receiver.drain()[-1]
    assert (last.step, last.phase, dict(last.figures)) == (7, "train", {"save_s": 1.5})


def test_a_client_whose_connection_was_closed_reconnects(receiver):
    c = client(receiver)
    c.beat(1, "train")
    receiver.drain(admit=lambda pid: False)  # dropped as foreign: the receiver hangs up
    c.beat(2, "train")
    assert [b.step for b in receiver.drain()] == [2]


def test_a_forked_child_beats_on_a_connection_of_its_own(receiver):
    c = client(receiver)
    c.beat(1, "train")
    pid = os.fork()
    if pid == 0:  # the child: one beat, then leave without running any cleanup of the parent's
        c.beat(2, "train")
        os._exit(0)
    os.waitpid(pid, 0)
    c.beat(3, "train")
    got = sorted((b.step, b.pid) for b in receiver.drain())
    assert got == [(1, os.getpid()), (2, pid), (3, os.getpid())]


# ---------------------------------------------------------------------- the control file and the agreement


def test_without_torch_distributed_an_agreement_returns_at_the_next_wait_what_was_started():
    agreement = Agreement()
    first = agreement.wait()
    agreement.start(Request(3, stop=True, reason="spot"))
    assert (first, agreement.wait(), agreement.wait()) == (NO_REQUEST, Request(3, stop=True, reason="spot"), NO_REQUEST)


def test_an_agreement_refuses_a_second_start_before_the_first_was_waited_for():
    agreement = Agreement()
    agreement.start(Request(1))
    with pytest.raises(RuntimeError, match="in flight"):
        agreement.start(Request(2))


def test_a_request_the_supervisor_wrote_is_read_once_it_changes(tmp_path):
    path = tmp_path / "control.json"
    reader = ControlReader(str(path))
    before = reader.poll()
    path.write_bytes(encode_control(Request(2, stop=True, reason="spot")))
    assert (before, reader.poll()) == (NO_REQUEST, Request(2, stop=True, reason="spot"))


def test_a_control_file_without_a_version_is_refused_with_a_warning_and_never_acted_on(tmp_path):
    path = tmp_path / "control.json"
    path.write_text('{"seq": 1, "action": "save", "stop": true}')
    reader = ControlReader(str(path))
    with pytest.warns(RuntimeWarning, match="refused.*no format version"):
        request = reader.poll()
    assert (request, reader.refused) == (NO_REQUEST, 1)


def test_a_control_file_of_another_version_leaves_the_last_request_in_force(tmp_path):
    path = tmp_path / "control.json"
    path.write_bytes(encode_control(Request(1)))
    reader = ControlReader(str(path))
    first = reader.poll()
    path.write_text(json.dumps({**json.loads(encode_control(Request(2, stop=True))), "v": CONTROL_VERSION + 1}))
    with pytest.warns(RuntimeWarning, match=f"format version {CONTROL_VERSION + 1}"):
        second = reader.poll()
    assert (first, second, reader.poll(), reader.refused) == (Request(1), Request(1), Request(1), 1)


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.mkdir()


def _link_to_a_request(path: Path) -> None:
    (path.parent / "elsewhere.json").write_bytes(encode_control(Request(9, stop=True)))
    path.symlink_to(path.parent / "elsewhere.json")


def _link_to_dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def _huge(path: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(1 << 30)  # sparse: a gibibyte that takes no disk


@pytest.mark.parametrize(
    ("plant", "why"),
    [
        (_fifo, "a FIFO, not a regular file"),
        (_directory, "a directory, not a regular file"),
        (_link_to_a_request, "a symbolic link, never followed, not a regular file"),
        (_link_to_dev_zero, "a symbolic link, never followed, not a regular file"),
        (_huge, f"{1 << 30} bytes, more than the 8192 a request can take"),
    ],
)
def test_a_control_file_that_is_not_a_small_regular_file_is_refused_without_blocking(tmp_path, plant, why):
    path = tmp_path / "control.json"
    path.write_bytes(encode_control(Request(1)))
    reader = ControlReader(str(path))
    first = reader.poll()
    path.unlink()
    plant(path)
    got: list[object] = []
    with pytest.warns(RuntimeWarning) as caught:
        poller = threading.Thread(target=lambda: got.append(reader.poll()), daemon=True)
        poller.start()
        poller.join(timeout=30)  # a read that blocks never returns: the join times out instead
    message = str(caught[0].message)
    assert (first, got, reader.refused, message.endswith(why)) == (Request(1), [Request(1)], 1, True), message


def test_a_device_named_as_the_control_file_is_refused_without_being_read():
    reader = ControlReader("/dev/zero")
    with pytest.warns(RuntimeWarning, match="a device, not a regular file"):
        request = reader.poll()
    assert (request, reader.refused) == (NO_REQUEST, 1)


def test_a_refused_control_file_is_not_opened_again_until_it_changes(tmp_path):
    path = tmp_path / "control.json"
    os.mkfifo(path)
    reader = ControlReader(str(path))
    with pytest.warns(RuntimeWarning):
        reader.poll()
    polls = [reader.poll() for _ in range(3)]
    assert (polls, reader.refused) == ([NO_REQUEST] * 3, 1)


def test_refusals_warn_at_most_once_per_interval(tmp_path):
    now = [0.0]
    path = tmp_path / "control.json"
    reader = ControlReader(str(path), clock=lambda: now[0])
    warned = []
    for t, plant in ((0.0, _fifo), (1.0, _directory), (ControlReader.WARN_EVERY_S + 0.5, _fifo)):
        now[0] = t
        if path.is_dir():
            path.rmdir()
        elif path.exists():
            path.unlink()
        plant(path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reader.poll()
        warned.append(len(caught))
    assert (warned, reader.refused) == ([1, 0, 1], 3)


def test_a_stop_agreed_at_another_nodes_request_is_reported_to_this_nodes_supervisor(receiver, tmp_path, monkeypatch):
    control = tmp_path / "control.json"
    env = RuntimeEnv(
        heartbeat_socket=str(receiver.path), heartbeat_interval_s=0.5, attempt=1, control_file=str(control)
    )
    c = RuntimeClient(env)
    monkeypatch.setattr(runtime, "_client", c)  # the process's client, as `runtime()` makes it
    c.beat(7, "train")
    elsewhere = runtime._agreed(NO_REQUEST, 2, 1)
    control.write_bytes(encode_control(Request(3, stop=True, reason="spot")))  # read by another rank of this node
    own = runtime._agreed(NO_REQUEST, 3, 1)
    figures = [(b.step, dict(b.figures)) for b in receiver.drain()]
    assert (elsewhere.stop, own.stop) == (True, True)
    assert figures == [(7, {}), (7, {"stopped_elsewhere_step": 7.0})]
