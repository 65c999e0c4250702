"""The state directory and its files: checked before they are trusted, never opened through a link."""

from __future__ import annotations

import configparser
import json
import os
import threading
from pathlib import Path

import pytest

from ftsup.supervisor import statedir
from ftsup.supervisor.errors import ConfigError, UsageError
from ftsup.supervisor.state.journal import Journal, JournalError, JournalRecord

OTHER_UID = 65534  # nobody

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def test_a_created_state_dir_is_private(tmp_path):
    path = statedir.ensure_dir(tmp_path / "a" / "b", "job.state_dir")
    assert [oct(os.stat(p).st_mode & 0o777) for p in (path.parent, path)] == ["0o700", "0o700"]


def test_a_created_ftsup_dir_tells_git_to_ignore_it(tmp_path):
    statedir.ensure_dir(tmp_path / ".ftsup" / "node", "job.state_dir")
    assert (tmp_path / ".ftsup" / ".gitignore").read_text().splitlines()[-1] == "*"


@needs_root
def test_a_state_dir_owned_by_another_user_is_refused_naming_the_key_and_the_owner(tmp_path):
    (tmp_path / "state").mkdir(mode=0o700)
    os.chown(tmp_path / "state", OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=rf"^job.state_dir: .*state is owned by uid {OTHER_UID}"):
        statedir.ensure_dir(tmp_path / "state", "job.state_dir")


def test_a_state_dir_writable_by_others_is_refused(tmp_path):
    (tmp_path / "state").mkdir()
    os.chmod(tmp_path / "state", 0o777)
    with pytest.raises(ConfigError, match="is writable by others"):
        statedir.ensure_dir(tmp_path / "state", "job.state_dir")


def test_a_state_dir_that_is_a_link_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "state").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="is not a directory"):
        statedir.ensure_dir(tmp_path / "state", "job.state_dir")


def test_a_state_dir_in_a_directory_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # not sticky: anyone could rename our directory away and put theirs there
    with pytest.raises(ConfigError, match="another user owns or can write"):
        statedir.ensure_dir(shared / "state", "job.state_dir")


def test_a_state_dir_further_below_a_directory_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # the job dir of a team: whoever can write it can rename .ftsup away
    with pytest.raises(ConfigError, match=f"is below {shared}, which another user owns or can write"):
        statedir.ensure_dir(shared / ".ftsup" / "n1", "job.state_dir")
    assert list(shared.iterdir()) == []  # nothing created there


def test_a_state_dir_reached_through_a_link_in_a_directory_others_can_write_is_refused(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "job").symlink_to(tmp_path / "real")
    os.chmod(shared, 0o777)  # anyone could point the link elsewhere
    with pytest.raises(ConfigError, match="another user owns or can write"):
        statedir.ensure_dir(shared / "job" / "state", "job.state_dir")


def test_appending_never_goes_through_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    (tmp_path / "log").symlink_to(victim)
    with pytest.raises(OSError):
        statedir.open_append(tmp_path / "log")
    assert victim.read_text() == "keep\n"


def test_appending_to_a_file_with_another_hard_link_is_refused(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    os.link(victim, tmp_path / "log")
    with pytest.raises(OSError, match="other hard links"):
        statedir.open_append(tmp_path / "log")


def test_appending_to_a_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "log")
    with pytest.raises(OSError):
        statedir.open_append(tmp_path / "log")


def test_reading_a_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "journal.json")
    with pytest.raises(OSError, match="not a regular file"):
        statedir.read_private(tmp_path / "journal.json", 100)


def test_reading_a_file_larger_than_the_cap_is_refused(tmp_path):
    (tmp_path / "journal.json").write_bytes(b"x" * 101)
    with pytest.raises(OSError, match="more than the 100 allowed"):
        statedir.read_private(tmp_path / "journal.json", 100)


@pytest.mark.parametrize("text", ["null", "[]", '"text"', "{"])
def test_a_state_file_holding_no_json_object_is_refused_never_read_as_missing(tmp_path, text):
    path = tmp_path / "ranks.json"
    path.write_text(text)
    with pytest.raises(UsageError, match="ranks.json: not (JSON|a JSON object)"):
        statedir.read_json(path, 100, UsageError, dict)


def test_a_value_error_of_the_parser_is_the_files_error_naming_it(tmp_path):
    path = tmp_path / "journal.json"
    path.write_text("{}")

    def parse(body):
        raise ValueError("'goodput' is not a record")

    with pytest.raises(UsageError, match=r"journal.json: 'goodput' is not a record"):
        statedir.read_json(path, 100, UsageError, parse)


def test_a_missing_state_file_reads_as_none(tmp_path):
    assert statedir.read_json(tmp_path / "ranks.json", 100, UsageError, dict) is None


def test_an_atomic_write_replaces_a_planted_link_instead_of_writing_through_it(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "control.json").symlink_to(victim)
    statedir.write_atomic(tmp_path / "control.json", b"{}")
    assert (victim.read_text(), (tmp_path / "control.json").is_symlink(), (tmp_path / "control.json").read_text()) == (
        "keep",
        False,
        "{}",
    )


