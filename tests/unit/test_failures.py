"""How a failed attempt is told: the policy's failure events, the crash-loop exit and the console's lines, driven
with a fake clock and the values the daemon reads from torchrun's report (`policy_io.RankFailure`)."""

from __future__ import annotations

import pytest

from ftsup.protocol import Phase
from ftsup.supervisor.policy import failures
from ftsup.supervisor.policy import machine as P
from ftsup.supervisor.telemetry import console
from tests.settings import settings

S = settings(
    nproc_max=2,
    startup_timeout_s=60,
    backoff_initial_s=1,
    max_restarts=5,
    window_s=1000,
    max_attempts_without_progress=3,
)
LOG = "/state/logs/attempt-0001.log"
TRACEBACK = (
    "err 2",
    "Traceback (most recent call last):",
    '  File "/job/train.py", line 38, in main',
    '    raise ValueError("boom at step 3")',
    "ValueError: boom at step 3",
    "[W1201 11:51:17 ProcessGroup.cpp:1] Warning: destroy_process_group() was not called",
)
STOPPED_BY_TORCHRUN = P.RankFailure(0, 0, 100, -15)


Run = tuple[P.Machine, list[P.Action]]


def run_until_exit(ev: P.WorkersExited, *, progress: bool = False, m: P.Machine | None = None) -> Run:
    """An attempt launched (resuming from nothing), trained to step 3 if `progress`, then ended by `ev`."""
    m = m or P.Machine(S)
    now = 0.0
    m, _ = m.feed(P.Start(), now)
    if m.state.phase == P.SupervisorPhase.BACKOFF:
        m, _ = m.feed(P.Tick(), m.state.resume_at)
    m, _ = m.feed(P.LaunchReady(2, None), now)
    n = m.state.attempt_no
    m, _ = m.feed(P.WorkersStarted(n, (1,), log=LOG), now)
    for step in range(1, 4) if progress else ():
        for r in range(2):
            m, _ = m.feed(P.Heartbeat(n, r, step, Phase.TRAIN, r), now + step)
    return m.feed(P.WorkersExited(n, ev.exitcode, ev.failures, ev.output), now + 10)


def logged(actions: list[P.Action], event: str) -> dict[str, object]:
    (found,) = [a.as_dict() for a in actions if isinstance(a, P.Log) and a.event == event]
    return found


def exited(*failed: P.RankFailure, output: tuple[str, ...] = ()) -> P.WorkersExited:
    return P.WorkersExited(1, 1, failed, output)


def test_a_death_by_signal_is_named_from_a_negative_exit_code() -> None:
    named = [failures.signal_name(c) for c in (-9, -11, -15, 1, 0, None, -200)]
    assert named == ["SIGKILL", "SIGSEGV", "SIGTERM", None, None, None, None]


def test_the_tracebacks_last_line_is_found_under_lines_printed_after_it() -> None:
    assert failures.exception_line(TRACEBACK) == "ValueError: boom at step 3"


def test_a_traceback_whose_header_the_tail_cut_off_still_gives_its_exception_line() -> None:
    frames = [f'  File "/torch/x.py", line {i}, in f' for i in range(100)]
    tail = (*frames, "torch.distributed.DistBackendError: NCCL error in: ...", "[W1201] destroy_process_group() ...")
    assert failures.exception_line(tail) == "torch.distributed.DistBackendError: NCCL error in: ..."


def test_an_event_holds_at_most_the_last_twenty_lines_of_a_ranks_output() -> None:
    output = tuple(f"line {i}" for i in range(200))
    _, actions = run_until_exit(exited(P.RankFailure(1, 1, 4242, 1, output, root=True)))
    assert logged(actions, "worker_exited")["output"] == list(output[-failures.MAX_LINES :])


