"""`ftsup ckpt list|verify s3://BUCKET/PREFIX`: the checkpoints of a durable tier on object storage.

The same output as for a checkpoint directory (`cli_ckpt`: the table, or the JSON objects with the same keys), read
through `ftsup.store.durable`: only committed checkpoints (a manifest object that parses) are listed; the names under
the prefix that are not one (an upload not committed, a name ftsup never writes) are mentioned after the table, or
under "others" in JSON. The endpoint and credentials are the standard AWS ones (`AWS_ENDPOINT_URL_S3`,
`AWS_ACCESS_KEY_ID`, the AWS config files); boto3 comes with the `durable` extra, and without it the command says so
in one line. A durable tier on a shared filesystem is a checkpoint directory: `cli_ckpt` reads it. Pins are the fast
tier's; a durable tier's rows have none.
"""

from __future__ import annotations

import argparse
from typing import Any

from ftsup.store import durable, layout
from ftsup.store.errors import CheckpointError, NoCheckpointError
from ftsup.supervisor import cli_ckpt


def is_tier(location: object) -> bool:
    """Whether a DIR argument names a durable tier on object storage rather than a directory."""
    return isinstance(location, str) and location.startswith("s3://")


def cmd_list(args: argparse.Namespace) -> int:
    with durable.open_tier(args.dir) as tier:
        listed = tier.list_checkpoints(deep=args.deep)
    infos = listed.checkpoints
    if args.json:
        rows = [{**i.to_json(), "pinned": False, "pin": None} for i in infos]
        out: dict[str, Any] = {"checkpoints": rows}
        if listed.others:
            out["others"] = listed.others
        cli_ckpt.print_json(out)
        return cli_ckpt.EXIT_OK
    if not infos:
        print(f"no committed checkpoints under {tier.url}")
    else:
        print(cli_ckpt.checkpoint_table(infos))
        broken = sum(not i.consistent for i in infos)
        check = "deep check (checksums, read back)" if args.deep else "fast check (sizes; --deep: checksums)"
        print(f"\n{len(infos)} committed, {broken} inconsistent; {check}")
    for other in listed.others:
        print(f"not a checkpoint: {other}")
    return cli_ckpt.EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    with durable.open_tier(args.dir) as tier:
        step = args.step
        if step is None:
            committed = [i.step for i in tier.list_checkpoints().checkpoints]
            if not committed:
                raise NoCheckpointError(f"no committed checkpoint under {tier.url}")
            step = max(committed)
        info = tier.inspect(step, deep=args.deep)
        try:
            manifest: layout.Manifest | None = tier.manifest(step)[0]
        except CheckpointError:
            manifest = None
    cli_ckpt.print_verified(info.path, layout.step_dirname(step), step, manifest, info.consistent,
                            list(info.problems), args, deep_means="checksums verified, every byte read back",
                            described=info)  # fmt: skip
    return cli_ckpt.EXIT_OK if info.consistent else cli_ckpt.EXIT_PROBLEM
