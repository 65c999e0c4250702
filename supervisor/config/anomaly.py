"""`anomaly:` what the supervisor watches in the numbers the ranks report, and what it does about it.

`AnomalyConfig` is the section, `parse_anomaly` reads it or raises one `ConfigError` naming the key; no I/O. How the
defaults were chosen: docs/design/config.md, The anomaly defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from ftsup.supervisor.config import values as config_values
from ftsup.supervisor.config.values import Section

MAX_STEPS = 10**9


@dataclass(frozen=True)
class AnomalyConfig:
    """`anomaly:` training-health detectors over the heartbeats' figures, automatic rollback, escalation."""

    enabled: bool = True
    """Watch the figures at all. False: no detector runs and nothing is rolled back (the figures are still shown)."""
    nonfinite: bool = True
    """Roll back at once when a rank reports a loss or gradient norm that is not finite, or a step whose update
    the rank-side guard refused (figure step_skipped)."""
    loss_spike_factor: float = 2.0
    """A step's loss (the mean over this node's ranks) above this x the median of the trailing window is high."""
    loss_window_steps: int = 50
    """The trailing window of the loss, gradient-norm and step-time detectors: the steps a median is taken of."""
    loss_patience_steps: int = 4
    """High values on this many steps in a row confirm a spike (the first of them is its onset)."""
    warmup_steps: int = 20
    """Steps 1 to this are never judged a spike (they still fill the window): early losses fall fast."""
    grad_norm_spike_factor: float = 5.0
    """A gradient norm above this x the median of the trailing window is high (with the same patience)."""
    straggler_ratio: float = 2.0
    """A rank whose step time is above this x the median of the other ranks' is slow."""
    straggler_patience_steps: int = 10
    """Slow on this many steps in a row: reported as a straggler (logged, counted; never stopped)."""
    drift_ratio: float = 2.0
    """The job's median step time over the trailing window above this x the one of its first window (after the
    warm-up) is reported as throughput drift (and its end once it is back under halfway to that)."""
    rollback_margin_steps: int = 0
    """Roll back to the newest consistent checkpoint at least this many steps before the anomaly's onset."""
    skip_extra_steps: int = 10
    """The data skip runs from the onset to this many steps past the detection (in global batches): bad data
    tends to come in runs longer than the patience that confirmed it."""
    detection_window_steps: int = 100
    """History kept for a rollback: retention keeps the newest checkpoint at least this many steps older than the
    latest (FTSUP_KEEP_OLDER_THAN_STEPS). Also the repeat detector's reach: the same kind of anomaly again with its
    onset within this many steps after the end of a skip escalates."""
    max_rollbacks: int = 3
    """Automatic rollbacks allowed within `rollback_window_s`; one more escalates (exit 7)."""
    rollback_window_s: float = 3600.0
    """The sliding window over which `max_rollbacks` is counted."""


def parse_anomaly(sec: Section) -> AnomalyConfig:
    def steps(low: int) -> config_values.Parse[int]:
        return config_values.integer(low, MAX_STEPS)

    factor = config_values.number(low=1.0, low_ok=False, high=1e6, unit="")
    return AnomalyConfig(
        enabled=sec.optional("enabled", config_values.boolean),
        nonfinite=sec.optional("nonfinite", config_values.boolean),
        loss_spike_factor=sec.optional("loss_spike_factor", factor),
        loss_window_steps=sec.optional("loss_window_steps", steps(5)),
        loss_patience_steps=sec.optional("loss_patience_steps", steps(1)),
        warmup_steps=sec.optional("warmup_steps", steps(0)),
        grad_norm_spike_factor=sec.optional("grad_norm_spike_factor", factor),
        straggler_ratio=sec.optional("straggler_ratio", factor),
        straggler_patience_steps=sec.optional("straggler_patience_steps", steps(1)),
        drift_ratio=sec.optional("drift_ratio", factor),
        rollback_margin_steps=sec.optional("rollback_margin_steps", steps(0)),
        skip_extra_steps=sec.optional("skip_extra_steps", steps(0)),
        detection_window_steps=sec.optional("detection_window_steps", steps(0)),
        max_rollbacks=sec.optional("max_rollbacks", config_values.integer(0, 1_000_000)),
        rollback_window_s=sec.optional("rollback_window_s", config_values.seconds()),
    )
