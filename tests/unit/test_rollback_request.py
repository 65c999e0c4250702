"""An operator's rollback request from `ftsup rollback` to the daemon: the data-skip ranges and the request's schema
(`ftsup.protocol`) against hostile input, the file as the daemon's loop polls it (`rollbacks`), the command that
writes it (`cli_rollback`)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from ftsup.protocol import RollbackRequest, encode_rollback, parse_rollback
from ftsup.supervisor.cli import commands as cli
from ftsup.supervisor.policy import machine as policy
from ftsup.supervisor.policy.anomaly import merge_skips
from ftsup.supervisor.state.rollbacks import FILE_NAME, RollbackWatcher
from tests.helpers import default_files, make_fake_checkpoint

REQ = RollbackRequest("0123abcd0123abcd", 40, ((480, 528),), "ops@node1 pid 7", "loss spike", 1_700_000_000.0)


# ---------------------------------------------------------------------- data skips


def test_the_union_of_skips_joins_overlapping_and_touching_ranges():
    assert merge_skips(((0, 12), (40, 50)), ((12, 20), (45, 60), (100, 101))) == ((0, 20), (40, 60), (100, 101))


# ---------------------------------------------------------------------- the request's schema


def test_a_request_encodes_to_what_parses_back():
    assert parse_rollback(encode_rollback(REQ)) == REQ


def hostile() -> list[bytes]:
    good = json.loads(encode_rollback(REQ))
    variants: list[object] = [
        {**good, "v": 2},
        {**good, "v": True},
        {**good, "extra": 1},
        {k: v for k, v in good.items() if k != "who"},
        {**good, "id": "ZZZZZZZZ"},
        {**good, "id": "ab"},
        {**good, "id": 1234},
        {**good, "to_step": -1},
        {**good, "to_step": "40"},
        {**good, "to_step": 10**13},
        {**good, "to_step": 4.0},
        {**good, "skips": [[5, 1]]},
        {**good, "skips": "480:528"},
        {**good, "who": None},
        {**good, "reason": "x" * 5000},
        {**good, "reason": "a\nfake log line"},
        {**good, "requested_unix": None},
        [good],
        "rollback",
    ]
    raw = [json.dumps(v).encode() for v in variants]
    return [*raw, b"", b"\xff\xfe", b"[" * 100_000, b'{"v": 1, "v": 1}', b" " * 20_000, b'{"v": NaN}']


@pytest.mark.parametrize("raw", hostile())
def test_a_hostile_request_is_refused_with_a_reason(raw: bytes):
    with pytest.raises(ValueError, match=r"\w"):
        parse_rollback(raw)


# ---------------------------------------------------------------------- the daemon's poll


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0  # every poll is past the poll interval
        return self.t


def watcher(tmp_path: Path) -> tuple[RollbackWatcher, list[tuple[str, dict[str, object]]]]:
    logged: list[tuple[str, dict[str, object]]] = []
    return RollbackWatcher(tmp_path, clock=Clock(), emit=lambda level, ev, **f: logged.append((ev, f))), logged


def test_a_request_in_the_state_directory_is_the_policy_s_event(tmp_path: Path):
    (tmp_path / FILE_NAME).write_bytes(encode_rollback(REQ))
    w, _ = watcher(tmp_path)
    assert w.poll() == [policy.RollbackRequested(REQ.id, 40, ((480, 528),), REQ.who, REQ.reason)]


def test_an_unchanged_request_file_is_read_once(tmp_path: Path):
    (tmp_path / FILE_NAME).write_bytes(encode_rollback(REQ))
    w, _ = watcher(tmp_path)
    assert (len(w.poll()), w.poll(), w.poll()) == (1, [], [])


def test_no_request_file_is_no_request(tmp_path: Path):
    w, logged = watcher(tmp_path)
    assert (w.poll(), logged) == ([], [])


def test_a_bad_request_file_is_logged_once_and_never_acted_on(tmp_path: Path):
    (tmp_path / FILE_NAME).write_bytes(b'{"v": 1, "to_step": "soon"}')
    w, logged = watcher(tmp_path)
    events = w.poll() + w.poll() + w.poll()
    assert (events, [e for e, _ in logged]) == ([], ["rollback_request_ignored"])


def test_a_request_file_that_is_a_link_is_refused(tmp_path: Path):
    (tmp_path / "elsewhere.json").write_bytes(encode_rollback(REQ))
    (tmp_path / FILE_NAME).symlink_to(tmp_path / "elsewhere.json")
    w, logged = watcher(tmp_path)
    assert (w.poll(), "symbolic link" in str(logged[0][1]["reason"])) == ([], True)


def test_a_request_file_that_is_a_fifo_never_blocks_the_loop(tmp_path: Path):
    os.mkfifo(tmp_path / FILE_NAME)
    w, logged = watcher(tmp_path)
    assert (w.poll(), [e for e, _ in logged]) == ([], ["rollback_request_ignored"])


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user takes root")
def test_a_request_file_of_another_user_is_refused(tmp_path: Path):
    (tmp_path / FILE_NAME).write_bytes(encode_rollback(REQ))
    os.chown(tmp_path / FILE_NAME, 65534, 65534)
    w, logged = watcher(tmp_path)
    assert (w.poll(), "owned by uid 65534" in str(logged[0][1]["reason"])) == ([], True)


def test_a_request_file_replaced_by_a_new_request_is_read_again(tmp_path: Path):
    (tmp_path / FILE_NAME).write_bytes(encode_rollback(REQ))
    w, _ = watcher(tmp_path)
    w.poll()
    (tmp_path / FILE_NAME).write_bytes(encode_rollback(RollbackRequest("feedfacefeedface", 20)))
    assert [e.id for e in w.poll() if isinstance(e, policy.RollbackRequested)] == ["feedfacefeedface"]


# ---------------------------------------------------------------------- ftsup rollback


def job(tmp_path: Path) -> Path:
    for step in (20, 40):
        make_fake_checkpoint(tmp_path / "ckpt", step, default_files(step))
    cfg = tmp_path / "job.yaml"
    raw = {
        "job": {"command": ["true"], "state_dir": str(tmp_path / "state")},
        "checkpoint": {"dir": str(tmp_path / "ckpt")},
    }
    cfg.write_text(json.dumps(raw))
    return cfg


def test_ftsup_rollback_writes_the_request_for_the_next_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    request = ["--to-step", "20", "--skip-samples", "240:288", "--reason", "bad shard"]
    code = cli.main(["rollback", "--config", str(job(tmp_path)), *request])
    req = parse_rollback((tmp_path / "state" / FILE_NAME).read_bytes())
    assert (code, req.to_step, req.skips, req.reason, "next `ftsup run`" in capsys.readouterr().out) == (
        0,
        20,
        ((240, 288),),
        "bad shard",
        True,
    )


def test_ftsup_rollback_writes_a_file_only_its_user_reads(tmp_path: Path):
    cli.main(["rollback", "--config", str(job(tmp_path)), "--to-step", "40"])
    assert stat.S_IMODE((tmp_path / "state" / FILE_NAME).stat().st_mode) == 0o600


def test_ftsup_rollback_names_who_asked(tmp_path: Path):
    cli.main(["rollback", "--config", str(job(tmp_path)), "--to-step", "40"])
    assert f"pid {os.getpid()}" in parse_rollback((tmp_path / "state" / FILE_NAME).read_bytes()).who


def test_ftsup_rollback_to_a_step_without_a_checkpoint_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    code = cli.main(["rollback", "--config", str(job(tmp_path)), "--to-step", "30"])
    assert (code, "step 30" in capsys.readouterr().err, (tmp_path / "state" / FILE_NAME).exists()) == (2, True, False)


def test_ftsup_rollback_to_a_broken_checkpoint_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    cfg = job(tmp_path)
    (tmp_path / "ckpt" / "step-000000020" / "shard-00000.safetensors").write_bytes(b"torn")
    code = cli.main(["rollback", "--config", str(cfg), "--to-step", "20"])
    assert (code, "not a consistent checkpoint" in capsys.readouterr().err) == (2, True)


def test_ftsup_rollback_with_a_bad_skip_is_refused_naming_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    code = cli.main(["rollback", "--config", str(job(tmp_path)), "--to-step", "20", "--skip-samples", "9:3"])
    assert (code, "--skip-samples" in capsys.readouterr().err) == (2, True)
