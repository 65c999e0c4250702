"""Goodput accounting over the policy's state machine, driven by a fake clock: no processes, no sleeps.

Every test's driver checks, after every event, that each second since the job's start is attributed exactly once:
the totals plus the time since the cursor are the time elapsed, to the microsecond."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import yaml
from structlog.testing import capture_logs

from ftsup.protocol import Phase
from ftsup.supervisor.cli.commands import main
from ftsup.supervisor.config.job import load_config
from ftsup.supervisor.policy import goodput as G
from ftsup.supervisor.policy import machine as P
from ftsup.supervisor.run.daemon import Daemon
from ftsup.supervisor.state.journal import Journal, JournalError, JournalRecord
from ftsup.supervisor.telemetry.metrics import Metrics
from tests.settings import settings

TIMEOUTS = {"startup_timeout_s": 60, "save_timeout_s": 100, "min_timeout_s": 2.0}
RESTARTS = {"backoff_initial_s": 4, "backoff_max_s": 8, "max_restarts": 5, "window_s": 1000}
S = settings(nproc_max=2, **TIMEOUTS, **RESTARTS, max_attempts_without_progress=3)
WALL0 = 1_700_000_000.0  # the Unix time at the fake clock's 0


class Driver:
    """Feeds the policy and the accountant events at explicit times (one supervisor's life)."""

    def __init__(self, acc: G.Accounting | None = None, now: float = 0.0, began: float = 0.0) -> None:
        self.m = P.Machine(S)
        self.now = now
        self.began = began  # when the job's first supervisor started, on the same clock
        self.acc = acc if acc is not None else G.start(now, WALL0 + now)

    def feed(self, ev: P.Event, at: float | None = None) -> list[P.Action]:
        if at is not None:
            self.now = at
        before = self.m.state
        self.m, acts = self.m.feed(ev, self.now)
        self.acc = G.feed(self.acc, before, self.m.state, ev, self.now)
        self.check()
        return acts

    def check(self) -> None:
        assert self.acc.cursor is not None
        pending = 0.0 if self.acc.activity == G.ENDED else self.now - self.acc.cursor
        assert self.acc.totals.wall_s + pending == pytest.approx(self.now - self.began, abs=1e-6)

    @property
    def st(self) -> P.State:
        return self.m.state

    def launch(self, resume: int | None = None, at: float | None = None) -> None:
        if at is not None:
            self.now = at
        self.feed(P.Start()) if self.st.phase == "init" else self.feed(P.Tick())
        assert self.st.phase == "preparing", self.st.phase
        self.feed(P.LaunchReady(2, resume))
        self.feed(P.WorkersStarted(self.st.attempt_no))

    def beat(self, step: int, phase: str = "train", dt: float = 0.0, **figures: float) -> None:
        self.now += dt
        for r in range(2):
            self.feed(P.Heartbeat(self.st.attempt_no, r, step, Phase(phase), figures=tuple(figures.items())))

    def train(self, steps: range, dt: float = 0.5) -> None:
        for s in steps:
            self.beat(s, dt=dt, step_s=dt)

    def tick_until(self, t: float) -> None:
        """Ticks every 0.1 s up to `t`, or until the policy changes phase."""
        phase = self.st.phase
        while self.now < t and self.st.phase == phase:
            self.feed(P.Tick(), at=min(t, self.now + 0.1))

    def seconds(self, cause: str) -> float:
        t = self.acc.totals
        return t.productive_s if cause == "productive" else t.badput_s()[cause]


def started(startup_s: float = 3.0, first_step_s: float = 0.5, resume: int | None = None) -> Driver:
    """A job launched at 0 whose ranks start (init) at 1 s and finish their first step after `startup_s`."""
    d = Driver()
    d.launch(resume)
    d.beat(resume or 0, "init", dt=1.0)
    d.beat((resume or 0) + 1, dt=startup_s + first_step_s - 1.0, step_s=first_step_s)
    return d


def test_steady_training_is_all_productive():
    d = started()
    before = d.seconds("productive")
    d.train(range(2, 12), dt=0.5)
    assert d.seconds("productive") - before == pytest.approx(5.0)
    assert sum(d.acc.totals.badput) == pytest.approx(3.0)  # the startup, and nothing since


def test_startup_is_the_launch_to_the_start_of_the_first_step():
    d = started(startup_s=3.0, first_step_s=0.5)
    assert d.seconds("startup") == pytest.approx(3.0)
    assert d.seconds("productive") == pytest.approx(0.5)


def test_a_first_step_without_step_s_ends_startup_where_it_was_heard():
    d = Driver()
    d.launch()
    d.beat(0, "init", dt=1.0)
    d.beat(1, dt=2.5)
    assert d.seconds("startup") == pytest.approx(3.5)
    assert d.seconds("productive") == 0


def test_time_in_phase_load_is_checkpoint_load():
    d = Driver()
    d.launch(resume=10)
    d.beat(10, "init", dt=1.0)
    d.beat(10, "load", dt=0.5)
    d.beat(10, "init", dt=2.0)
    d.beat(11, dt=1.0, step_s=0.5)
    assert d.seconds("checkpoint_load") == pytest.approx(2.0)
    assert d.seconds("startup") == pytest.approx(2.0)


def test_time_in_phase_save_is_checkpoint_save():
    d = started()
    d.train(range(2, 5))
    d.beat(4, "save", dt=0.01)
    d.beat(4, "train", dt=1.5)
    d.train(range(5, 7))
    assert d.seconds("checkpoint_save") == pytest.approx(1.5)
    assert d.seconds("productive") == pytest.approx(0.5 + 1.5 + 0.01 + 1.0)


def test_a_save_s_figure_beyond_the_phase_is_checkpoint_save():
    d = started()
    d.train(range(2, 4))
    d.beat(3, dt=2.0, save_s=1.5)  # a script that reports its save's duration, without a phase
    d.train(range(4, 6))
    assert d.seconds("checkpoint_save") == pytest.approx(1.5)


def test_a_save_s_figure_after_its_phase_counts_the_save_once():
    d = started()
    d.train(range(2, 4))
    d.beat(3, "save", dt=0.0)
    d.beat(3, "train", dt=1.5)
    d.beat(3, dt=0.0, save_s=1.4, saved_step=3)
    d.train(range(4, 6))
    assert d.seconds("checkpoint_save") == pytest.approx(1.5)


def test_a_hang_is_detection_from_the_last_step_to_its_detection():
    d = started()
    d.train(range(2, 12), dt=0.5)
    last_step = d.now
    d.tick_until(last_step + 10)  # learned timeout max(2, 3 x 0.5) = 2 s: detected at the first tick past it
    assert d.st.phase == "stopping"
    detected = d.now
    assert d.seconds("detection") == pytest.approx(detected - last_step)


@pytest.mark.parametrize("torn_down", [False, True])  # True: rank 0's exit hook beat `done` after rank 1 died
def test_a_crash_while_training_is_detection_of_the_step_it_cut_short(torn_down):
    d = started()
    d.train(range(2, 6), dt=0.5)
    if torn_down:
        d.feed(P.Heartbeat(1, 0, 5, Phase.DONE), at=d.now + 0.2)
    d.feed(P.WorkersExited(1, 1), at=d.now + 0.3 - 0.2 * torn_down)
    assert d.seconds("detection") == pytest.approx(0.3) and d.seconds("other") == 0.0
    assert d.st.phase == "backoff"


def test_a_crash_while_starting_is_startup():
    d = Driver()
    d.launch()
    d.beat(0, "init", dt=2.0)
    d.feed(P.WorkersExited(1, 1), at=d.now + 1.0)
    assert d.seconds("startup") == pytest.approx(3.0)
    assert d.seconds("detection") == 0


def test_a_beat_of_an_earlier_attempt_read_late_is_no_sign_of_life_of_the_running_one():
    d = started()
    d.train(range(2, 6))
    d.feed(P.WorkersExited(1, 1), at=d.now + 0.3)
    d.tick_until(d.now + 10)
    d.feed(P.LaunchReady(2, None))
    d.feed(P.WorkersStarted(2))
    launched = d.now
    d.feed(P.Heartbeat(1, 0, 5, Phase.TRAIN), at=d.now + 10)
    d.tick_until(d.now + 100)  # startup_timeout_s 60: no beat of attempt 2 since its launch
    assert d.st.phase == "stopping"
    assert d.seconds("detection") == pytest.approx(0.3 + (d.now - launched))


def test_the_wait_before_a_restart_is_backoff():
    d = started()
    d.train(range(2, 6))
    d.feed(P.WorkersExited(1, 1), at=d.now + 0.3)  # after progress: restarted at once
    d.tick_until(d.now + 10)
    assert (d.st.phase, d.seconds("backoff")) == ("preparing", pytest.approx(0.0, abs=0.11))
    d.launch(resume=5)
    d.feed(P.WorkersExited(2, 1), at=d.now + 0.3)  # no new step: the second failure in a row waits
    failed = d.now
    d.tick_until(failed + 10)
    assert d.st.phase == "preparing"
    assert d.seconds("backoff") == pytest.approx(4.0, abs=0.21)  # backoff_initial_s, to the ticks that ended them


def test_stopping_a_failed_attempt_is_other():
    d = started()
    d.train(range(2, 6))
    d.feed(P.RankExited(1, pid=123, exitcode=1), at=d.now + 0.2)
    assert d.st.phase == "stopping"
    d.feed(P.WorkersExited(1, -9), at=d.now + 2.0)
    assert d.seconds("other") == pytest.approx(2.0)
    assert d.seconds("detection") == pytest.approx(0.2)


def test_steps_trained_again_after_a_resume_are_wasted_progress_and_new_ones_productive():
    d = started()
    d.train(range(2, 11), dt=0.5)  # steps 1..10
    d.feed(P.WorkersExited(1, 1), at=d.now + 0.1)
    d.tick_until(d.now + 5)
    d.feed(P.LaunchReady(2, 6))  # resumed from step 6: steps 7..10 are trained again
    d.feed(P.WorkersStarted(2))
    d.beat(6, "init", dt=1.0)
    productive = d.seconds("productive")
    d.train(range(7, 15), dt=0.5)
    assert d.seconds("wasted_progress") == pytest.approx(0.5 * 4)
    assert d.seconds("productive") - productive == pytest.approx(0.5 * 4)


def test_a_step_trained_in_a_batch_of_beats_splits_its_time_between_old_and_new_steps():
    d = started()
    d.train(range(2, 5), dt=0.5)  # high water 4
    d.feed(P.WorkersExited(1, 1), at=d.now + 0.1)
    d.tick_until(d.now + 5)
    d.feed(P.LaunchReady(2, 2))
    d.feed(P.WorkersStarted(2))
    d.beat(2, "init", dt=1.0)
    d.beat(3, dt=0.5, step_s=0.5)
    wasted, productive = d.seconds("wasted_progress"), d.seconds("productive")
    d.beat(6, dt=1.5)  # steps 4 (again), 5 and 6 (new) heard at once
    assert d.seconds("wasted_progress") - wasted == pytest.approx(0.5)
    assert d.seconds("productive") - productive == pytest.approx(1.0)


def test_an_eviction_notice_is_eviction_until_the_stop_but_steps_trained_meanwhile_stay_productive():
    d = started()
    d.train(range(2, 6), dt=0.5)
    productive = d.seconds("productive")
    d.feed(P.EvictionNoticed("sigterm", deadline=d.now + 30), at=d.now + 0.1)
    d.train(range(6, 8), dt=0.5)
    d.beat(7, "save", dt=0.0)
    d.beat(7, "train", dt=2.0)
    d.beat(7, dt=0.0, saved_step=7, save_s=1.9)
    d.beat(7, "done", dt=0.0)
    d.feed(P.WorkersExited(1, 0), at=d.now + 1.0)
    assert d.st.phase == "done"
    assert d.seconds("productive") - productive == pytest.approx(0.1 + 1.0)  # the step in flight, steps 6 and 7
    assert d.seconds("eviction") == pytest.approx(3.0)
    assert d.seconds("checkpoint_save") == 0


def test_time_in_eval_is_other():
    d = started()
    d.train(range(2, 4))
    d.beat(3, "eval", dt=0.0)
    for _ in range(4):
        d.beat(3, "eval", dt=0.5)  # the keepalive thread
    d.beat(3, "train", dt=0.5)
    assert d.seconds("other") == pytest.approx(2.5)


def test_every_second_is_attributed_once_across_a_supervisor_restart():
    d = started()
    d.train(range(2, 9), dt=0.5)
    saved = G.snapshot(d.acc, d.now, WALL0 + d.now)
    assert saved == G.Saved.from_json(saved.to_json())  # as the journal keeps it
    d.train(range(9, 11), dt=0.5)  # trained after the last snapshot: lost with the supervisor
    died = d.now
    restart = died + 12.0  # systemd's RestartSec and the new supervisor's start
    e = Driver(G.resumed(saved, "running", restart, WALL0 + restart), now=restart)
    assert e.acc.totals.wall_s == pytest.approx(restart)  # from the job's first start to now
    assert e.seconds("other") == pytest.approx(restart - saved.as_of_unix + WALL0)
    e.launch(resume=8)
    e.beat(8, "init", dt=1.0)
    e.train(range(9, 13), dt=0.5)
    assert e.acc.high_water == 12
    assert e.seconds("wasted_progress") == 0  # steps 9 and 10 were never counted before: the restart lost them
    e.beat(12, "done", dt=0.1)
    e.feed(P.WorkersExited(e.st.attempt_no, 0), at=e.now + 0.4)
    assert e.acc.activity == G.ENDED
    assert e.acc.totals.wall_s == pytest.approx(e.now)


def test_steps_a_restarted_supervisor_trains_again_are_wasted_progress():
    d = started()
    d.train(range(2, 11), dt=0.5)
    saved = G.snapshot(d.acc, d.now, WALL0 + d.now)
    e = Driver(G.resumed(saved, "running", d.now + 5, WALL0 + d.now + 5), now=d.now + 5)
    e.launch(resume=6)
    e.beat(6, "init", dt=1.0)
    e.train(range(7, 13), dt=0.5)
    assert e.seconds("wasted_progress") == pytest.approx(4 * 0.5)


def test_the_time_stopped_after_an_eviction_is_eviction():
    d = started()
    saved = G.snapshot(d.acc, d.now, WALL0 + d.now)
    acc = G.resumed(saved, "evicted", d.now + 600, WALL0 + d.now + 600)
    assert acc.totals.badput_s()["eviction"] == pytest.approx(600)


def test_the_time_after_a_job_succeeded_is_not_the_jobs():
    d = started()
    saved = G.snapshot(d.acc, d.now, WALL0 + d.now)
    acc = G.resumed(saved, "succeeded", d.now + 600, WALL0 + d.now + 600)
    assert acc.totals == saved.totals


def test_a_snapshot_leaves_the_time_since_the_cursor_to_the_next_supervisor():
    d = started()
    d.train(range(2, 5), dt=0.5)
    d.tick_until(d.now + 1.0)  # a step in flight: not attributed yet
    saved = G.snapshot(d.acc, d.now, WALL0 + d.now)
    assert saved.as_of_unix == pytest.approx(WALL0 + d.now - 1.0)
    assert saved.totals.wall_s == pytest.approx(d.now - 1.0)


def test_the_ratio_is_productive_over_wall_time():
    d = started(startup_s=3.0, first_step_s=0.5)
    d.train(range(2, 9), dt=0.5)  # 4 s productive, 3 s startup
    assert d.acc.totals.ratio == pytest.approx(4 / 7)
    assert d.acc.totals.summary()["ratio"] == pytest.approx(4 / 7, abs=1e-6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"v": 2}, "'v' must be 1"),
        ({"productive_s": -1.0}, "'productive_s' must be a number of seconds"),
        ({"productive_s": float("nan")}, "'productive_s' must be a number of seconds"),
        ({"badput_s": {"coffee": 1.0}}, "'badput_s' must map causes"),
        ({"badput_s": {"startup": "1"}}, "'badput_s.startup' must be a number of seconds"),
        ({"high_water_step": True}, "'high_water_step' must be a step"),
        ({"activity": "napping"}, "'activity' must be one of"),
        ({"as_of_unix": 1e13}, "'as_of_unix' must be a number of seconds"),
        ({"extra": 1}, "unknown field 'extra'"),
    ],
)
def test_a_saved_accounting_with_a_bad_field_is_refused_naming_it(change, message):
    raw = G.Saved(G.Totals(1.0), WALL0).to_json() | change
    with pytest.raises(ValueError, match=message):
        G.Saved.from_json(raw)


