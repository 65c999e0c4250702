"""This node's files in the state directory read back as hostile input: the quarantine journal, the operator's clear
requests and the view of its last checks; and what a health command prints, read capped."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from ftsup.supervisor.policy import nodes
from ftsup.supervisor.run import capped
from ftsup.supervisor.state import nodes as nodefiles
from ftsup.supervisor.state.nodes import ClearRequest, NodeFileError, View
from tests.procs import wait_for

BOOK = nodes.Book(
    entries=(
        nodes.Entry("node", (100.0, 150.5), None, "rank 0 was killed by SIGKILL", 1),
        nodes.Entry("slot:3", (150.5,), 4000.0, "rank 3 exited 1", 0),
    ),
    served=("c1ea7c1ea7c1ea7c",),
)


def journal(tmp_path: Path, body: object) -> Path:
    path = tmp_path / nodefiles.QUARANTINE
    path.write_text(json.dumps(body))
    return path


def good() -> dict:
    return json.loads(nodefiles.encode(BOOK, "node-a", 200.0))


def test_a_journal_reads_back_as_written(tmp_path: Path) -> None:
    nodefiles.write(tmp_path / nodefiles.QUARANTINE, BOOK, "node-a", 200.0)
    assert nodefiles.read(tmp_path / nodefiles.QUARANTINE) == BOOK


def test_no_journal_is_no_quarantine(tmp_path: Path) -> None:
    assert nodefiles.read(tmp_path / nodefiles.QUARANTINE) is None


def test_a_journal_through_a_link_is_refused_and_its_target_left_alone(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_bytes(nodefiles.encode(BOOK, "node-a", 200.0))
    (tmp_path / nodefiles.QUARANTINE).symlink_to(target)
    with pytest.raises(NodeFileError, match="symbolic link"):
        nodefiles.read(tmp_path / nodefiles.QUARANTINE)
    assert target.read_bytes() == nodefiles.encode(BOOK, "node-a", 200.0)


def test_a_fifo_for_a_journal_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / nodefiles.QUARANTINE)
    with pytest.raises(NodeFileError, match="not a regular file"):
        nodefiles.read(tmp_path / nodefiles.QUARANTINE)


def test_a_journal_past_its_cap_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / nodefiles.QUARANTINE
    with open(path, "wb") as f:
        f.truncate(nodefiles.MAX_QUARANTINE_BYTES + 1)
    with pytest.raises(NodeFileError, match="more than the"):
        nodefiles.read(path)


@pytest.mark.parametrize(
    ("change", "wrong"),
    [
        (lambda b: b.update(v=2), "version 1"),
        (lambda b: b.update(extra=1), "unknown field 'extra'"),
        (lambda b: b.update(node_id="../x"), "'node_id'"),
        (lambda b: b.update(served=["not hex"]), "'served'"),
        (lambda b: b["entries"][0].update(target="slot:99999"), "'target'"),
        (lambda b: b["entries"][0].update(target="nodes"), "'target'"),
        (lambda b: b["entries"][0].update(faults=[float("inf")]), "'faults'"),
        (lambda b: b["entries"][0].update(faults=[1.0] * (nodes.MAX_FAULTS + 1)), "'faults'"),
        (lambda b: b["entries"][0].update(until=True), "'until'"),
        (lambda b: b["entries"][0].update(reason="a\x1b[2Jb"), "'reason'"),
        (lambda b: b["entries"][0].update(quarantines=-1), "'quarantines'"),
        (lambda b: b["entries"].append(dict(b["entries"][0])), "listed twice"),
    ],
)
def test_a_journal_off_its_schema_is_refused_naming_what_is_wrong(tmp_path: Path, change, wrong: str) -> None:
    body = good()
    change(body)
    path = journal(tmp_path, body)
    with pytest.raises(NodeFileError) as e:
        nodefiles.read(path)
    assert str(e.value).startswith(str(path)) and wrong in str(e.value)


def test_a_journal_of_deep_nesting_is_refused_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / nodefiles.QUARANTINE
    path.write_text('{"v": 1, "entries": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(NodeFileError, match="not JSON"):
        nodefiles.read(path)


def test_the_largest_book_the_policy_keeps_fits_the_cap() -> None:
    entries = tuple(
        nodes.Entry(nodes.NODE if i == 0 else f"slot:{i - 1}", tuple(1e9 + j / 7 for j in range(nodes.MAX_FAULTS)))
        for i in range(nodes.MAX_TARGETS)
    )
    served = tuple(f"{i:016x}" for i in range(nodes.MAX_SERVED))
    longest = "x" * nodefiles.MAX_TEXT
    book = nodes.Book(tuple(e.__class__(e.target, e.faults, 1e9, longest, 7) for e in entries), served)
    assert len(nodefiles.encode(book, "n" * 64, 1e9)) <= nodefiles.MAX_QUARANTINE_BYTES


def test_a_clear_request_reads_back_as_written(tmp_path: Path) -> None:
    req = ClearRequest("0123456789abcdef", (0, 3), "ops@host pid 1", 1700000000.5)
    (tmp_path / nodefiles.CLEAR).write_bytes(req.encode())
    assert nodefiles.read_clear(tmp_path / nodefiles.CLEAR) == req


@pytest.mark.parametrize(
    ("body", "wrong"),
    [
        ({}, "version 1"),
        ({"v": 1, "id": "xyz", "slots": None, "who": "", "requested_unix": 1.0}, "'id'"),
        ({"v": 1, "id": "abcd", "slots": [-1], "who": "", "requested_unix": 1.0}, "'slots'"),
        ({"v": 1, "id": "abcd", "slots": [], "who": "", "requested_unix": 1.0}, "'slots'"),
        ({"v": 1, "id": "abcd", "slots": None, "who": "\n", "requested_unix": 1.0}, "'who'"),
        ({"v": 1, "id": "abcd", "slots": None, "who": "", "requested_unix": "now"}, "'requested_unix'"),
        ({"v": 1, "id": "abcd", "slots": None, "who": "", "requested_unix": 1.0, "all": True}, "unknown field"),
    ],
)
def test_a_clear_request_off_its_schema_is_refused(tmp_path: Path, body: dict, wrong: str) -> None:
    path = tmp_path / nodefiles.CLEAR
    path.write_text(json.dumps(body))
    with pytest.raises(NodeFileError) as e:
        nodefiles.read_clear(path)
    assert str(e.value).startswith(str(path)) and wrong in str(e.value)


def test_a_clear_request_through_a_link_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real.json"
    real.write_bytes(ClearRequest("abcd", None, "", 1.0).encode())
    (tmp_path / nodefiles.CLEAR).symlink_to(real)
    with pytest.raises(NodeFileError, match="symbolic link"):
        nodefiles.read_clear(tmp_path / nodefiles.CLEAR)


def test_a_view_reads_back_with_its_text_made_printable(tmp_path: Path) -> None:
    verdict = nodes.verdict(
        [nodes.Check("command", "failed", "exited 1: \x1b[31mbad\x1b[0m"), nodes.Check("gpus", "skipped")]
    )
    view = View("node-a", 100.0, verdict, "node checks failed", 130.0, "waiting")
    (tmp_path / nodefiles.VIEW).write_bytes(view.encode())
    back = nodefiles.read_view(tmp_path / nodefiles.VIEW)
    assert back is not None
    assert (back.verdict.healthy, back.verdict.checks[0].detail, back.standby) == (
        False,
        "exited 1: [31mbad[0m",
        "waiting",
    )


@pytest.mark.parametrize(
    ("key", "value"),
    [("healthy", "yes"), ("standby", "maybe"), ("checks", [{"check": "rm -rf", "result": "ok", "detail": ""}])],
)
def test_a_view_off_its_schema_is_refused(tmp_path: Path, key: str, value: object) -> None:
    body = json.loads(View("node-a", None, nodes.Verdict(None, ()), None, None, None).encode())
    body[key] = value
    (tmp_path / nodefiles.VIEW).write_text(json.dumps(body))
    with pytest.raises(NodeFileError, match=key):
        nodefiles.read_view(tmp_path / nodefiles.VIEW)


# ---------------------------------------------------------------------- a command's output, capped


def test_a_flood_of_output_is_kept_to_the_cap_and_the_command_still_ends() -> None:
    flood = "import sys; sys.stdout.write('x' * 5_000_000); sys.stderr.write('e' * 300_000); sys.exit(4)"
    ran = capped.run([sys.executable, "-c", flood], 30, max_bytes=1000)
    assert (ran.code, len(ran.out), len(ran.err), ran.out[:3]) == (4, 1000, 1000, b"xxx")


def test_a_command_past_its_deadline_is_stopped_with_what_it_started(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pidfile)!r}, 'w').write(str(c.pid)); print('started', flush=True); time.sleep(60)"
    )
    ran = capped.run([sys.executable, "-c", script], 2.0)
    assert (ran.code, ran.out, "did not finish within 2s" in (ran.why or "")) == (None, b"started\n", True)
    child = int(pidfile.read_text())
    wait_for(lambda: not _alive(child), 10, "the command's child outlived the check")


def test_a_command_that_cannot_start_exits_127_saying_why() -> None:
    ran = capped.run(["/nonexistent/health-check"], 5)
    assert (ran.code, b"No such file or directory" in ran.err) == (127, True)


def test_a_quote_is_one_printable_line_of_at_most_the_limit() -> None:
    said = capped.quote(b"\n\n\x1b[2J" + "é".encode() * 500 + b"\xff\nsecond line", limit=20)
    assert said == '"[2J' + "é" * 17 + '..."'


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
