"""Progress lost, said aloud, pure: a relaunch that starts behind the steps earlier attempts reported, and an
eviction of a script that has no emergency save (docs/design/policy.md, Progress lost).
"""

from __future__ import annotations

from ftsup.supervisor.policy.events import Action, log

NO_EMERGENCY_SAVE = (
    "the script has no emergency save (it sends no heartbeats, so it cannot be asked for one): the steps since its "
    "own last checkpoint are lost"
)


def lost_steps(resume_step: int | None, best_step: int) -> tuple[int, int] | None:
    """The steps a launch from `resume_step` (None: a fresh start) trains again, after `best_step` was reported by
    an earlier attempt: (first, last), or None when it starts at or past it."""
    first = (resume_step or 0) + 1
    return (first, best_step) if best_step >= first else None


def on_launch(attempt: int, resume_step: int | None, best_step: int) -> list[Action]:
    """`progress_lost` when attempt `attempt` starts behind `best_step`: a warning when it starts from scratch (the
    script keeps no checkpoint that ftsup knows of), else the steps after its checkpoint, to be trained again."""
    steps = lost_steps(resume_step, best_step)
    if steps is None:
        return []
    start = "from scratch" if resume_step is None else f"from the checkpoint of step {resume_step}"
    why = (
        f"attempt {attempt} starts {start}, behind step {best_step} that earlier attempts reported: "
        f"steps {steps[0]}-{steps[1]} are lost and trained again"
    )
    return [
        log(
            "progress_lost",
            "warning" if resume_step is None else "info",
            attempt=attempt,
            step=resume_step or 0,
            resume_step=resume_step,
            best_step=best_step,
            lost_steps=list(steps),
            reason=why,
        )
    ]
