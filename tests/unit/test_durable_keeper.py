"""The durable tier in the daemon (`durable_keeper`) on a tier in tmp_path: what a scan of the fast tier shows goes
to the uploader as the config picks, the uploader's reports are logged and counted on the caller's thread, retention
deletes what the tier need not keep, and a wait that cannot be served names the newest durable checkpoint. On a
real S3 store under `ftsup run`: tests/integration/test_durable_run.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ftsup.store import layout
from ftsup.supervisor.config.job import JobConfig, parse_config
from ftsup.supervisor.durable.keeper import DurableKeeper
from ftsup.supervisor.state.ckptstore import StoreScanner
from ftsup.supervisor.telemetry import console
from ftsup.supervisor.telemetry.metrics import Metrics
from tests.helpers import default_files, make_fake_checkpoint


def config(tmp: Path, **durable: object) -> JobConfig:
    raw = {
        "job": {"command": ["true"]},
        "checkpoint": {"dir": str(tmp / "ckpt"), "durable": {"url": str(tmp / "durable"), **durable}},
        "anomaly": {"detection_window_steps": 0},
    }
    return parse_config(raw, source="job.yaml", base_dir=tmp, hostname="n")


class Log:
    """The daemon's `emit`: each event logged (here: kept) and counted."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []
        self.metrics = metrics

    def __call__(self, level: str, event: str, **fields: Any) -> None:
        self.lines.append((level, event, fields))
        if self.metrics is not None:
            self.metrics.event(event, fields)

    def named(self, event: str) -> list[dict[str, Any]]:
        return [f for _, e, f in self.lines if e == event]


def scanned(cfg: JobConfig) -> StoreScanner:
    scanner = StoreScanner(cfg.checkpoint.dir, recent=16)
    scanner.scan()  # on this thread: the scanner's own is not started
    return scanner


def test_the_picked_checkpoints_become_durable_and_retention_keeps_the_newest(tmp_path: Path) -> None:
    cfg = config(tmp_path, periodic_every=2, keep_last=1)
    metrics = Metrics("r", "n", started_unix=0)
    log = Log(metrics)
    keeper = DurableKeeper(cfg, emit=log, metrics=metrics)
    scanner = StoreScanner(cfg.checkpoint.dir, recent=16)
    with keeper.running():
        for batch in ((), (5, 10), (15, 20, 21)):  # each a scan: the first of an empty fast tier
            for step in batch:
                make_fake_checkpoint(
                    tmp_path / "ckpt", step, default_files(step), kind="emergency" if step == 21 else "periodic"
                )
            scanner.scan()
            keeper.observe(scanner.view())
            idle = keeper.wait_idle(30, "the test", batch[-1]) if batch else True
    committed = [f["step"] for f in log.named("durable_committed")]
    kept = [s for s, _ in layout.committed_dirs(tmp_path / "durable")]
    # Every 2nd periodic (10, 20) and the emergency one (21), the newest first; keep_last 1 keeps 21.
    assert (idle, committed, kept, keeper.newest) == (True, [10, 21, 20], [21], 21)
    assert [f["step"] for f in log.named("durable_deleted")] == [10, 20]
    assert b'ftsup_durable_uploads_total{outcome="committed"} 3.0' in metrics.render()
    assert b"ftsup_durable_latest_step 21.0" in metrics.render()


def test_an_eviction_without_a_durable_checkpoint_says_which_is_the_newest_durable(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    log = Log()
    keeper = DurableKeeper(cfg, emit=log, metrics=Metrics("r", "n", started_unix=0))
    with keeper.running():
        keeper.observe(scanned(cfg).view())
        make_fake_checkpoint(tmp_path / "ckpt", 7, default_files())
        keeper.saved(7, "emergency")
        durable = keeper.wait_durable(7, 30, "evicted")
        missed = keeper.wait_durable(None, 30, "evicted")
    assert (durable, missed) == (True, False)
    assert log.named("durable_deadline_missed")[0]["reason"] == (
        f"evicted: no checkpoint was saved for it; the newest durable checkpoint in {tmp_path / 'durable'} is step 7"
    )


def test_a_terminal_is_told_when_a_checkpoint_is_durable_and_when_one_could_not_be() -> None:
    committed = {"event": "durable_committed", "step": 20, "url": "s3://b-1/run"}
    missed = {"event": "durable_deadline_missed", "level": "warning", "reason": "evicted: ...; the newest is step 10"}
    assert (console.line(committed), console.line(missed)) == (
        "ftsup: checkpoint of step 20 durable in s3://b-1/run",
        "ftsup: warning: evicted: ...; the newest is step 10",
    )
