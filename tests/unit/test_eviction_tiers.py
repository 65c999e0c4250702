"""Which tiers an eviction's emergency checkpoint reached before the node was lost (`policy.saves.tiers_reached`),
with a fake clock: memory first, then disk, the durable tier as the deadline allowed; counted by tier; shown by
`ftsup status` from a journal read as hostile input."""

from __future__ import annotations

from typing import Any

from ftsup.protocol import Phase
from ftsup.supervisor.cli import status
from ftsup.supervisor.policy import machine as P
from ftsup.supervisor.policy import saves
from ftsup.supervisor.state.journal import JournalRecord
from ftsup.supervisor.telemetry.metrics import Metrics
from tests.unit.test_emergency_saves import evicting


def beat(step: int, **figures: float) -> P.Heartbeat:
    return P.Heartbeat(1, 0, step, Phase.TRAIN, figures=tuple(sorted((k, float(v)) for k, v in figures.items())))


def report(d: Any, durable: bool | None = None) -> dict[str, Any]:
    """The tiers the eviction of `d` reached, as logged once its workers are gone."""
    d.feed(P.WorkersExited(1, 0))
    assert d.st.eviction is not None
    said = saves.tiers_reached(d.st.eviction, 1, d.st.best_step, durable)
    assert said is not None and said.event == "emergency_tiers_reached"
    return said.as_dict() | {"level": said.level}


def test_memory_then_disk_are_reported_in_order_with_the_seconds_each_had_left() -> None:
    d = evicting(resume=4, reached=10)  # the deadline is 30 s after the notice
    d.now += 1.0
    d.feed(beat(11, memory_step=11))
    d.now += 2.5
    d.feed(beat(11, saved_step=11, save_s=3.4))
    got = report(d, durable=False)
    assert (got["level"], got["step"], got["tiers"], got["left_s"]) == (
        "info",
        11,
        ["memory", "disk"],
        {"memory": 29.0, "disk": 26.5},
    )
    assert "before the node was lost; not the durable tier; it outlives a reboot of this node" in str(got["reason"])


def test_a_save_that_reached_memory_only_is_reported_so_and_still_exit_8() -> None:
    d = evicting(resume=4, reached=10)
    d.feed(beat(11, memory_step=11))
    acts = d.feed(P.WorkersExited(1, 0))
    assert [a.code for a in acts if isinstance(a, P.Exit)] == [saves.EXIT_SAVE_LOST]  # the disk never had it
    assert d.st.eviction is not None
    said = saves.tiers_reached(d.st.eviction, 1, d.st.best_step, None)
    assert said is not None and (said.as_dict()["tiers"], said.as_dict()["step"]) == (["memory"], 11)


def test_an_older_step_in_memory_is_not_the_emergency_checkpoint() -> None:
    d = evicting(resume=4, reached=10)
    d.feed(beat(11, memory_step=8))  # a periodic save's copy, landing after the notice
    d.feed(beat(11, saved_step=11))
    assert report(d, durable=True)["tiers"] == ["disk", "durable"]


def test_a_checkpoint_that_reached_no_tier_is_an_error() -> None:
    d = evicting(resume=4, reached=10)
    got = report(d)
    assert (got["level"], got["tiers"]) == ("error", [])
    assert "reached no tier" in str(got["reason"])


def test_no_report_when_no_save_was_asked_for() -> None:
    ej = saves.Eviction("gcp", 100.0, 90.0, None)
    assert saves.tiers_reached(ej, 1, 10, None) is None


def test_memory_figures_before_any_eviction_change_nothing() -> None:
    d = evicting(resume=4, reached=10)
    assert d.st.eviction is not None and d.st.eviction.landed == ()


def test_each_tier_reached_is_counted_with_its_label() -> None:
    m = Metrics("run", "node", started_unix=0.0)
    m.event("emergency_tiers_reached", {"tiers": ["memory", "disk"]})
    m.event("emergency_tiers_reached", {"tiers": ["memory", "bogus"]})
    m.event("emergency_tiers_reached", {"tiers": []})
    text = m.render().decode()
    got = {t: f'ftsup_emergency_checkpoint_tiers_total{{tier="{t}"}}' for t in ("memory", "disk", "none", "bogus")}
    assert [f"{got[t]} {n}" in text for t, n in (("memory", 2.0), ("disk", 1.0), ("none", 1.0))] == [True] * 3
    assert got["bogus"] not in text


def _record(extra: dict[str, Any]) -> JournalRecord:
    return JournalRecord(run_id="r", node_id="n", supervisor_pid=1, status="evicted", extra=extra)


def test_status_shows_the_last_evictions_tiers_and_drops_what_it_cannot_trust() -> None:
    good = {"step": 11, "tiers": ["memory", "disk"], "left_s": {"memory": 4.2, "disk": 3.1}}
    assert status.last_eviction(_record({"emergency_tiers": good})) == good
    hostile = {"step": "x" * 10, "tiers": ["memory", "/etc/passwd", 7], "left_s": {"memory": "soon", "disk": 1e300}}
    assert status.last_eviction(_record({"emergency_tiers": hostile})) == {
        "step": None,
        "tiers": ["memory"],
        "left_s": {},
    }
    assert status.last_eviction(_record({"emergency_tiers": [1, 2]})) is None


def test_a_save_replicated_to_the_peers_memories_is_reported_between_memory_and_disk() -> None:
    d = evicting(resume=4, reached=10)
    d.feed(beat(11, memory_step=11))
    d.now += 0.5
    d.feed(beat(11, peers_step=11))
    d.now += 2.0
    d.feed(beat(11, saved_step=11, save_s=2.5))
    got = report(d, durable=False)
    assert (got["tiers"], got["left_s"]) == (["memory", "peers", "disk"], {"memory": 30.0, "peers": 29.5, "disk": 27.5})
