"""`checkpoint.durable:` the durable tier, where copies of some committed checkpoints outlive the machine.

`DurableConfig` is the key's value, `parse_durable` reads it or raises one `ConfigError` naming the key; no I/O
(docs/design/config.md, The durable tier's key).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ftsup.store import durable, layout, retention
from ftsup.store.errors import CheckpointError
from ftsup.supervisor.config import values as config_values
from ftsup.supervisor.config.values import Section, Where

MAX_EVERY = 10**9
MAX_PART_BYTES = 5 << 30  # S3's largest part
DEFAULT_HOLD_S = 30.0
MAX_HOLD_S = 3600.0
MAX_S = durable.MAX_TIMEOUT_S
_DEFAULT_OPTIONS = durable.DurableOptions()


@dataclass(frozen=True)
class DurableConfig:
    """`checkpoint.durable:` copies of committed checkpoints on object storage or a shared filesystem, uploaded
    by the supervisor off the training path (never by the ranks)."""

    url: str
    """Where: `s3://BUCKET/PREFIX` (any S3-compatible store) or an absolute path on a shared filesystem. Required.
    The ranks see it as FTSUP_CHECKPOINT_DURABLE."""
    endpoint_url: str | None = None
    """The S3 endpoint (`http(s)://host:port`); null takes the standard AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL,
    else AWS's own. Given, the ranks get it as AWS_ENDPOINT_URL_S3. Credentials never come from this file."""
    periodic_every: int = 1
    """Every Nth periodic checkpoint (as this supervisor sees them committed) goes durable; 0: none."""
    emergency: bool = True
    """Every emergency checkpoint (an eviction's save) goes durable; an eviction then exits 5 once it is."""
    final: bool = True
    """The final checkpoint (the end of training) goes durable."""
    keep_last: int = retention.RetentionPolicy().keep_last
    """Durable retention: keep this many of the tier's newest consistent checkpoints, and always the newest one,
    the pinned ones and the history a rollback needs (as the fast tier's retention does)."""
    part_bytes: int = _DEFAULT_OPTIONS.part_bytes
    """The size of an upload's parts in bytes (a multiple of 65536, at least 5 MiB)."""
    concurrency: int = _DEFAULT_OPTIONS.concurrency
    """Parts in flight at once."""
    hold_while_saving_s: float = DEFAULT_HOLD_S
    """While a save is in progress in this node's fast tier, an upload (but an emergency checkpoint's) waits, for at
    most this many seconds per save: training saves get the disk and the CPU to themselves. 0: never waits."""
    request_timeout_s: float = _DEFAULT_OPTIONS.request_timeout_s
    """The longest one request to the tier may take, from its connection to its answer's last byte: a store that
    answers a byte at a time fails the request then (retried as a timeout is)."""
    operation_timeout_s: float = _DEFAULT_OPTIONS.operation_timeout_s
    """The longest one read of the tier may take as a whole (a listing with its checks, a deletion). A rank's read of
    one durable checkpoint gets at most half of heartbeat.save_timeout_s (FTSUP_CHECKPOINT_DURABLE_TIMEOUT_S), after
    which the load passes over to the next newest checkpoint."""
    fallback_dir: str | None = None
    """Where the ranks write an eviction's emergency checkpoint again when `checkpoint.dir` refuses it (full, gone,
    read-only): an absolute path on another filesystem (one every node sees, where the nodes share `dir`). From there
    it goes to this tier before the exit, which is 8 when it does not make it. Null: no second try. The ranks see it
    as FTSUP_CHECKPOINT_FALLBACK_DIR."""

    @property
    def is_s3(self) -> bool:
        return self.url.startswith("s3://")

    def options(self) -> durable.DurableOptions:
        """The tier's options (`ftsup.store.durable.DurableOptions`)."""
        return durable.DurableOptions(
            endpoint_url=self.endpoint_url,
            part_bytes=self.part_bytes,
            concurrency=self.concurrency,
            request_timeout_s=self.request_timeout_s,
            operation_timeout_s=self.operation_timeout_s,
        )

    def wants(self, kind: str | None) -> bool:
        """Whether a checkpoint of this kind can go durable at all (periodic ones: every Nth of them)."""
        return {"periodic": self.periodic_every > 0, "emergency": self.emergency, "final": self.final}.get(
            str(kind), False
        )


def parse_durable(value: object, where: Where) -> DurableConfig | None:
    """`checkpoint.durable` as given: null (no tier), a location string, or a mapping of the keys above."""
    if value is None:
        return None
    if isinstance(value, str):
        value = {"url": value}
    if not isinstance(value, Mapping):
        where.fail(
            f"expected a location such as s3://BUCKET/PREFIX or a mapping with url, got {config_values.describe(value)}"
        )
    sec = Section(where, value, DurableConfig)
    url = sec.required("url", _location, "give s3://BUCKET/PREFIX or an absolute path on a shared filesystem")
    config = DurableConfig(
        url=url,
        endpoint_url=sec.nullable("endpoint_url", config_values.url),
        periodic_every=sec.optional("periodic_every", config_values.integer(0, MAX_EVERY)),
        emergency=sec.optional("emergency", config_values.boolean),
        final=sec.optional("final", config_values.boolean),
        keep_last=sec.optional("keep_last", config_values.integer(1, MAX_EVERY)),
        part_bytes=sec.optional("part_bytes", config_values.integer(durable.MIN_PART_BYTES, MAX_PART_BYTES)),
        concurrency=sec.optional("concurrency", config_values.integer(1, 256)),
        hold_while_saving_s=sec.optional(
            "hold_while_saving_s", config_values.number(low=0.0, low_ok=True, high=MAX_HOLD_S)
        ),
        request_timeout_s=sec.optional("request_timeout_s", config_values.number(low=0.0, low_ok=False, high=MAX_S)),
        operation_timeout_s=sec.optional(
            "operation_timeout_s", config_values.number(low=0.0, low_ok=False, high=MAX_S)
        ),
        fallback_dir=sec.nullable("fallback_dir", _absolute_path),
    )
    if config.fallback_dir is not None and not config.emergency:
        sec.fail(
            "fallback_dir",
            "an emergency checkpoint written there is kept only once it is durable, and emergency is false; "
            "set emergency: true or remove fallback_dir",
        )
    if config.part_bytes % layout.CHECKSUM_BLOCK_BYTES:
        block = layout.CHECKSUM_BLOCK_BYTES
        sec.fail(
            "part_bytes",
            f"{config.part_bytes} is not a multiple of {block} (the checksum block); write "
            f"{config.part_bytes // block * block or block}",
        )
    if config.endpoint_url is not None and not config.is_s3:
        sec.fail(
            "endpoint_url",
            f"an endpoint is for an s3:// tier, and url {config.url!r} is a filesystem path; "
            "remove endpoint_url or give an s3:// url",
        )
    return config


def _location(value: object, where: Where) -> str:
    text = config_values.string(value, where).strip()
    if "${" in text or text.startswith("~"):
        where.fail(f"{text!r}: neither '~' nor environment variables are expanded here; write the location itself")
    try:
        return durable.parse_location(text).url
    except CheckpointError as e:
        why = str(e).removeprefix("durable tier ")
    where.fail(f"{why}; write s3://BUCKET/PREFIX or an absolute path")


def _absolute_path(value: object, where: Where) -> str:
    text = str(config_values.path(Path("/"))(value, where))
    if not config_values.string(value, where).startswith("/"):
        where.fail(f"{value!r}: write an absolute path (it is used on every node as it is written)")
    return text
