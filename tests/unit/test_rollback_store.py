"""A rollback carried out: the resume choice bounded to a step, the checkpoints after it abandoned (renamed, kept),
the ranks' environment (data skips, retention's history), and what the journal, `ftsup status` and the metrics keep
and show of it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from ftsup import protocol
from ftsup.protocol import Phase
from ftsup.store import choice, layout
from ftsup.supervisor.cli import commands as cli
from ftsup.supervisor.config.job import parse_config
from ftsup.supervisor.policy import anomaly as policy_anomaly
from ftsup.supervisor.policy import detectors
from ftsup.supervisor.policy import machine as policy
from ftsup.supervisor.run import launcher
from ftsup.supervisor.state.ckptstore import StoreScanner
from ftsup.supervisor.state.journal import Journal, JournalError, JournalRecord
from ftsup.supervisor.telemetry.metrics import Metrics
from tests.helpers import default_files, make_fake_checkpoint
from tests.settings import DEFAULTS, settings


def store(root: Path, *steps: int) -> Path:
    for step in steps:
        make_fake_checkpoint(root, step, default_files(step), metadata={"step": step, "samples": 12 * step})
    return root


# ---------------------------------------------------------------------- the bounded choice


def test_a_bounded_choice_resumes_from_the_newest_checkpoint_up_to_the_bound(tmp_path: Path):
    resume = StoreScanner(store(tmp_path, 20, 40, 60)).choose(5, at_most=45)
    assert (resume.picked.info.step if resume.picked.info else None, resume.metadata["samples"]) == (40, 480)


def test_a_bounded_choice_abandons_the_checkpoints_after_the_one_chosen_and_keeps_them(tmp_path: Path):
    StoreScanner(store(tmp_path, 20, 40, 60)).choose(5, at_most=45)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert (names, [s for s, _ in layout.committed_dirs(tmp_path)]) == (
        ["step-000000020", "step-000000040", "step-000000060.abandoned"],
        [20, 40],
    )


def test_an_abandoned_checkpoint_keeps_every_file(tmp_path: Path):
    StoreScanner(store(tmp_path, 20, 60)).choose(5, at_most=30)
    assert layout.inspect_checkpoint(tmp_path / "step-000000060.abandoned").problems == ()


def test_a_choice_without_a_bound_abandons_nothing(tmp_path: Path):
    resume = StoreScanner(store(tmp_path, 20, 40)).choose(5)
    assert (resume.abandoned, [s for s, _ in layout.committed_dirs(tmp_path)]) == ((), [20, 40])


def test_a_bound_before_every_checkpoint_abandons_them_all_and_starts_fresh(tmp_path: Path):
    resume = StoreScanner(store(tmp_path, 20, 40)).choose(5, at_most=10)
    assert (resume.picked.info, len(resume.abandoned), layout.committed_dirs(tmp_path)) == (None, 2, [])


def test_a_step_abandoned_twice_keeps_both(tmp_path: Path):
    store(tmp_path, 20, 40)
    choice.abandon(tmp_path, 20, "first")
    store(tmp_path, 40)
    choice.abandon(tmp_path, 20, "second")
    assert sorted(p.name for p in tmp_path.iterdir() if "abandoned" in p.name) == [
        "step-000000040.abandoned",
        "step-000000040.abandoned.1",
    ]


def test_ftsup_ckpt_list_shows_an_abandoned_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    StoreScanner(store(tmp_path, 20, 40)).choose(5, at_most=30)
    cli.main(["ckpt", "list", str(tmp_path)])
    assert "abandoned by a rollback: step-000000040.abandoned" in capsys.readouterr().out


# ---------------------------------------------------------------------- the ranks' environment


def env(skips: tuple[tuple[int, int], ...], base: dict[str, str] | None = None, **anomaly: Any) -> dict[str, str]:
    raw = {"job": {"command": ["true"]}, "anomaly": anomaly}
    cfg = parse_config(raw, base_dir=Path("/job"), hostname="n")
    return launcher.rank_env(cfg, Path("/run"), 40, base or {}, skips)


def test_the_ranks_are_told_the_skips_in_force():
    assert env(((0, 12), (480, 528)))[protocol.DATA_SKIPS_ENV] == "0:12,480:528"


def test_skips_given_from_outside_are_kept_beside_the_supervisor_s():
    given = {protocol.DATA_SKIPS_ENV: "100:200"}
    assert env(((480, 528),), given)[protocol.DATA_SKIPS_ENV] == "100:200,480:528"


def test_a_bad_skips_value_given_from_outside_gives_way_to_the_supervisor_s():
    assert env(((480, 528),), {protocol.DATA_SKIPS_ENV: "soon"})[protocol.DATA_SKIPS_ENV] == "480:528"


def test_no_skips_leave_the_variable_as_given():
    assert protocol.DATA_SKIPS_ENV not in env(())


def test_retention_keeps_the_detection_window_s_history():
    assert env((), detection_window_steps=250)[protocol.KEEP_OLDER_THAN_STEPS_ENV] == "250"


def test_with_the_detectors_off_retention_keeps_no_extra_history():
    assert protocol.KEEP_OLDER_THAN_STEPS_ENV not in env((), enabled=False)


# ---------------------------------------------------------------------- the journal, status, metrics

INCIDENT = {
    "kind": "loss_spike",
    "step": 44,
    "onset_step": 41,
    "value": 9.0,
    "rollback_to": 40,
    "skips": [[480, 528]],
    "reason": "loss spike at step 44",
    "resumed_from": 20,
}


def record(**fields: Any) -> JournalRecord:
    defaults: dict[str, Any] = {"run_id": "r", "node_id": "n", "supervisor_pid": os.getpid(), "status": "running"}
    return JournalRecord(**{**defaults, "updated_unix": time.time(), **fields})


def test_the_journal_keeps_skips_requests_served_the_incident_and_stragglers(tmp_path: Path):
    rec = record(skips=((480, 528),), rollbacks_served=("00c0ffee",), incident=INCIDENT, stragglers=(1,))
    Journal(tmp_path / "journal.json").write(rec)
    assert Journal(tmp_path / "journal.json").read() == rec


@pytest.mark.parametrize(
    "field, value",
    [
        ("skips", [[5, 1]]),
        ("skips", "0:12"),
        ("rollbacks_served", [1]),
        ("rollbacks_served", ["a"] * 65),
        ("incident", []),
        ("incident", {"reason": "x" * 9000}),
        ("stragglers", [True]),
    ],
)
def test_a_journal_with_a_bad_field_is_refused_naming_it(tmp_path: Path, field: str, value: object):
    raw = record().to_json() | {field: value}
    (tmp_path / "journal.json").write_text(json.dumps(raw))
    with pytest.raises(JournalError, match=f"'{field}'"):
        Journal(tmp_path / "journal.json").read()


def job(tmp: Path, rec: JournalRecord) -> Path:
    (tmp / "state").mkdir(mode=0o700)
    Journal(tmp / "state" / "journal.json").write(rec)
    cfg = tmp / "job.yaml"
    raw = {
        "job": {"command": ["true"], "state_dir": str(tmp / "state"), "run_id": "r"},
        "checkpoint": {"dir": str(tmp / "ckpt")},
    }
    cfg.write_text(json.dumps(raw))
    return cfg


SHOWN = ("last incident", "stragglers", "data skips in force")


def test_ftsup_status_shows_the_last_incident_stragglers_and_skips(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    cfg = job(tmp_path, record(skips=((480, 528),), incident=INCIDENT, stragglers=(1,)))
    cli.main(["status", "--config", str(cfg)])
    out = capsys.readouterr().out
    assert [line.strip() for line in out.splitlines() if line.split(":")[0].strip() in SHOWN] == [
        "last incident: loss spike at step 44 (onset step 41), rolled back to step 20, skipping data "
        "positions [480, 528)",
        "stragglers: rank 1 (slow, not stopped)",
        "data skips in force: [480, 528)",
    ]


def test_ftsup_status_json_gives_the_last_incident(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    cfg = job(tmp_path, record(incident=INCIDENT))
    cli.main(["status", "--config", str(cfg), "--json"])
    assert json.loads(capsys.readouterr().out)["last_incident"] == INCIDENT


def sample(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_the_metrics_count_anomalies_rollbacks_skipped_samples_and_escalations():
    m = Metrics("r", "n", started_unix=0)
    m.event("anomaly_detected", {"kind": "loss_spike"})
    m.event("rollback_started", {"trigger": "auto"})
    m.event("rollback_started", {"trigger": "operator"})
    m.event("data_skipped", {"samples": 48})
    m.event("anomaly_escalated", {"reason": "again"})
    counted = (
        sample(m, "ftsup_anomalies_total", kind="loss_spike"),
        sample(m, "ftsup_anomalies_total", kind="nonfinite"),
        sample(m, "ftsup_rollbacks_total", trigger="auto"),
        sample(m, "ftsup_rollbacks_total", trigger="operator"),
        sample(m, "ftsup_skipped_samples_total"),
        sample(m, "ftsup_anomaly_escalations_total"),
    )
    assert counted == (1.0, 0.0, 1.0, 1.0, 48.0, 1.0)


def test_the_metrics_give_each_rank_s_step_time_ratio_and_the_stragglers():
    h = detectors.Health()
    for step in range(1, 21):
        for r, t in ((0, 0.1), (1, 0.1), (2, 0.3)):
            beat = policy.Heartbeat(1, r, step, Phase.TRAIN, rank=r, figures=(("step_s", t),))
            h, _ = detectors.observe(DEFAULTS.anomaly, h, beat)
    m = Metrics("r", "n", started_unix=0)
    st = policy.State(anomaly=policy_anomaly.AnomalyState(health=h))
    m.state(st, settings(), 0.0, 0.0)
    shown = [round(sample(m, "ftsup_rank_step_time_ratio", rank=r) or 0, 2) for r in "012"]
    assert (shown, sample(m, "ftsup_stragglers")) == ([1.0, 1.0, 3.0], 1.0)
