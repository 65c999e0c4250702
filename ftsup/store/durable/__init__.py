"""The durable tier: committed checkpoints copied off the machine, to object storage or a shared filesystem.

The contract every backend meets is `tier` (re-exported here); the backends are `s3` (with `s3list`, `s3upload`,
`s3nodes`; boto3, the `durable` extra) and `fs`. `open_tier` opens the one a location names.
"""

from __future__ import annotations

from ftsup.store.durable.tier import (
    BODY_PAUSE_S,
    MAX_PARTS,
    MAX_TIMEOUT_S,
    MIB,
    MIN_PART_BYTES,
    READ_CHUNK_BYTES,
    READ_PIECE_BYTES,
    DurableListing,
    DurableOptions,
    DurableTier,
    LocalCheckpoint,
    Location,
    PartHook,
    PauseHook,
    PieceHook,
    UploadReport,
    blocks_problem,
    check_blocks,
    clean_name,
    composite_etag,
    data_token,
    is_token,
    parse_location,
    part_plan,
    part_size,
    read_local,
    run_all,
)

__all__ = [
    "BODY_PAUSE_S",
    "DurableListing",
    "DurableOptions",
    "DurableTier",
    "LocalCheckpoint",
    "Location",
    "MAX_PARTS",
    "MAX_TIMEOUT_S",
    "MIB",
    "MIN_PART_BYTES",
    "PartHook",
    "PauseHook",
    "PieceHook",
    "READ_CHUNK_BYTES",
    "READ_PIECE_BYTES",
    "UploadReport",
    "blocks_problem",
    "check_blocks",
    "clean_name",
    "composite_etag",
    "data_token",
    "is_token",
    "open_tier",
    "parse_location",
    "part_plan",
    "part_size",
    "read_local",
    "run_all",
]


def open_tier(url: str, options: DurableOptions | None = None) -> DurableTier:
    """The backend of the tier `url` names. An `s3://` one imports boto3 (the `durable` extra): without it,
    MissingExtraError names the extra."""
    location = parse_location(url)
    options = options or DurableOptions()
    if location.is_s3:
        from ftsup.store.durable import s3  # boto3 is imported only for a tier on object storage

        return s3.S3Tier(location, options)
    from ftsup.store.durable import fs as durable_fs

    return durable_fs.FilesystemTier(location, options)
