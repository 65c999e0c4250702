"""Reading back what an attempt left in its logs (`ranklogs`): torchrun's report of the failed ranks and each
rank's last lines, as hostile input. The report is torch's own text (`ChildFailedError`, formatted by torch); the
files are laid out as torchrun's `--log-dir` lays them out."""

from __future__ import annotations

import os
import threading
import traceback
from pathlib import Path

import pytest

from ftsup.supervisor.policy.failures import MAX_LINE_CHARS, TAIL_LINES
from ftsup.supervisor.run import ranklogs

RANK_LINES = "[rank1]: out 0\n[rank1]: Traceback (most recent call last):\n[rank1]: ValueError: boom\n"


def torchs_report(*failures: tuple[int, int, int, int]) -> str:
    """What torchrun prints when ranks failed: the traceback of its ChildFailedError, formatted by torch and Python,
    for failures (rank, local rank, pid, exit code), the first one first observed."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    found = {rank: ProcessFailure(local, pid, code, "<N/A>") for rank, local, pid, code in failures}
    for rank, failure in found.items():
        failure.timestamp = 100 if rank == failures[0][0] else 200
    try:
        raise ChildFailedError("train.py", found)
    except ChildFailedError as e:
        return "".join(traceback.format_exception(e))


def rank_dir(ranks: Path, local_rank: int, attempt: int = 0) -> Path:
    path = ranks / "4f341ad5_9qpqn8ng" / f"attempt_{attempt}" / str(local_rank)
    path.mkdir(parents=True)
    return path


def test_torchrun_report_gives_each_failed_rank_its_exit_code_and_marks_the_first(tmp_path: Path) -> None:
    log = tmp_path / "attempt-0001.log"
    log.write_text(RANK_LINES + torchs_report((1, 1, 4242, -9), (0, 0, 4241, -15)))
    found, _ = ranklogs.torchrun_report(log)
    assert sorted((f.rank, f.local_rank, f.pid, f.exitcode, f.root) for f in found) == [
        (0, 0, 4241, -15, False),
        (1, 1, 4242, -9, True),
    ]


@pytest.mark.parametrize("how", ["[rank0]: ", "[rank0]: progress 99%\r"])
def test_a_ranks_lines_that_imitate_torchruns_report_are_never_taken_for_it(tmp_path: Path, how: str) -> None:
    log = tmp_path / "attempt-0001.log"
    forged = "".join(f"{how}{line}\n" for line in torchs_report((3, 3, 1, -11)).splitlines())
    log.write_text(torchs_report((1, 1, 4242, 1)) + forged)
    found, own = ranklogs.torchrun_report(log)
    assert [(f.rank, f.exitcode) for f in found] == [(1, 1)] and not any("rank0" in line for line in own)


def test_a_ranks_last_lines_come_from_its_stderr(tmp_path: Path) -> None:
    d = rank_dir(tmp_path / "attempt-0001", 1)
    (d / "stdout.log").write_text("out 0\n")
    (d / "stderr.log").write_text("err 0\nTraceback (most recent call last):\nValueError: boom\n")
    assert ranklogs.rank_output(tmp_path / "attempt-0001", 1) == [
        "err 0",
        "Traceback (most recent call last):",
        "ValueError: boom",
    ]


def test_the_newest_of_torchruns_attempts_is_read(tmp_path: Path) -> None:
    (rank_dir(tmp_path, 0, attempt=1) / "stderr.log").write_text("second\n")
    (rank_dir(tmp_path / "x", 0, attempt=0) / "stderr.log").write_text("first\n")  # another run dir's
    (tmp_path / "4f341ad5_9qpqn8ng" / "attempt_0" / "0").mkdir(parents=True)
    assert ranklogs.rank_output(tmp_path, 0) == ["second"]


def test_a_large_output_is_read_only_from_its_end(tmp_path: Path) -> None:
    d = rank_dir(tmp_path, 0)
    with open(d / "stderr.log", "w") as f:
        for i in range(400_000):  # ~5 MiB
            f.write(f"line {i}\n")
    assert ranklogs.rank_output(tmp_path, 0) == [f"line {i}" for i in range(400_000 - TAIL_LINES, 400_000)]


def test_control_characters_and_terminal_escapes_are_dropped_and_long_lines_cut(tmp_path: Path) -> None:
    d = rank_dir(tmp_path, 0)
    (d / "stderr.log").write_bytes(b"\x1b[31mred\x1b[0m \x07bell\x00\n" + b"x" * 5000 + b"\n\xff\xfe\n")
    assert ranklogs.rank_output(tmp_path, 0) == ["red bell", "x" * MAX_LINE_CHARS, "\ufffd\ufffd"]


def test_a_progress_bar_shows_as_its_last_state(tmp_path: Path) -> None:
    (rank_dir(tmp_path, 0) / "stderr.log").write_bytes(b"10%|#  |\r50%|## |\r90%|###|\r\nTraceback\r\n")
    assert ranklogs.rank_output(tmp_path, 0) == ["90%|###|", "Traceback"]


def test_a_log_file_planted_as_a_link_is_not_read(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("do not show\n")
    (rank_dir(tmp_path / "ranks", 0) / "stderr.log").symlink_to(secret)
    assert ranklogs.rank_output(tmp_path / "ranks", 0) == []


def test_a_directory_planted_as_a_link_on_the_way_is_not_followed(tmp_path: Path) -> None:
    elsewhere = rank_dir(tmp_path / "elsewhere", 0)
    (elsewhere / "stderr.log").write_text("do not show\n")
    (tmp_path / "ranks" / "4f341ad5_9qpqn8ng").mkdir(parents=True)
    (tmp_path / "ranks" / "4f341ad5_9qpqn8ng" / "attempt_0").symlink_to(elsewhere.parent)
    assert ranklogs.rank_output(tmp_path / "ranks", 0) == []


def test_a_fifo_in_place_of_a_log_is_not_read_and_does_not_block(tmp_path: Path) -> None:
    d = rank_dir(tmp_path, 0)
    os.mkfifo(d / "stderr.log")
    got: list[list[str]] = []
    reader = threading.Thread(target=lambda: got.append(ranklogs.rank_output(tmp_path, 0)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert got == [[]]


@pytest.mark.parametrize("line", ["  exitcode  : 99999 (pid: 1)", "  exitcode  : -9 (pid: 99999999999)"])
def test_a_report_with_numbers_out_of_range_names_no_rank(tmp_path: Path, line: str) -> None:
    log = tmp_path / "attempt-0001.log"
    report = "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n"
    log.write_text(f"torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n{report}{line}\n")
    assert ranklogs.torchrun_report(log)[0] == []
