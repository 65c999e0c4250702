"""What the ranks' stacks say (`policy.stacks`): the stack tools' output read into threads, a rank inside a collective
told from one outside, ranks with the same stack grouped, and the culprit the evidence names."""

from __future__ import annotations

from ftsup.supervisor.policy import stacks
from ftsup.supervisor.policy.stacks import NATIVE, Seen, Thread

PYSTACK_WAITING = """\
Traceback for thread 4242 (python) [] (most recent call last):
    (Python) File "/job/train.py", line 8, in <module>
        dist.all_reduce(t)
    (Python) File "/venv/torch/distributed/distributed_c10d.py", line 3252, in all_reduce
        work.wait()
    (C) File "???", line 0, in c10d::Work::wait(std::chrono::duration<long>) (/venv/libtorch_cpu.so)
    (C) File "./nptl/pthread_cond_wait.c", line 618, in pthread_cond_wait@@GLIBC_2.3.2 (/lib/libc.so.6)
Traceback for thread 4250 (pt_gloo_runloop) [] (most recent call last):
    (C) File "???", line 0, in gloo::transport::tcp::Loop::run() (/venv/libtorch_cpu.so)
"""
PYSTACK_SPINNING = """\
Traceback for thread 4243 (python) [Has the GIL] (most recent call last):
    (Python) File "/job/train.py", line 40, in main
        spin()
    (Python) File "/job/train.py", line 31, in spin
        n += 1
"""
PYSPY_DDP = """\
Process 4242: /venv/bin/python -u train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 4242 (idle): "MainThread"
    0x7f6b148a3f16 (libc.so.6)
    pthread_cond_wait (libc.so.6)
    c10d::Reducer::finalize_backward (libtorch_cpu.so)
    _engine_run_backward (torch/autograd/graph.py:979)
    Tensor.backward (torch/_tensor.py:623)
    <module> (train.py:13)
    0x7f6b1484524a (libc.so.6)
"""


def frames(text: str, pid: int, parse=stacks.parse_pystack) -> list[tuple[str, bool, tuple[str, ...]]]:
    return [(t.name, t.main, t.frames) for t in parse(text, pid)]


def test_pystack_output_becomes_each_threads_traceback_with_its_source_lines_and_native_frames():
    assert frames(PYSTACK_WAITING, 4242) == [
        (
            "python",
            True,
            (
                "<module> (/job/train.py:8): dist.all_reduce(t)",
                "all_reduce (/venv/torch/distributed/distributed_c10d.py:3252): work.wait()",
                NATIVE + "c10d::Work::wait(std::chrono::duration<long>) (libtorch_cpu.so)",
                NATIVE + "pthread_cond_wait@@GLIBC_2.3.2 (libc.so.6)",
            ),
        ),
        ("pt_gloo_runloop", False, (NATIVE + "gloo::transport::tcp::Loop::run() (libtorch_cpu.so)",)),
    ]


def test_py_spy_output_is_turned_into_a_tracebacks_order_outermost_first():
    ((name, main, got),) = frames(PYSPY_DDP, 4242, stacks.parse_pyspy)
    assert (name, main, got[:3], got[-1]) == (
        "MainThread",
        True,
        (NATIVE + "0x7f6b1484524a (libc.so.6)", "<module> (train.py:13)", "Tensor.backward (torch/_tensor.py:623)"),
        NATIVE + "0x7f6b148a3f16 (libc.so.6)",
    )


def test_a_frame_from_the_ranks_memory_is_printable_and_capped():
    hostile = f'    (Python) File "/x\x1b[31m{"y" * 5000}.py", line 1, in f\n'
    ((_, _, (frame,)),) = frames("Traceback for thread 1 (python) [] (most recent call last):\n" + hostile, 1)
    assert (len(frame), frame.isprintable(), frame.endswith("...")) == (stacks.MAX_FRAME_CHARS, True, True)