# ---------------------------------------------------------------------- where the accounting is kept and shown


def a_saved() -> G.Saved:
    totals = G.Totals(90.0).add("startup", 6.0).add("detection", 4.0)
    return G.Saved(totals, WALL0 + 100, high_water=40, activity=G.TRAIN, started_unix=WALL0)


def test_the_journal_keeps_the_accounting_and_gives_it_back(tmp_path):
    path = tmp_path / "journal.json"
    Journal(path).write(JournalRecord(run_id="r", node_id="n", supervisor_pid=1, goodput=a_saved().to_json()))
    rec = Journal(path).read()
    assert rec is not None and rec.goodput is not None
    assert G.Saved.from_json(rec.goodput) == a_saved()


def test_a_journal_with_a_bad_accounting_is_refused_naming_the_field(tmp_path):
    path = tmp_path / "journal.json"
    bad = a_saved().to_json() | {"productive_s": -5}
    Journal(path).write(JournalRecord(run_id="r", node_id="n", supervisor_pid=1, goodput=bad))
    with pytest.raises(JournalError, match="'goodput': 'productive_s' must be a number of seconds"):
        Journal(path).read()


def test_status_json_shows_productive_badput_wall_and_ratio(tmp_path, capsys):
    config = status_job(tmp_path)
    saved = a_saved().to_json()
    ended = JournalRecord(
        run_id="r", node_id="n", supervisor_pid=1, status="succeeded", updated_unix=WALL0 + 100, goodput=saved
    )
    Journal(tmp_path / "state" / "journal.json").write(ended)
    assert main(["status", "--config", str(config), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["goodput"]
    assert (got["productive_s"], got["wall_s"], got["ratio"]) == (90.0, 100.0, 0.9)
    assert got["badput_s"] == {c: {"startup": 6.0, "detection": 4.0}.get(c, 0.0) for c in G.CAUSES}
    assert main(["status", "--config", str(config)]) == 0
    assert "goodput 0.900 over 100.0 s" in capsys.readouterr().out


def test_the_exported_counters_follow_the_accounting_and_never_go_back():
    m = Metrics("r", "n", started_unix=0)
    m.accounting(a_saved().totals)
    assert "ftsup_goodput_ratio 0.9" in m.render().decode()
    m.accounting(G.Totals(50.0))  # an older accounting (never journaled after a newer one): nothing goes back
    text = m.render().decode()
    assert "ftsup_productive_seconds_total 90.0" in text
    assert 'ftsup_badput_seconds_total{cause="startup"} 6.0' in text
    assert 'ftsup_badput_seconds_total{cause="eviction"} 0.0' in text


def status_job(tmp: Path) -> Path:
    (tmp / "state").mkdir(mode=0o700)
    config = tmp / "job.yaml"
    cfg = {
        "job": {"command": ["true"], "state_dir": str(tmp / "state"), "run_id": "r"},
        "launch": {"node_id": "n"},
        "checkpoint": {"dir": str(tmp / "ckpt")},
    }
    config.write_text(yaml.safe_dump(cfg))
    return config


def test_ranks_gone_before_torchrun_exits_keep_their_activity_until_the_exit_says_how_they_ended():
    d = started()
    d.train(range(2, 6), dt=0.5)
    d.feed(P.WorkersRestarted(1, new_ranks=False), at=d.now + 0.3)  # a rank killed, torchrun stopping the others
    d.tick_until(d.now + 0.4)
    d.feed(P.WorkersExited(1, 1), at=d.now + 0.1)
    assert d.seconds("detection") == pytest.approx(0.8)
    assert d.seconds("startup") == pytest.approx(3.0)


def test_ranks_done_before_torchrun_exits_are_other_until_the_exit():
    d = started()
    d.train(range(2, 6), dt=0.5)
    d.beat(5, "done", dt=0.0)
    d.feed(P.WorkersRestarted(1, new_ranks=False), at=d.now + 0.3)
    d.feed(P.WorkersExited(1, 0), at=d.now + 0.5)
    assert d.seconds("other") == pytest.approx(0.8)


# ---------------------------------------------------------------------- the daemon's side


def a_daemon(tmp: Path) -> Daemon:
    cfg = {
        "job": {"command": [sys.executable, "-c", "pass"], "workdir": str(tmp), "state_dir": str(tmp / "state")},
        "launch": {"nproc_per_node": 1},
        "checkpoint": {"dir": str(tmp / "ckpt")},
    }
    (tmp / "job.yaml").write_text(yaml.safe_dump(cfg))
    (tmp / "state").mkdir(mode=0o700, exist_ok=True)
    return Daemon(load_config(tmp / "job.yaml", hostname="node-a"))


def exported_productive(d: Daemon) -> float | None:
    return d.metrics.registry.get_sample_value("ftsup_productive_seconds_total")


@pytest.fixture
def restore_structlog() -> Iterator[None]:
    """Starting a daemon configures structlog for the process; put the test session's configuration back."""
    old = structlog.get_config()
    yield
    structlog.configure(**old)


def test_a_restarted_supervisor_exports_the_journaled_accounting_before_its_first_scrape(tmp_path, restore_structlog):
    d = a_daemon(tmp_path)
    run_id, node_id = d.cfg.job.run_id, d.cfg.launch.node_id
    left = JournalRecord(
        run_id=run_id, node_id=node_id, supervisor_pid=1, status="running", goodput=a_saved().to_json()
    )
    d.journal.file.write(left)
    with contextlib.ExitStack() as stack:
        d._start(stack)  # the metrics endpoint is up from here on
        assert exported_productive(d) == 90.0


def test_an_accounting_that_was_not_written_to_the_journal_is_not_exported(tmp_path):
    d = a_daemon(tmp_path)
    d.goodput = G.Accounting(G.Totals(42.0), cursor=0.0)
    (tmp_path / "state").rename(tmp_path / "aside")
    (tmp_path / "state").write_text("not a directory")  # every write fails: a storage outage
    with capture_logs():
        d.journal.write("running")
    assert exported_productive(d) == 0.0
    (tmp_path / "state").unlink()
    (tmp_path / "aside").rename(tmp_path / "state")
    d.journal.write("running")
    assert exported_productive(d) == 42.0
