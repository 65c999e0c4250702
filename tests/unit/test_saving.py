"""A save in progress by name (ftsup/store/saving.py): the leader's `step-N.staging` marker, removed with any older
one, never a link or folder planted under that name; and what the supervisor's hold reads."""

from __future__ import annotations

import os
from pathlib import Path

from ftsup.store import layout, saving


def test_a_marker_says_a_save_is_in_progress_until_it_is_cleared(tmp_path: Path) -> None:
    (tmp_path / layout.step_dirname(3)).mkdir()
    saving.mark_staging(tmp_path, 4)
    saving.mark_staging(tmp_path, 4)  # there already: left as it is
    (tmp_path / layout.partial_dirname(5)).mkdir()
    assert sorted(saving.in_progress(tmp_path)) == ["step-000000004.staging", "step-000000005.partial"]
    saving.clear_staging(tmp_path, 4)
    assert saving.in_progress(tmp_path) == ["step-000000005.partial"]


def test_clearing_removes_older_markers_and_keeps_newer_ones(tmp_path: Path) -> None:
    for step in (2, 3, 9):
        saving.mark_staging(tmp_path, step)
    saving.clear_staging(tmp_path, 3)
    assert saving.in_progress(tmp_path) == ["step-000000009.staging"]


def test_a_link_or_folder_of_a_marker_name_is_never_removed_nor_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    os.symlink(target, tmp_path / saving.staging_name(1))
    (tmp_path / saving.staging_name(2)).mkdir()
    saving.mark_staging(tmp_path, 1)  # through the link: refused, quietly
    saving.clear_staging(tmp_path, 10)
    assert (target.read_bytes(), os.path.islink(tmp_path / saving.staging_name(1))) == (b"keep", True)
    assert (tmp_path / saving.staging_name(2)).is_dir()


def test_a_folder_that_cannot_be_read_or_written_says_nothing_and_raises_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    saving.mark_staging(missing, 1)
    saving.clear_staging(missing, 1)
    assert (saving.in_progress(missing), missing.exists()) == ([], False)
    assert (saving.parse_staging_name("step-000000001.staging"), saving.parse_staging_name("step-1.staging")) == (
        1,
        None,
    )
