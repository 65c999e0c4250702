"""Incident records (`state.incidents`) and `ftsup incidents` reading them: written within a size cap, the oldest
beyond `forensics.keep` deleted with their dumps, and every record read back as hostile input: a link, a huge file,
bad JSON or a wrong schema is one line saying what is wrong, and the listing goes on."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ftsup.supervisor.cli.commands import main
from ftsup.supervisor.policy.stacks import Thread
from ftsup.supervisor.state import incidents
from ftsup.supervisor.state.incidents import Incident, IncidentError, RankEvidence, Store


def record(n: int = 0, *, frames: int = 3, ranks: int = 2, trigger: str = "hang") -> Incident:
    wall = 1_800_000_000.0 + n
    threads = (Thread("python", 100, True, tuple(f"f{i} (/job/{'pkg/' * 5}train.py:{i})" for i in range(frames))),)
    return Incident(
        id=incidents.new_id(trigger, 1, wall),
        trigger=trigger,
        event="heartbeat_timed_out",
        created_unix=wall,
        run_id="job",
        node_id="node",
        attempt=1,
        reason="rank 1 stopped (SIGSTOP/state T), silent for 2.1s (timeout 2.0s); rank 0 waiting",
        step=30,
        culprit=1,
        culprit_why="stopped (SIGSTOP/state T)",
        blamed=1,
        duration_s=0.4,
        timeout_s=3.0,
        ranks=tuple(
            RankEvidence(r, r, 100 + r, "S", "futex_do_wait", threads, "pystack", (), True, 30, "train", wall - 2.1)
            for r in range(ranks)
        ),
    )


def test_a_record_reads_back_as_it_was_written(tmp_path: Path):
    store = Store(tmp_path)
    written = record()
    store.write(written, keep=10)
    assert store.read(written.id) == written


def test_a_record_of_huge_stacks_is_cut_to_its_cap_keeping_the_innermost_frames(tmp_path: Path):
    huge = record(frames=128, ranks=1000)  # about 3 KiB of frames a rank
    data = incidents.encode(huge)
    back = incidents.parse(json.loads(data))
    main_frames = back.ranks[0].threads[0].frames
    assert (len(data) <= incidents.MAX_BYTES, main_frames[-1], back.ranks[0].threads[0].cut) == (
        True,
        "f127 (/job/pkg/pkg/pkg/pkg/pkg/train.py:127)",
        True,
    )


def test_the_oldest_records_beyond_keep_are_deleted_with_their_dumps_and_strangers_are_left(tmp_path: Path):
    store = Store(tmp_path)
    written = [record(n) for n in range(5)]
    store.ensure()
    (store.dir / "notes.txt").write_text("mine")
    store.dump_path(written[0].id, 1).write_bytes(b"dump")
    for r in written:
        store.write(r, keep=3)
    left = sorted(os.listdir(store.dir))
    assert left == sorted([f"{r.id}.json" for r in written[2:]] + ["notes.txt"])


def test_an_id_that_is_not_one_never_becomes_a_path(tmp_path: Path):
    with pytest.raises(IncidentError, match="is not an incident id"):
        Store(tmp_path).read("../../etc/passwd")


def hostile_dir(tmp_path: Path) -> tuple[Store, Incident, list[str]]:
    """A good record among a link, a huge file, bad JSON, a wrong schema and a record under another's name."""
    store = Store(tmp_path)
    good = record(9)
    store.write(good, keep=100)
    ids = [incidents.new_id("hang", 1, 1_800_000_000.0 + n) for n in range(5)]
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps(good.to_json()))
    (store.dir / f"{ids[0]}.json").symlink_to(outside)
    (store.dir / f"{ids[1]}.json").write_bytes(b" " * (incidents.MAX_BYTES + 1))
    (store.dir / f"{ids[2]}.json").write_text("{not json")
    (store.dir / f"{ids[3]}.json").write_text(json.dumps({**good.to_json(), "id": ids[3], "ranks": "all"}))
    (store.dir / f"{ids[4]}.json").write_text(json.dumps(good.to_json()))  # good's content, not its name
    return store, good, ids


def test_hostile_records_are_each_one_line_and_the_good_one_is_still_listed(tmp_path: Path):
    store, good, ids = hostile_dir(tmp_path)
    found, problems = store.read_all()
    said = sorted(p.split(": ", 1)[1] for p in problems)
    assert ([i.id for i in found], len(problems)) == ([good.id], 5)
    assert said == sorted(
        [
            "is a symbolic link; refused; skipped",
            f"is {incidents.MAX_BYTES + 1} bytes, more than the {incidents.MAX_BYTES} allowed; refused; skipped",
            "not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); skipped",
            "the record: 'ranks' must be a list of at most 4096 items, got 'all'; skipped",
            f"'id' {good.id!r} is not this record's name; skipped",
        ]
    )


def test_ftsup_incidents_lists_the_good_record_and_says_what_is_wrong_with_each_other(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    store, good, _ = hostile_dir(tmp_path / "state")
    config = tmp_path / "job.yaml"
    config.write_text(f"job:\n  command: [python, train.py]\n  state_dir: {tmp_path / 'state'}\n")
    code = main(["incidents", "--config", str(config), "--json"])
    out, err = capsys.readouterr()
    listed = json.loads(out)
    assert (code, [i["id"] for i in listed["incidents"]], len(listed["problems"]), len(err.splitlines())) == (
        0,
        [good.id],
        5,
        5,
    )


def test_ftsup_incidents_show_prints_the_culprit_and_groups_ranks_with_the_same_stack(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    store = Store(tmp_path / "state")
    written = record(ranks=3)
    store.write(written, keep=10)
    config = tmp_path / "job.yaml"
    config.write_text(f"job:\n  command: [python, train.py]\n  state_dir: {tmp_path / 'state'}\n")
    code = main(["incidents", "show", written.id, "--config", str(config)])
    out = capsys.readouterr().out.splitlines()
    assert (code, out[2], [ln for ln in out if ln.startswith("ranks ")]) == (
        0,
        "  culprit: rank 1: stopped (SIGSTOP/state T)",
        ["ranks 0-2: state S (futex_do_wait); inside a collective"],
    )


def test_ftsup_incidents_show_of_a_record_that_is_a_link_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    store, _, ids = hostile_dir(tmp_path / "state")
    config = tmp_path / "job.yaml"
    config.write_text(f"job:\n  command: [python, train.py]\n  state_dir: {tmp_path / 'state'}\n")
    code = main(["incidents", "show", ids[0], "--config", str(config)])
    err = capsys.readouterr().err
    assert (code, err.endswith("is a symbolic link; refused\n"), len(err.splitlines())) == (2, True, 1)
