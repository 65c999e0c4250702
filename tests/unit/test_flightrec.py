"""NCCL's flight recorder for the ranks (`run.flightrec`): its settings given to the ranks unless the job made its own
choice, a rank asked for its dump through its pipe, and a dump copied into the incident only when it is a file of
ours. (A real NCCL dump needs CUDA: tests/gpu/test_cuda_flight_recorder.py.)"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ftsup.supervisor.run import flightrec
from ftsup.supervisor.state.incidents import Store, new_id

ID = new_id("hang", 1, 1_800_000_000.0)


def test_the_ranks_get_the_newer_names_of_every_setting_the_job_does_not_set(tmp_path: Path):
    env = flightrec.rank_env(tmp_path, 3, {"PATH": "/bin"})
    stem = str(tmp_path / "nccl" / "a0003-rank_")
    assert env == {
        "TORCH_FR_BUFFER_SIZE": flightrec.BUFFER_ENTRIES,
        "TORCH_FR_DUMP_TEMP_FILE": stem,
        "TORCH_FR_DEBUG_INFO_PIPE_FILE": stem,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    assert oct((tmp_path / "nccl").stat().st_mode & 0o777) == "0o700"


def test_a_setting_the_job_gives_under_either_name_is_its_own_and_ftsup_sets_none_of_its_group(tmp_path: Path):
    env = flightrec.rank_env(
        tmp_path, 1, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x"}
    )
    assert sorted(env) == ["TORCH_FR_DEBUG_INFO_PIPE_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT"]


def test_dumps_of_attempts_long_gone_are_removed_at_a_launch(tmp_path: Path):
    flightrec.rank_env(tmp_path, 1, {})
    for attempt in (1, 2, 3):
        (tmp_path / "nccl" / f"a{attempt:04d}-rank_0").write_bytes(b"dump")
    flightrec.rank_env(tmp_path, 4, {})
    assert sorted(os.listdir(tmp_path / "nccl")) == ["a0002-rank_0", "a0003-rank_0"]


def test_a_rank_is_asked_for_its_dump_through_its_pipe_and_one_without_a_reader_is_not(tmp_path: Path):
    stem = tmp_path / "a0001-rank_"
    os.mkfifo(f"{stem}0.pipe")
    os.mkfifo(f"{stem}1.pipe")  # no reader: the rank is gone
    reader = os.open(f"{stem}0.pipe", os.O_RDONLY | os.O_NONBLOCK)  # as torch holds it
    try:
        asked = flightrec.poke(stem, [0, 1, 2])
        assert (asked, os.read(reader, 16)) == ([0], b"1")
    finally:
        os.close(reader)


def test_a_dump_present_is_copied_beside_the_record_and_a_link_in_its_place_is_refused(tmp_path: Path):
    stem = tmp_path / "nccl" / "a0001-rank_"
    stem.parent.mkdir()
    Path(f"{stem}0").write_bytes(b"\x80pickled flight record")
    (tmp_path / "secret").write_bytes(b"not the job's")
    Path(f"{stem}1").symlink_to(tmp_path / "secret")
    store = Store(tmp_path / "state")
    store.ensure()
    dumps, problems = flightrec.collect(stem, [0, 1], [], time.monotonic() + 1, time.monotonic, store, ID)
    assert ([(d.rank, d.bytes) for d in dumps], store.dump_path(ID, 0).read_bytes()) == (
        [(0, 22)],
        b"\x80pickled flight record",
    )
    assert len(problems) == 1 and problems[0].startswith("rank 1's NCCL dump:")


def test_a_dump_asked_for_and_never_written_is_waited_for_only_until_the_bound(tmp_path: Path):
    store = Store(tmp_path / "state")
    store.ensure()
    t0 = time.monotonic()
    dumps, problems = flightrec.collect(tmp_path / "a0001-rank_", [0], [0], t0 + 0.3, time.monotonic, store, ID)
    assert (dumps, problems, time.monotonic() - t0 < 1.0) == (
        [],
        ["rank 0's NCCL dump: asked for, not written within the bound"],
        True,
    )
