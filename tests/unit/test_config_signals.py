"""`eviction.signals`: the signals a terminal or a shell sends by habit are refused, each error saying why."""

from __future__ import annotations

import pytest

from tests.unit.test_config import error_of, in_tmp, minimal  # noqa: F401  (in_tmp: each test in a directory of its own)


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ("SIGINT", "SIGINT is what Ctrl-C in a terminal sends (ftsup stops the job on it, exit status 6)"),
        ("int", "SIGINT is what Ctrl-C in a terminal sends (ftsup stops the job on it, exit status 6)"),
        (
            "PIPE",
            "SIGPIPE is what a shell pipeline sends when its reader goes away (`ftsup run ... | head`), and what "
            "the kernel raises on a write to a closed pipe or socket",
        ),
        ("SIGWINCH", "SIGWINCH is what a terminal sends whenever its window is resized"),
    ],
)
def test_signals_a_terminal_or_a_shell_sends_by_habit_are_refused_naming_why(given: str, why: str) -> None:
    assert error_of(minimal(eviction={"signals": ["SIGTERM", given]})) == (
        f"job.yaml: eviction.signals[1]: {why}, so it cannot serve as an eviction notice; use SIGTERM, SIGUSR1 or "
        "SIGUSR2"
    )
