"""`ftsup chaos --config`: a job of one's own run in the work directory (`ftsup.tools.faults.configjob`)."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from ftsup.supervisor.config.job import load_config, parse_config
from ftsup.tools.faults.configjob import ConfigJob, sample_logs


def own_job(tmp_path: Path) -> ConfigJob:
    (tmp_path / "job").mkdir()
    cfg = {
        "job": {"command": [sys.executable, "-c", "pass"], "run_id": "mine", "state_dir": "state"},
        "checkpoint": {"dir": "ckpt"},
        "logging": {"dir": "logs"},
    }
    (tmp_path / "job" / "job.yaml").write_text(yaml.safe_dump(cfg))
    base = load_config(tmp_path / "job" / "job.yaml").to_dict()
    return ConfigJob(
        tmp_path / "chaos" / "main", "chaos-main-1", 0, base_config=base, sections={"restart": {"max_restarts": 42}}
    )


def test_the_job_runs_with_the_chaos_runs_id_state_store_and_logs(tmp_path):
    job = own_job(tmp_path)
    cfg = parse_config(job.config(), base_dir=tmp_path)
    got = (cfg.job.run_id, cfg.launch.rdzv_id, cfg.job.state_dir, cfg.checkpoint.dir, cfg.logging.dir)
    assert got == ("chaos-main-1", "chaos-main-1", job.state_dir, job.ckpt_dir, job.log_dir)


def test_the_jobs_own_paths_stay_resolved_against_its_config_file(tmp_path):
    cfg = parse_config(own_job(tmp_path).config(), base_dir=tmp_path / "elsewhere")
    assert cfg.job.workdir == tmp_path / "job"


def test_the_chaos_runs_sections_go_on_top_of_the_jobs(tmp_path):
    assert parse_config(own_job(tmp_path).config(), base_dir=tmp_path).restart.max_restarts == 42


def test_a_sample_log_pattern_finds_each_ranks_file_and_nothing_else(tmp_path):
    for name in ("s-0.jsonl", "s-1.jsonl", "s-x.jsonl", "s-1.jsonl.bak"):
        (tmp_path / name).write_text("")
    (tmp_path / "s-2.jsonl").symlink_to(tmp_path / "s-0.jsonl")
    assert sample_logs(str(tmp_path / "s-{rank}.jsonl")) == [(0, tmp_path / "s-0.jsonl"), (1, tmp_path / "s-1.jsonl")]


def test_collect_moves_the_jobs_logs_into_its_directory(tmp_path):
    (tmp_path / "loss.jsonl").write_text("{}\n")
    (tmp_path / "s-1.jsonl").write_text("{}\n")
    job = ConfigJob(
        tmp_path / "run", "r", 0, user_loss_log=tmp_path / "loss.jsonl", sample_pattern=str(tmp_path / "s-{rank}.jsonl")
    )
    job.root.mkdir()
    job.collect()
    assert sorted(p.name for p in job.root.iterdir()) == ["loss.jsonl", "samples-1.jsonl"]