@pytest.mark.parametrize(
    "line",
    [
        "ModuleNotFoundError: No module named 'transformers'",
        "ImportError: cannot import name 'Foo' from 'bar'",
        "/venv/bin/python: Error while finding module specification for 'torch.distributed.run' "
        "(ModuleNotFoundError: No module named 'torch')",
        "/usr/bin/python3: No module named mypkg.train",
        "/usr/bin/python3: can't open file '/job/trian.py': [Errno 2] No such file or directory",
    ],
)
def test_a_command_that_cannot_start_is_recognised_by_its_last_line(line: str) -> None:
    assert failures.startup_error(("some output", line)) is not None


def test_an_exception_in_training_is_not_taken_for_a_failure_to_start() -> None:
    assert failures.startup_error(TRACEBACK) is None


def test_an_exit_code_names_the_rank_the_code_and_the_tracebacks_last_line() -> None:
    _, actions = run_until_exit(exited(P.RankFailure(1, 1, 4242, 1, TRACEBACK, root=True), STOPPED_BY_TORCHRUN))
    ev = logged(actions, "worker_exited")
    assert (ev["rank"], ev["exit_code"], ev["signal"], ev["log"], ev["output"]) == (1, 1, None, LOG, list(TRACEBACK))
    assert ev["reason"] == "rank 1 (pid 4242) exited with code 1: ValueError: boom at step 3"


@pytest.mark.parametrize(("code", "name"), [(-9, "SIGKILL"), (-11, "SIGSEGV")])
def test_a_death_by_signal_names_the_rank_and_the_signal(code: int, name: str) -> None:
    _, actions = run_until_exit(exited(STOPPED_BY_TORCHRUN, P.RankFailure(1, 1, 4242, code, ("err 2",), root=True)))
    ev = logged(actions, "worker_exited")
    assert (ev["rank"], ev["exit_code"], ev["signal"], ev["output"]) == (1, code, name, ["err 2"])
    assert str(ev["reason"]).startswith(f"rank 1 (pid 4242) was killed by {name} (")


PYNVML_WARNING = (
    "/venv/lib/python3.11/site-packages/torch/cuda/__init__.py:64: FutureWarning: The pynvml package is deprecated.",
    "  import pynvml  # type: ignore[import]",
)


def test_a_killed_ranks_cause_is_the_signal_never_the_warning_it_printed_last() -> None:
    _, actions = run_until_exit(exited(P.RankFailure(1, 1, 4242, -9, PYNVML_WARNING, root=True)))
    assert (
        logged(actions, "worker_exited")["reason"]
        == "rank 1 (pid 4242) was killed by SIGKILL (out of memory, or kill -9)"
    )


def test_an_exit_without_a_traceback_says_so_and_marks_the_last_line_as_no_cause() -> None:
    _, actions = run_until_exit(exited(P.RankFailure(1, 1, 4242, 2, (*PYNVML_WARNING, "usage: train.py"), root=True)))
    reason = logged(actions, "worker_exited")["reason"]
    assert reason == "rank 1 (pid 4242) exited with code 2; no traceback; last line: usage: train.py"


def test_a_traceback_before_a_warning_is_the_cause() -> None:
    _, actions = run_until_exit(exited(P.RankFailure(1, 1, 4242, 1, (*TRACEBACK, *PYNVML_WARNING), root=True)))
    assert (
        logged(actions, "worker_exited")["reason"] == "rank 1 (pid 4242) exited with code 1: ValueError: boom at step 3"
    )


def test_ranks_that_torchrun_stopped_are_listed_but_not_blamed() -> None:
    _, actions = run_until_exit(exited(STOPPED_BY_TORCHRUN, P.RankFailure(1, 1, 4242, -9, root=True)))
    ev = logged(actions, "worker_exited")
    assert "rank 0" not in str(ev["reason"]) and [f["rank"] for f in ev["failures"]] == [1, 0]  # type: ignore[attr-defined]


def test_a_torchrun_failure_that_names_no_rank_quotes_torchrun_itself() -> None:
    _, actions = run_until_exit(exited(output=("torch.distributed.DistNetworkError: rendezvous timed out",)))
    ev = logged(actions, "worker_exited")
    assert ev["reason"] == "torchrun exited with code 1: torch.distributed.DistNetworkError: rendezvous timed out"


