"""A checkpoint directory that vanishes under the supervisor: its scans say so, and the daemon's side counts it as a
storage outage (`storage_failed`, `ftsup_storage_errors_total{purpose="checkpoint_dir"}`) until it is back, while
one that was never made yet (before a fresh job's first save) is no outage."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

from ftsup.supervisor.config.job import CheckpointConfig
from ftsup.supervisor.run.outages import Outages
from ftsup.supervisor.run.resume import ResumeChoice
from ftsup.supervisor.telemetry.metrics import Metrics
from tests.helpers import default_files, make_fake_checkpoint
from tests.settings import DEFAULTS


class Watched:
    """A ResumeChoice over `store` whose scans run on the test's thread, and what it logged and counted."""

    def __init__(self, store: Path) -> None:
        cfg = dataclasses.replace(DEFAULTS, checkpoint=CheckpointConfig(dir=store))
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.metrics = Metrics("run", "node", started_unix=0.0)
        outages = Outages(self.emit, self.metrics.storage_error, lambda: 0.0)
        self.choice = ResumeChoice(cfg, emit=self.emit, post=lambda ev: None, outages=outages, metrics=self.metrics)

    def emit(self, level: str, event: str, **fields: Any) -> None:
        self.events.append((event, fields))

    def scan(self) -> list[str]:
        before = len(self.events)
        self.choice.store.scan()
        self.choice.refresh_metrics()
        return [name for name, _ in self.events[before:]]

    def storage_errors(self) -> float:
        value = self.metrics.registry.get_sample_value("ftsup_storage_errors_total", {"purpose": "checkpoint_dir"})
        return value or 0.0


def test_a_store_not_made_yet_is_no_outage(tmp_path: Path) -> None:
    watched = Watched(tmp_path / "ckpt")
    assert (watched.scan(), watched.choice.store.view().missing, watched.storage_errors()) == ([], True, 0.0)


def test_a_store_that_vanished_is_an_outage_until_it_is_back(tmp_path: Path) -> None:
    store = tmp_path / "ckpt"
    make_fake_checkpoint(store, 10, default_files(1))
    watched = Watched(store)
    watched.scan()
    shutil.rmtree(store)
    assert watched.scan() == ["storage_failed"]
    (_, fields) = watched.events[-1]
    assert (fields["purpose"], fields["path"], watched.storage_errors()) == ("checkpoint_dir", str(store), 1.0)
    assert f"{store}: vanished, or something else is in its place" in fields["reason"]
    store.mkdir()
    assert watched.scan() == ["storage_recovered"]


def test_a_file_in_the_store_s_place_is_an_outage_too(tmp_path: Path) -> None:
    store = tmp_path / "ckpt"
    store.mkdir()
    watched = Watched(store)
    watched.scan()
    store.rmdir()
    store.write_text("not a store")
    assert (watched.scan(), watched.storage_errors()) == (["storage_failed"], 1.0)
