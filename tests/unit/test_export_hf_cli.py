"""`ftsup ckpt export-hf`'s torch-free side: its progress line, drawn on a terminal only."""

from __future__ import annotations

import io

from ftsup.supervisor.cli.export_hf import progress_printer


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_drawn_on_a_terminal_at_most_every_interval_and_at_the_end() -> None:
    stream, now = Terminal(), [0.0]
    show = progress_printer(stream, clock=lambda: now[0], every_s=1.0)
    assert show is not None
    for done, t in ((1, 0.0), (2, 0.5), (3, 1.0), (4, 1.2)):
        now[0] = t
        show(done * 10**9, 4 * 10**9)
    assert stream.getvalue() == (
        "\rexporting: 1.00 of 4.00 GB (25%)\rexporting: 3.00 of 4.00 GB (75%)\rexporting: 4.00 of 4.00 GB (100%)\n"
    )


def test_no_progress_is_drawn_where_stderr_is_not_a_terminal() -> None:
    assert progress_printer(io.StringIO()) is None