def test_a_rank_in_all_reduce_ddps_backward_or_a_gloo_wait_is_inside_a_collective_and_a_spinning_one_is_not():
    told = [
        stacks.in_collective(stacks.parse_pystack(PYSTACK_WAITING, 4242)),
        stacks.in_collective(stacks.parse_pyspy(PYSPY_DDP, 4242)),
        stacks.in_collective(stacks.parse_pystack(PYSTACK_SPINNING, 4243)),
        stacks.in_collective([]),
    ]
    assert told == [True, True, False, None]


def test_ranks_with_the_same_stack_are_one_group_though_the_tools_unnamed_addresses_differ():
    a = stacks.parse_pyspy(PYSPY_DDP, 4242)
    b = stacks.parse_pyspy(PYSPY_DDP.replace("4242", "4300").replace("0x7f6b148a3f16", "0x7fff00000001"), 4300)
    spinning = stacks.parse_pystack(PYSTACK_SPINNING, 4243)
    grouped = stacks.group([(0, a), (1, spinning), (2, b), (3, [])])
    assert [ranks for ranks, _ in grouped] == [(0, 2), (1,), (3,)]


def seen(*ranks: tuple[int, str | None, bool | None]) -> list[Seen]:
    return [Seen(r, state, collective) for r, state, collective in ranks]


def test_a_stopped_rank_is_the_culprit_whatever_the_heartbeats_blamed():
    assert stacks.culprit(seen((0, "S", True), (1, "T", None)), blamed=0) == (1, "stopped (SIGSTOP/state T)")


def test_a_rank_in_uninterruptible_sleep_comes_before_one_outside_a_collective():
    got = stacks.culprit(seen((0, "S", False), (1, "D", True), (2, "S", True)), blamed=0)
    assert got == (1, "in uninterruptible sleep (state D)")


def test_the_rank_outside_any_collective_is_the_culprit_when_the_others_wait_in_one():
    got = stacks.culprit(seen((0, "S", True), (1, "R", False), (2, "S", True)), blamed=0)
    assert got == (1, "not inside a collective, while ranks 0, 2 are")


def test_in_a_hang_a_rank_running_while_the_others_sleep_is_named_when_no_stack_tells_them_apart():
    got = stacks.culprit(seen((0, "S", False), (1, "R", False)), blamed=0)
    assert (got, stacks.culprit(seen((0, "S", None), (1, "R", None)), 0, by_silence=False)[0]) == (
        (1, "running (state R) while rank 0 waits"),
        None,
    )


def test_without_evidence_that_tells_the_ranks_apart_the_rank_silent_first_is_named():
    assert stacks.culprit(seen((0, "S", True), (1, "S", True)), blamed=1)[0] == 1
    assert stacks.culprit(seen((0, "S", True), (1, "S", True)), blamed=1, by_silence=False)[0] is None


def test_ranks_are_said_as_runs():
    assert [stacks.ranks_text(r) for r in ([3], [0, 1, 2, 5, 7, 8], [])] == ["rank 3", "ranks 0-2, 5, 7-8", "ranks "]


def test_a_thread_keeps_its_innermost_frames_when_it_has_too_many():
    deep = "".join(f'    (Python) File "/x.py", line {i}, in f{i}\n' for i in range(stacks.MAX_FRAMES + 10))
    (t,) = stacks.parse_pystack("Traceback for thread 7 (python) [] (most recent call last):\n" + deep, 7)
    assert (len(t.frames), t.cut, t.frames[-1]) == (
        stacks.MAX_FRAMES,
        True,
        f"f{stacks.MAX_FRAMES + 9} (/x.py:{stacks.MAX_FRAMES + 9})",
    )


def test_a_thread_signature_ignores_its_id_and_the_tools_unnamed_frames():
    a = Thread("MainThread", 1, True, ("f (x.py:1)", NATIVE + "0x1 (libc.so.6)"))
    b = Thread("MainThread", 2, True, ("f (x.py:1)", NATIVE + "0x2 (libc.so.6)"))
    assert a.signature() == b.signature() == ("main", ("f (x.py:1)",))
