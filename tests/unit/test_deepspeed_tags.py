"""`ftsup.trainer.deepspeed.tags`: a DeepSpeed tag is whole only when every rank's files are there and whole; the
newest whole tag is chosen, and what was passed over is said. Tags laid out as DeepSpeed's save_checkpoint lays them
out (its file names and keys), written with torch.save."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ftsup.store.errors import CheckpointError
from ftsup.trainer.deepspeed import tags


def write_tag(save_dir: Path, name: str, *, stage: int = 2, ranks: int = 2, steps: int = 3) -> Path:
    tag = save_dir / name
    tag.mkdir(parents=True)
    model = {"module": {"w": torch.zeros(4)}, "dp_world_size": ranks, "global_steps": steps, "buffer_names": []}
    for r in range(ranks):
        optim = {"optimizer_state_dict": {"zero_stage": stage, "partition_count": [ranks]}}
        torch.save(optim, tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        if stage == 3:
            torch.save(model, tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
    if stage < 3:
        torch.save(model, tag / "mp_rank_00_model_states.pt")
    (save_dir / "latest").write_text(name)
    return tag


@pytest.mark.parametrize("stage", [2, 3])
def test_a_whole_tag_says_its_stage_ranks_and_step(tmp_path, stage):
    got = tags.check_tag(write_tag(tmp_path, "global_step3", stage=stage, ranks=3))
    assert (got.zero_stage, got.dp_world_size, got.global_steps, len(got.optim_files)) == (stage, 3, 3, 3)


@pytest.mark.parametrize(
    "cut, message",
    [
        ("zero_pp_rank_1_mp_rank_00_optim_states.pt", "the file of dp rank 1 is missing"),
        ("zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt is missing"),
        ("mp_rank_00_model_states.pt", "no \\*_model_states.pt"),
    ],
)
def test_a_tag_missing_a_file_is_not_whole(tmp_path, cut, message):
    tag = write_tag(tmp_path, "global_step3")
    (tag / cut).unlink()
    with pytest.raises(CheckpointError, match=message):
        tags.check_tag(tag)


def test_a_zero3_tag_missing_a_ranks_model_states_is_not_whole(tmp_path):
    tag = write_tag(tmp_path, "global_step3", stage=3)
    (tag / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match="the ZeRO-3 model states of dp rank 1 are missing"):
        tags.check_tag(tag)


def test_a_file_cut_short_is_named(tmp_path):
    tag = write_tag(tmp_path, "global_step3")
    f = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    os.truncate(f, f.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt: not a whole"):
        tags.check_tag(tag)


def test_a_torn_latest_is_passed_over_for_the_newest_whole_numbered_tag(tmp_path):
    write_tag(tmp_path, "global_step3", steps=3)
    write_tag(tmp_path, "global_step6", steps=6)
    torn = write_tag(tmp_path, "global_step9", steps=9)
    (torn / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    got, passed = tags.newest_whole(tmp_path)
    assert (got and got.global_steps, [p.tag for p in passed]) == (6, ["global_step9"])


def test_an_empty_latest_is_passed_over(tmp_path):
    write_tag(tmp_path, "global_step3")
    (tmp_path / "latest").write_text("")
    got, passed = tags.newest_whole(tmp_path)
    assert (got and got.path.name, [p.tag for p in passed]) == ("global_step3", ["latest"])


def test_no_whole_tag_is_none(tmp_path):
    (write_tag(tmp_path, "global_step3") / "mp_rank_00_model_states.pt").unlink()
    assert tags.newest_whole(tmp_path)[0] is None
