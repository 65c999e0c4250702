"""The ranks' output echoed on the supervisor's stdout (`run.echo`): whole lines only, from where the attempt's
output begins, under the lock the supervisor's own console lines take; a reader gone ends the echo, not the
supervisor. Driven through a pipe in place of stdout."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftsup.supervisor.run.echo import Echo, size_of
from ftsup.supervisor.telemetry.logs import OUTPUT_LOCK
from tests.procs import wait_for


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


def drain(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 20)
    except BlockingIOError:
        return b""


def test_only_whole_lines_written_after_the_attempts_start_are_copied(tmp_path: Path, pipe: tuple[int, int]) -> None:
    log = tmp_path / "attempt-0002.log"
    log.write_bytes(b"an earlier attempt's line\n")
    echo = Echo(log, size_of(log), out=pipe[1], poll_s=0.01)
    got = b""
    try:
        with log.open("ab") as f:
            f.write(b"[rank0]: step 1\n[rank1]: half a li")
            f.flush()
            got += wait_for(lambda: drain(pipe[0]), 10, "the first line was never echoed")
            f.write(b"ne\n")
            f.flush()
            got += wait_for(lambda: drain(pipe[0]), 10, "the rest of the second line was never echoed")
    finally:
        echo.close()
    assert got == b"[rank0]: step 1\n[rank1]: half a line\n"


def test_a_last_line_without_its_end_is_written_at_close_with_one(tmp_path: Path, pipe: tuple[int, int]) -> None:
    log = tmp_path / "attempt-0001.log"
    echo = Echo(log, 0, out=pipe[1], poll_s=0.01)
    log.write_bytes(b"torchrun's line\n[rank0]: killed mid-li")
    echo.close()
    assert drain(pipe[0]) == b"torchrun's line\n[rank0]: killed mid-li\n"


def test_no_line_is_written_while_the_supervisor_writes_its_own(tmp_path: Path, pipe: tuple[int, int]) -> None:
    log = tmp_path / "attempt-0001.log"
    echo = Echo(log, 0, out=pipe[1], poll_s=0.01)
    try:
        with OUTPUT_LOCK:
            log.write_bytes(b"[rank0]: hello\n")
            wait_for(lambda: echo._offset > 0, 10, "the log was never read")
            held = drain(pipe[0])
        assert (held, wait_for(lambda: drain(pipe[0]), 10, "never echoed once the lock was free")) == (
            b"",
            b"[rank0]: hello\n",
        )
    finally:
        echo.close()


def test_a_reader_gone_ends_the_echo_and_close_returns(tmp_path: Path, pipe: tuple[int, int]) -> None:
    log = tmp_path / "attempt-0001.log"
    os.close(pipe[0])
    echo = Echo(log, 0, out=pipe[1], poll_s=0.01)
    log.write_bytes(b"[rank0]: nobody reads this\n")
    wait_for(lambda: echo._broken, 10, "a write to a closed pipe never ended the echo")
    echo.close()


def test_a_link_in_place_of_the_log_is_never_read(tmp_path: Path, pipe: tuple[int, int]) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"not the job's\n")
    (tmp_path / "attempt-0001.log").symlink_to(secret)
    echo = Echo(tmp_path / "attempt-0001.log", 0, out=pipe[1], poll_s=0.01)
    echo.close()
    assert (drain(pipe[0]), size_of(tmp_path / "attempt-0001.log")) == (b"", 0)
