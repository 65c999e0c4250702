"""`ftsup bench scale`'s report (`scale_report`): growth exponents, figures at 16,384 ranks, targets."""

from __future__ import annotations

from typing import Any

import pytest

from ftsup.tools.bench.scale import report as scale_report


def _results(costs: dict[int, float], op: str = "resume_choice") -> list[dict[str, Any]]:
    return [{"ranks": n, "ops": {op: {"median_s": t, "peak_rss_increase_bytes": 1}}} for n, t in costs.items()]


def test_a_cost_proportional_to_the_ranks_grows_with_exponent_one() -> None:
    assert scale_report.growth(_results({256: 0.01, 4096: 0.16}), "resume_choice") == pytest.approx(1.0)


def test_a_quadratic_cost_grows_with_exponent_two() -> None:
    assert scale_report.growth(_results({256: 0.01, 1024: 0.16}), "resume_choice") == pytest.approx(2.0)


def test_a_figure_measured_at_16384_ranks_is_not_extrapolated() -> None:
    assert scale_report.at_target(_results({4096: 0.1, 16384: 0.3}), "resume_choice") == (0.3, False)


def test_a_figure_below_16384_ranks_is_extrapolated_linearly_and_says_so() -> None:
    value, extrapolated = scale_report.at_target(_results({1024: 0.1, 2048: 0.2}), "resume_choice")
    assert extrapolated and value == pytest.approx(1.6)


def test_the_resume_choice_target_is_not_met_over_one_second() -> None:
    t = scale_report.targets(_results({16384: 1.5}))
    assert t["resume_choice_with_fast_verify_s"]["met"] is False
