"""`ftsup rollback --config JOB.yaml --to-step N [--skip-samples A:B] [--reason TEXT]`: an operator's rollback.

It checks that step N is a consistent checkpoint of the job's store, then writes the request to
`<state_dir>/rollback.json` for the job's supervisor to serve (docs/cli.md, `ftsup rollback`). Torch-free.
"""

from __future__ import annotations

import argparse
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from ftsup import protocol
from ftsup.store import layout
from ftsup.store.pins import operator
from ftsup.supervisor import statedir
from ftsup.supervisor.cli import status
from ftsup.supervisor.config.job import load_config
from ftsup.supervisor.errors import UsageError
from ftsup.supervisor.policy.anomaly import merge_skips
from ftsup.supervisor.state.rollbacks import FILE_NAME

DESCRIPTION = (
    "Ask the supervisor of JOB.yaml to roll back: stop the running attempt and resume from the checkpoint of step N "
    "(or the newest consistent one before it), never serving the data positions of --skip-samples again (added to "
    "the data skips in force, recorded in every later checkpoint). With no supervisor running, the next `ftsup run` "
    "starts from it. Step N must be a consistent checkpoint. Run it as the job's user."
)


def add_arguments(p: argparse.ArgumentParser, step_number: Callable[[str], int]) -> None:
    p.description = DESCRIPTION
    p.add_argument("--config", required=True, type=Path, metavar="JOB.yaml", help="the job's YAML config")
    p.add_argument("--to-step", required=True, type=step_number, metavar="N", help="the checkpoint to resume from")
    p.add_argument(
        "--skip-samples",
        action="append",
        default=[],
        metavar="A:B",
        help="data positions [A, B) never to serve again (may be given more than once)",
    )
    p.add_argument("--reason", default="", help="why, for the logs and the journal")
    p.set_defaults(handler=cmd_rollback)


def cmd_rollback(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    root = Path(cfg.checkpoint.dir)
    info = layout.find_checkpoint(root, args.to_step)  # NoCheckpointError names the step and the store
    if not info.consistent:
        problems = "; ".join(map(str, info.problems[:3]))
        raise UsageError(
            f"step {args.to_step} in {root} is not a consistent checkpoint ({problems}); "
            "`ftsup ckpt list` shows the ones there are"
        )
    try:
        skips = merge_skips(*(protocol.parse_data_skips(s, "--skip-samples") for s in args.skip_samples))
        skips = protocol.check_data_skips(skips, "--skip-samples")
    except ValueError as e:
        raise UsageError(str(e)) from None
    if len(args.reason) > protocol.MAX_REASON_CHARS or not args.reason.isprintable():
        raise UsageError(f"--reason must be printable text of at most {protocol.MAX_REASON_CHARS} characters")
    state_dir = statedir.ensure_dir(cfg.job.state_dir, "job.state_dir")
    req = protocol.RollbackRequest(secrets.token_hex(8), args.to_step, skips, operator(), args.reason, time.time())
    alive = status.send_request(state_dir, FILE_NAME, protocol.encode_rollback(req), "rollback request")
    skipping = f", skipping {protocol.encode_data_skips(skips)}" if skips else ""
    then = (
        "the running supervisor serves it within a second (`ftsup status` shows it)"
        if alive
        else "no supervisor runs this job now: the next `ftsup run` starts from it"
    )
    print(f"rollback to step {args.to_step}{skipping} requested (id {req.id}): {then}")
    return 0