def test_a_second_instance_lock_is_refused_naming_the_holders_pid(tmp_path):
    first = statedir.InstanceLock(tmp_path)
    try:
        with pytest.raises(UsageError, match=rf"another ftsup run \(pid {os.getpid()}\)"):
            statedir.InstanceLock(tmp_path)
    finally:
        first.close()
    statedir.InstanceLock(tmp_path).close()  # released with its holder


def test_the_instance_lock_is_never_taken_through_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / statedir.LOCK_NAME).symlink_to(victim)
    with pytest.raises(OSError):
        statedir.InstanceLock(tmp_path)
    assert victim.read_text() == "keep"


def test_a_runtime_directory_given_by_systemd_is_used_and_left_in_place(tmp_path):
    given = tmp_path / "rt"
    given.mkdir(mode=0o700)
    rt = statedir.RuntimeDir.make(tmp_path / "state", {"RUNTIME_DIRECTORY": str(given)})
    rt.control.write_text("{}")
    rt.remove()
    assert (rt.path, given.exists(), list(given.iterdir())) == (given, True, [])


def record(**over: object) -> dict[str, object]:
    base = JournalRecord(run_id="r", node_id="n", supervisor_pid=10, attempt=2, pids=(11, 12)).to_json()
    return {**base, **over}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("pids", ["11"]),
        ("pids", [True]),
        ("attempt", -1),
        ("attempt", "2"),
        ("status", "x"),
        ("run_id", 7),
        ("updated_unix", float("inf")),
        ("extra", []),
    ],
)
def test_a_journal_with_a_bad_field_is_refused_naming_it(tmp_path, field, value):
    (tmp_path / "journal.json").write_text(json.dumps(record(**{field: value})))
    with pytest.raises(JournalError, match=repr(field)):
        Journal(tmp_path / "journal.json").read()


def test_a_journal_that_is_a_link_is_refused(tmp_path):
    (tmp_path / "elsewhere.json").write_text(json.dumps(record()))
    (tmp_path / "journal.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(JournalError):
        Journal(tmp_path / "journal.json").read()


def test_a_journal_round_trips(tmp_path):
    rec = JournalRecord(run_id="r", node_id="n", supervisor_pid=10, attempt=2, pids=(11, 12), status="running")
    Journal(tmp_path / "journal.json").write(rec)
    assert Journal(tmp_path / "journal.json").read(owner=os.geteuid()) == rec


def test_reading_a_journal_that_is_a_fifo_returns_at_once(tmp_path):
    os.mkfifo(tmp_path / "journal.json")
    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(_read_error(tmp_path / "journal.json")), daemon=True)
    t.start()
    t.join(timeout=5)
    assert result and isinstance(result[0], JournalError)


def _read_error(path: Path) -> object:
    try:
        return Journal(path).read()
    except JournalError as e:
        return e


def parsed_state_dir(tmp_path: Path, config_path: Path, monkeypatch: pytest.MonkeyPatch, **env: str) -> Path:
    from ftsup.supervisor.config.job import parse_config

    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    doc = {"job": {"command": ["true"]}, "checkpoint": {"dir": str(tmp_path / "ckpt")}, "launch": {"node_id": "n1"}}
    return parse_config(doc, base_dir=config_path.parent, config_path=config_path).job.state_dir


def test_the_default_state_dir_is_under_the_workdir_outside_systemd(tmp_path, monkeypatch):
    assert parsed_state_dir(tmp_path, tmp_path / "job.yaml", monkeypatch) == tmp_path / ".ftsup" / "n1"


def test_the_default_state_dir_is_systemds_state_directory_inside_a_unit(tmp_path, monkeypatch):
    got = parsed_state_dir(tmp_path, tmp_path / "job.yaml", monkeypatch, STATE_DIRECTORY=str(tmp_path / "sd"))
    assert got == tmp_path / "sd"


def test_a_config_of_the_shipped_unit_finds_its_state_directory_from_a_shell(tmp_path, monkeypatch):
    # `ftsup status --config /etc/ftsup/gpt.yaml` run by hand, where no STATE_DIRECTORY is set.
    assert parsed_state_dir(tmp_path, Path("/etc/ftsup/gpt.yaml"), monkeypatch) == Path("/var/lib/ftsup/gpt")


def test_the_shipped_units_state_directory_is_where_its_configs_keep_their_state():
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read_string((Path(__file__).resolve().parents[2] / "deploy" / "systemd" / "ftsup@.service").read_text())
    svc = parser["Service"]
    config = svc["ExecStart"].split("--config ")[1].replace("%i", "job1")
    got = (svc["StateDirectory"], svc["RuntimeDirectory"], svc["StateDirectoryMode"], svc["RuntimeDirectoryMode"])
    assert got == ("ftsup/%i", "ftsup/%i", "0700", "0700")
    default = statedir.default_state_dir(Path("/w"), "n1", Path(config), {})
    assert default == Path("/var/lib") / svc["StateDirectory"].replace("%i", "job1")
