"""`ftsup.tools.faults.chaos` observers on files written by hand, and whose processes a chaos job takes for its own:
no torch."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from ftsup.protocol import NODE_ID_ENV
from ftsup.tools.faults import chaos, nodes
from ftsup.tools.faults.refjob import TrainerJob


def line(step: int, loss_hex: str = "0x1p+0") -> str:
    return json.dumps({"step": step, "loss": 1.0, "loss_hex": loss_hex}) + "\n"


def test_a_loss_line_counts_only_once_its_newline_is_written(tmp_path: Path) -> None:
    log = tmp_path / "loss.jsonl"
    log.write_text(line(1) + line(2)[:10])
    tail = chaos.LossLogTail(log)
    tail._read()
    before = [ln.step for ln in tail.lines()]
    with open(log, "a") as f:
        f.write(line(2)[10:])
    tail._read()
    assert (before, [ln.step for ln in tail.lines()], tail.bad_lines) == ([1], [1, 2], 0)


def test_the_tail_thread_sees_lines_written_while_it_runs(tmp_path: Path) -> None:
    log = tmp_path / "loss.jsonl"
    with chaos.LossLogTail(log) as tail:
        log.write_text(line(1) + line(2) + line(3))
        got = tail.wait_for_step(3, timeout_s=10)
    assert (got.step, tail.max_step()) == (3, 3)


def test_the_current_step_is_the_files_though_the_thread_has_not_polled_since(tmp_path: Path) -> None:
    log = tmp_path / "loss.jsonl"
    log.write_text(line(1))
    with chaos.LossLogTail(log, interval_s=3600) as tail:  # a thread that never polls: a starved one
        log.write_text(line(1) + line(2) + line(3))
        assert (tail.max_step(), tail.current_step(), tail.max_step()) == (0, 3, 3)


def test_waiting_for_a_step_that_never_comes_is_a_chaos_error(tmp_path: Path) -> None:
    with chaos.LossLogTail(tmp_path / "loss.jsonl") as tail, pytest.raises(chaos.ChaosError, match="step 5"):
        tail.wait_for_step(5, timeout_s=0.05)


def test_the_last_attempt_wins_for_a_step_logged_twice_and_torn_lines_are_skipped(tmp_path: Path) -> None:
    log = tmp_path / "loss.jsonl"
    log.write_text(line(1, "a") + line(2, "old") + '{"step": 3, "lo' + "\n" + line(2, "new") + line(3, "c"))
    got = {s: rec["loss_hex"] for s, rec in chaos.last_line_per_step(log).items()}
    assert got == {1: "a", 2: "new", 3: "c"}


def test_supervisor_log_timestamps_become_unix_seconds(tmp_path: Path) -> None:
    log = tmp_path / "supervisor.jsonl"
    log.write_text(
        json.dumps({"event": "workers_launched", "attempt": 2, "timestamp": "2026-01-01T00:00:01.500000Z"})
        + "\nnot json\n"
    )
    events = chaos.read_events(log)
    assert [(e.event, e.t, e.fields["attempt"]) for e in events] == [("workers_launched", 1767225601.5, 2)]


def test_first_event_skips_events_before_the_fault() -> None:
    events = [chaos.LogEvent(1.0, "worker_exited"), chaos.LogEvent(5.0, "heartbeat_timed_out")]
    assert chaos.first_event(events, chaos.FAILURE_EVENTS, after=2.0) == events[1]


def test_the_slowest_rank_load_is_read_from_the_attempt_log(tmp_path: Path) -> None:
    (tmp_path / "attempt-0002.log").write_text(
        "2026-11-30 00:16:43 [info     ] checkpoint_loaded   bytes_read=1 duration_s=0.1846 path=/c rank=0 step=15\n"
        "[rank1]: 2026-11-30 00:16:43 [info     ] checkpoint_loaded   duration_s=0.2 rank=1 step=15\n"
    )
    assert (chaos.attempt_load_s(tmp_path, 2), chaos.attempt_load_s(tmp_path, 3)) == (0.2, None)


@pytest.mark.parametrize(
    ("values", "expected"), [([], None), ([3.0], 3.0), ([1.0, None, 3.0], 2.0), ([5.0, 1.0, 3.0], 3.0)]
)
def test_median_ignores_missing_values(values: list[float | None], expected: float | None) -> None:
    assert chaos.median(values) == expected


def test_p99_is_the_policys_nearest_rank_percentile() -> None:
    assert (chaos.p99([0.1] * 99 + [5.0]), chaos.p99([0.1] * 98 + [5.0, 6.0])) == (0.1, 5.0)


def test_a_chaos_node_is_known_by_its_runs_node_id_not_by_a_node_name_another_job_shares(tmp_path: Path) -> None:
    job = nodes.NodeJob(TrainerJob(tmp_path, "chaos-nodes-0123abcd", steps=10), 29500)
    job.write_configs(1)
    node_id = yaml.safe_load(job.config_path("node-b").read_text())["launch"]["node_id"]
    code = "import sys; sys.stdin.read()"  # lives until its standard input closes
    procs = {
        name: subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, env={NODE_ID_ENV: name})
        for name in ("node-b", node_id)  # another job's node-b, and this run's
    }
    try:
        found = {p.pid for p in chaos.matching_processes(job.markers("node-b"))}
        assert (node_id, found) == ("chaos-nodes-0123abcd-node-b", {procs[node_id].pid})
    finally:
        for p in procs.values():
            p.communicate(timeout=30)


def test_the_latest_step_is_the_line_logged_last_behind_the_best_after_a_rollback(tmp_path: Path) -> None:
    log = tmp_path / "loss.jsonl"
    log.write_text(line(1) + line(2) + line(3) + line(2))  # step 3 was lost; step 2 is trained again
    with chaos.LossLogTail(log, interval_s=3600) as tail:
        assert (tail.latest_step(), tail.max_step()) == (2, 3)


def test_a_sigstop_a_tracer_swallowed_is_sent_again_until_the_rank_is_stopped() -> None:
    tracer = subprocess.Popen(
        [sys.executable, str(Path(__file__).parents[1] / "bin" / "swallow_stop.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert tracer.stdout is not None and tracer.stdin is not None
        pid = int(tracer.stdout.readline())
        target = chaos.RankProcess(0, 0, pid, psutil.Process(pid).create_time())
        chaos.send(target, signal.SIGSTOP)
        got = (psutil.Process(pid).status(), tracer.stdout.readline().strip())
        assert got == (psutil.STATUS_STOPPED, "swallowed SIGSTOP")
    finally:
        if tracer.stdin is not None:
            tracer.stdin.close()
        tracer.wait(timeout=30)