def test_the_crash_loop_exit_repeats_the_cause_in_its_event_and_the_journals_last_failure() -> None:
    ev = exited(P.RankFailure(1, 1, 4242, 1, TRACEBACK, root=True))
    m, actions = run_until_exit(ev)
    for _ in range(S.max_attempts_without_progress - 1):
        m, actions = run_until_exit(ev, m=m)
    (exit_,) = [a for a in actions if isinstance(a, P.Exit)]
    loop = logged(actions, "crash_loop_detected")
    assert (exit_.code, loop["rank"], loop["exit_code"], loop["log"]) == (P.EXIT_CRASH_LOOP, 1, 1, LOG)
    assert "ValueError: boom at step 3" in str(loop["reason"]) and m.state.last_failure == loop["reason"]


def test_a_command_that_cannot_start_ends_the_job_at_once_saying_so() -> None:
    missing = ("Traceback (most recent call last):", "ModuleNotFoundError: No module named 'transformers'")
    m, actions = run_until_exit(exited(P.RankFailure(0, 0, 7, 1, missing, root=True)))
    (exit_,) = [a for a in actions if isinstance(a, P.Exit)]
    assert (exit_.code, m.state.attempt_no) == (P.EXIT_CRASH_LOOP, 1)
    assert "cannot start: rank 0: ModuleNotFoundError: No module named 'transformers'" in exit_.reason


def test_an_import_that_fails_after_steps_were_made_is_restarted_as_any_failure() -> None:
    missing = ("ModuleNotFoundError: No module named 'late_plugin'",)
    m, actions = run_until_exit(exited(P.RankFailure(0, 0, 7, 1, missing, root=True)), progress=True)
    assert [a for a in actions if isinstance(a, P.Exit)] == [] and m.state.phase == P.SupervisorPhase.BACKOFF


def test_a_rank_seen_dead_before_torchrun_reported_it_is_named_with_its_last_lines() -> None:
    m = P.Machine(S)
    for event in (P.Start(), P.LaunchReady(2, None), P.WorkersStarted(1, (1,), log=LOG)):
        m, _ = m.feed(event, 0.0)
    m, actions = m.feed(P.RankExited(1, 4242, None, failure=P.RankFailure(1, 1, 4242, None, ("err 2",))), 1.0)
    ev = logged(actions, "worker_exited")
    assert (ev["rank"], ev["log"], ev["output"]) == (1, LOG, ["err 2"])
    assert ev["reason"] == "rank 1 (pid 4242) ended; its exit status was not reported; no traceback; last line: err 2"


def test_the_first_step_of_each_attempt_is_logged_once() -> None:
    m = P.Machine(S)
    for ev in (P.Start(), P.LaunchReady(2, None), P.WorkersStarted(1, (1,))):
        m, _ = m.feed(ev, 0.0)
    seen = []
    for t, step in enumerate((1, 1, 2, 3), start=1):
        for r in range(2):
            m, actions = m.feed(P.Heartbeat(1, r, step, Phase.TRAIN, r), float(t))
            seen += [a.as_dict() for a in actions if isinstance(a, P.Log) and a.event == "first_step_reached"]
    assert seen == [{"attempt": 1, "step": 1, "duration_s": 1.0}]


def test_the_console_shows_a_failure_with_its_cause_the_ranks_last_lines_and_the_log() -> None:
    _, actions = run_until_exit(exited(P.RankFailure(1, 1, 4242, -9, ("err 1", "err 2"), root=True)))
    text = console.line({"event": "worker_exited", **logged(actions, "worker_exited")})
    assert text == (
        "ftsup: attempt 1 failed: rank 1 (pid 4242) was killed by SIGKILL (out of memory, or kill -9)\n"
        "  last lines of rank 1's output:\n    | err 1\n    | err 2\n  log: /state/logs/attempt-0001.log"
    )


def test_the_console_says_nothing_of_an_event_that_changes_nothing_a_person_watches() -> None:
    assert console.line({"event": "health_probed", "level": "info", "slots": [0, 1]}) is None
