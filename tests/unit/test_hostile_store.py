"""Hostile checkpoint stores, torch-free: whatever is planted in the store (links out of it, FIFOs
and devices where files belong, huge or deeply nested manifests, names ftsup never writes, a
newer format) is never used, never blocks or crashes a reader, and never makes ftsup read or
write outside the store: through `layout`, the resume choice and `ftsup ckpt list/verify`."""

from __future__ import annotations

import json
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from ftsup.store import checksums, choice, layout, safefile
from ftsup.store.errors import CheckpointCorruptError, ManifestError
from ftsup.supervisor.cli.commands import main
from tests.helpers import default_files, make_fake_checkpoint, write_manifest_json

T = TypeVar("T")


def finishes(fn: Callable[[], T], within_s: float = 10.0) -> T:
    """fn() run in a thread; fails (leaving the thread to whatever blocked it) if it does not
    return within `within_s`."""
    out: list[Any] = []

    def target() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as e:  # handed to the test's thread
            out.append(("raised", e))

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(within_s)
    assert not t.is_alive(), f"blocked for over {within_s}s"
    kind, value = out[0]
    if kind == "raised":
        raise value
    return value  # type: ignore[no-any-return]


def unblock_fifo(path: Path) -> None:
    """Let a reader blocked in open() of the FIFO `path` go (it gets end of file)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # no reader waiting


def as_another_user(fn: Callable[[], Any]) -> Any:
    """fn() in a forked child running as `nobody` (root reads everything), its result as JSON."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no exec, so nothing needs to be readable to nobody but the store
        try:
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            os.write(w, json.dumps({"ok": fn()}).encode())
        except BaseException as e:
            os.write(w, json.dumps({"error": repr(e)}).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        raw = f.read()
    os.waitpid(pid, 0)
    got = json.loads(raw)
    assert "error" not in got, got["error"]
    return got["ok"]


@pytest.fixture()
def store(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    make_fake_checkpoint(root, 100, default_files(1))
    return root


def planted(root: Path, step: int = 200) -> Path:
    """A newer checkpoint directory whose manifest the test replaces."""
    return make_fake_checkpoint(root, step, default_files(2))


def newest_usable(root: Path) -> int | None:
    info = layout.latest_consistent(root)
    return info.step if info else None


# --------------------------------------------------------------------------- manifests


def test_a_fifo_manifest_is_refused_without_blocking(store: Path) -> None:
    ckpt = planted(store)
    (ckpt / layout.MANIFEST_NAME).unlink()
    os.mkfifo(ckpt / layout.MANIFEST_NAME)
    try:
        with pytest.raises(ManifestError, match="not a regular file .a FIFO."):
            finishes(lambda: layout.read_manifest(ckpt))
        assert finishes(lambda: newest_usable(store)) == 100
    finally:
        unblock_fifo(ckpt / layout.MANIFEST_NAME)


def test_a_device_manifest_is_refused_without_reading_it(store: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    ckpt = planted(store)
    (ckpt / layout.MANIFEST_NAME).unlink()
    os.mknod(ckpt / layout.MANIFEST_NAME, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers
    with pytest.raises(ManifestError, match="a character device"):
        finishes(lambda: layout.read_manifest(ckpt))


def test_a_manifest_symlinked_from_outside_the_store_is_refused(store: Path, tmp_path: Path) -> None:
    elsewhere = make_fake_checkpoint(tmp_path / "elsewhere", 200, default_files(2))
    ckpt = planted(store)
    (ckpt / layout.MANIFEST_NAME).unlink()
    (ckpt / layout.MANIFEST_NAME).symlink_to(elsewhere / layout.MANIFEST_NAME)
    with pytest.raises(ManifestError, match="symbolic link"):
        layout.read_manifest(ckpt)
    assert newest_usable(store) == 100


def test_a_huge_sparse_manifest_is_refused_before_it_is_read(store: Path) -> None:
    ckpt = planted(store)
    os.truncate(ckpt / layout.MANIFEST_NAME, 1 << 40)  # a terabyte of zeros, on no disk
    t0 = time.monotonic()
    with pytest.raises(ManifestError, match="over the 67108864-byte limit"):
        layout.read_manifest(ckpt)
    assert time.monotonic() - t0 < 1.0


def test_a_deeply_nested_manifest_is_a_problem_not_a_recursion_error(store: Path) -> None:
    ckpt = planted(store)
    (ckpt / layout.MANIFEST_NAME).write_bytes(b'{"metadata": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    info = layout.inspect_checkpoint(ckpt)
    assert (info.consistent, "nested deeper than 128 levels" in str(info.problems[0])) == (False, True)


def test_a_manifest_of_too_many_values_is_refused_before_it_is_decoded() -> None:
    raw = b"[" + b"0," * (layout.MANIFEST_MAX_VALUES + 1) + b"0]"
    with pytest.raises(ManifestError, match="over the limit"):
        layout.parse_manifest(raw)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "1e400"])
def test_a_manifest_time_that_is_not_a_number_is_refused(store: Path, value: str) -> None:
    ckpt = planted(store)
    text = (ckpt / layout.MANIFEST_NAME).read_text()
    obj = json.loads(text)
    (ckpt / layout.MANIFEST_NAME).write_text(text.replace(json.dumps(obj["created_unix"]), value, 1))
    assert layout.inspect_checkpoint(ckpt).consistent is False


def test_a_manifest_whose_metadata_step_differs_is_inconsistent(store: Path) -> None:
    """A checkpoint copied under another step, its manifest edited to match the new name."""
    src = make_fake_checkpoint(store, 150, default_files(3), metadata={"step": 150, "samples": 1800})
    dst = store / layout.step_dirname(999_999_999_999)
    src.rename(dst)
    obj = json.loads((dst / layout.MANIFEST_NAME).read_text())
    write_manifest_json(dst, dict(obj, step=999_999_999_999))
    info = layout.inspect_checkpoint(dst)
    assert (info.consistent, "its metadata says step 150" in str(info.problems[0])) == (False, True)
    assert newest_usable(store) == 100


# --------------------------------------------------------------------------- files in a checkpoint


def test_a_fifo_in_place_of_a_shard_fails_the_deep_check_without_blocking(store: Path) -> None:
    ckpt = planted(store)
    shard = ckpt / "shard-00001.safetensors"
    shard.unlink()
    os.mkfifo(shard)
    try:
        _, problems = finishes(lambda: layout.check_checkpoint(ckpt, deep=True))
        assert [(p.file, p.reason) for p in problems] == [("shard-00001.safetensors", "not a regular file")]
    finally:
        unblock_fifo(shard)


def test_a_small_file_read_through_the_manifest_must_be_a_regular_file_of_the_recorded_size(
    store: Path, tmp_path: Path
) -> None:
    ckpt = store / layout.step_dirname(100)
    manifest = layout.read_manifest(ckpt)
    rel = "rank-00000/state.json"
    assert layout.read_verified(ckpt, manifest, rel, 1024) == b'{"rank": 0}'
    (tmp_path / "outside.json").write_bytes(b'{"rank": 0}')
    (ckpt / rel).unlink()
    (ckpt / rel).symlink_to(tmp_path / "outside.json")  # escapes the checkpoint
    with pytest.raises(CheckpointCorruptError, match="outside the checkpoint"):
        layout.read_verified(ckpt, manifest, rel, 1024)
    (ckpt / rel).unlink()
    (ckpt / rel).write_bytes(b'{"rank": 00}')  # one byte more than recorded
    with pytest.raises(CheckpointCorruptError, match="size 12 != recorded 11"):
        layout.read_verified(ckpt, manifest, rel, 1024)


def test_json_depth_and_constants_are_checked_before_decoding() -> None:
    assert safefile.loads(b'{"a": "[[[[", "b": [1, "]\\\\\\""]}', "x") == {"a": "[[[[", "b": [1, ']\\"']}
    with pytest.raises(CheckpointCorruptError, match="nested deeper"):
        safefile.loads(b"[" * 129 + b"]" * 129, "x")
    with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
        safefile.loads(b'{"a": NaN}', "x")


def test_json_prechecks_stay_linear_on_unterminated_strings() -> None:
    t0 = time.monotonic()
    with pytest.raises(CheckpointCorruptError):
        safefile.loads(b'\\"' * (4 << 20), "x")  # a quadratic string scan would take minutes
    assert time.monotonic() - t0 < 5.0


# --------------------------------------------------------------------------- names


def test_a_step_name_of_more_than_18_digits_is_not_a_checkpoint(store: Path) -> None:
    (store / ("step-" + "9" * 250)).mkdir()
    (store / ("step-" + "9" * 19)).mkdir()
    assert [s for s, _ in layout.committed_dirs(store)] == [100]


def test_a_symlink_named_like_a_checkpoint_is_never_one(store: Path, tmp_path: Path) -> None:
    elsewhere = make_fake_checkpoint(tmp_path / "elsewhere", 200, default_files(2))
    (store / layout.step_dirname(200)).symlink_to(elsewhere)
    assert [s for s, _ in layout.committed_dirs(store)] == [100]
    with pytest.raises(Exception, match="no committed checkpoint for step 200"):
        layout.find_checkpoint(store, 200)


def test_quarantine_renames_the_directory_found_not_one_named_from_its_step(store: Path) -> None:
    odd = planted(store, 8).rename(store / "step-0000000008")  # 10 digits
    (odd / "shard-00000.safetensors").write_bytes(b"torn")
    picked = choice.choose(store)
    assert picked.info is not None and picked.info.step == 100
    assert [(p.action, Path(p.moved_to or "").name) for p in picked.passed] == []  # older than 100: not tried
    moved = layout.quarantine(odd)
    assert moved.name == "step-0000000008.corrupt" and not odd.exists()


# --------------------------------------------------------------------------- the resume choice


def _newer_format(root: Path, step: int = 200) -> Path:
    ckpt = planted(root, step)
    obj = json.loads((ckpt / layout.MANIFEST_NAME).read_text())
    write_manifest_json(ckpt, dict(obj, format_version=layout.FORMAT_VERSION + 1))
    return ckpt


def test_a_checkpoint_of_a_newer_format_is_skipped_and_never_renamed(store: Path) -> None:
    ckpt = _newer_format(store)
    picked = choice.choose(store)
    assert picked.info is not None and picked.info.step == 100
    assert [(p.step, p.action) for p in picked.passed] == [(200, choice.SKIPPED)]
    assert "upgrade ftsup" in picked.passed[0].reason and ckpt.is_dir()


def test_a_broken_newest_checkpoint_is_quarantined_by_its_own_name(store: Path) -> None:
    ckpt = planted(store)
    (ckpt / "shard-00000.safetensors").write_bytes(b"torn")
    picked = choice.choose(store)
    assert picked.info is not None and picked.info.step == 100
    assert [(p.action, Path(p.moved_to or "").name) for p in picked.passed] == [
        (choice.QUARANTINED, "step-000000200.corrupt")
    ]


def test_a_broken_checkpoint_that_cannot_be_renamed_is_skipped_not_fatal() -> None:
    if os.geteuid() != 0:
        pytest.skip("choosing as another user needs root")
    with tempfile.TemporaryDirectory() as top:  # under /tmp: every parent is open to `nobody`
        os.chmod(top, 0o755)
        store = Path(top) / "ckpt"
        make_fake_checkpoint(store, 100, default_files(1))
        ckpt = planted(store)
        (ckpt / "shard-00000.safetensors").write_bytes(b"torn")
        for p in (store, *store.rglob("*")):
            os.chmod(p, 0o755 if p.is_dir() else 0o644)  # readable, not writable, to `nobody`

        def pick() -> list[Any]:
            picked = choice.choose(store)
            return [picked.info.step if picked.info else None, [p.action for p in picked.passed]]

        assert as_another_user(pick) == [100, [choice.SKIPPED]]
        assert ckpt.is_dir()


def test_every_unusable_checkpoint_is_reported_when_none_is_left(tmp_path: Path) -> None:
    a = make_fake_checkpoint(tmp_path, 100, default_files(1))
    (a / layout.MANIFEST_NAME).write_bytes(b"{")
    _newer_format(tmp_path, 200)
    picked = choice.choose(tmp_path)
    assert picked.info is None
    assert [(p.step, p.action) for p in picked.passed] == [(200, choice.SKIPPED), (100, choice.QUARANTINED)]


# --------------------------------------------------------------------------- ftsup ckpt


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = finishes(lambda: main(list(argv)))
    out, _ = capsys.readouterr()
    return code, out


def test_ckpt_list_and_verify_do_not_block_on_a_fifo_manifest(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = planted(store)
    (ckpt / layout.MANIFEST_NAME).unlink()
    os.mkfifo(ckpt / layout.MANIFEST_NAME)
    try:
        code, out = run_cli(capsys, "ckpt", "list", str(store), "--json")
        assert (code, [c["consistent"] for c in json.loads(out)["checkpoints"]]) == (0, [True, False])
        code, out = run_cli(capsys, "ckpt", "verify", str(store), "--deep", "--json")
        assert (code, json.loads(out)["consistent"]) == (1, False)
    finally:
        unblock_fifo(ckpt / layout.MANIFEST_NAME)


def test_ckpt_list_marks_a_newer_format_and_names_what_is_not_a_checkpoint(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _newer_format(store)
    (store / layout.step_dirname(300)).symlink_to(tmp_path)
    (store / ("step-" + "9" * 30)).mkdir()
    code, out = run_cli(capsys, "ckpt", "list", str(store), "--json")
    assert [(c["step"], c["unknown_format"]) for c in json.loads(out)["checkpoints"]] == [(100, False), (200, True)]
    code, out = run_cli(capsys, "ckpt", "list", str(store))
    assert f"not a checkpoint: {layout.step_dirname(300)} (a symbolic link)" in out
    assert "not a checkpoint: step-999999999999999999999999999999 (not a name ftsup writes)" in out


def test_an_unreadable_checkpoint_is_reported_and_the_listing_goes_on() -> None:
    if os.geteuid() != 0:
        pytest.skip("reading as another user needs root")
    with tempfile.TemporaryDirectory() as top:  # under /tmp: every parent is open to `nobody`
        os.chmod(top, 0o755)
        _unreadable_checkpoint_is_listed(Path(top) / "ckpt")


def _unreadable_checkpoint_is_listed(store: Path) -> None:
    make_fake_checkpoint(store, 100, default_files(1))
    ckpt = planted(store)
    for p in (store, *store.rglob("*")):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    os.chmod(ckpt, 0o700)  # readable to its owner only
    rows = as_another_user(lambda: [i.to_json() for i in layout.list_checkpoints(store)])
    assert [(r["step"], r["consistent"]) for r in rows] == [(100, True), (200, False)]
    assert "permission denied" in rows[1]["problems"][0]


def test_checksums_of_a_shard_are_read_only_from_a_regular_file(store: Path) -> None:
    ckpt = store / layout.step_dirname(100)
    path = ckpt / "shard-00000.safetensors"
    assert checksums.file_checksum(path) == layout.read_manifest(ckpt).files["shard-00000.safetensors"].checksum
    path.unlink()
    path.symlink_to(ckpt / "shard-00001.safetensors")
    with pytest.raises(CheckpointCorruptError, match="symbolic link"):
        checksums.file_checksum(path)


def test_a_manifest_that_lists_no_files_is_not_a_checkpoint(store: Path) -> None:
    ckpt = planted(store, 999_999_999_999)
    write_manifest_json(ckpt, dict(json.loads((ckpt / layout.MANIFEST_NAME).read_text()), files={}))
    assert (layout.inspect_checkpoint(ckpt).consistent, newest_usable(store)) == (False, 100)
