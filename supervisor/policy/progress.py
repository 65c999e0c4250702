"""Progress lost, said aloud, pure: a relaunch that starts behind the steps earlier attempts reported, and an
eviction of a script that has no emergency save (docs/design/policy.md, Progress lost).
"""

from __future__ import annotations

from ftsup.supervisor.policy.events import Action, log

NO_EMERGENCY_SAVE = (
    "the script has no emergency save (it sends no heartbeats, so it cannot be asked for one): the steps since its "
    "own last checkpoint are lost"
)


def on_first_step(attempt: int, first: int, resume_step: int | None, best_before: int) -> list[Action]:
    """`progress_lost` when attempt `attempt`, whose first step reported is `first`, trains again steps that an earlier
    attempt reported (up to `best_before`). Judged from its steps, not from the checkpoint ftsup chose (`resume_step`,
    None for none): a script that resumes from checkpoints of its own shows where it resumed in the steps it counts.
    A warning when it started from scratch, else information: the steps after its checkpoint are trained again."""
    if first > best_before:
        return []
    resumed = first - 1
    if resumed == 0:
        start = "started from scratch"
    elif resume_step == resumed:
        start = f"resumed from the checkpoint of step {resumed}"
    else:
        start = f"resumed at step {resumed}"
    why = (
        f"attempt {attempt} {start}, behind step {best_before} that earlier attempts reported: steps "
        f"{first}-{best_before} are lost and trained again"
    )
    return [
        log(
            "progress_lost",
            "warning" if resumed == 0 else "info",
            attempt=attempt,
            step=resumed,
            resume_step=resume_step,
            best_step=best_before,
            lost_steps=[first, best_before],
            reason=why,
        )
    ]
