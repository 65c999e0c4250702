"""An upload to a durable tier beside a benchmark's ranks, run as the supervisor runs it: `python -m
ftsup.tools.bench.checkpoint.upload_beside`, in a session of its own, the tier's `Uploader` at `UPLOAD_NICE`,
driven by rank 0 of the durable stall rows (`durable_stall`) with lines of JSON (`main`). Never imports torch.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from typing import Any

from ftsup.store import durable
from ftsup.store.errors import CheckpointError
from ftsup.supervisor.durable.hold import MAX_HOLD_S
from ftsup.supervisor.durable.keeper import UPLOAD_NICE
from ftsup.supervisor.durable.upload import Outcome, Uploader

WAIT_S = 600.0  # the longest one upload may take before it is reported dropped


def _say(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


class _Watched(durable.DurableTier):
    """The tier, saying when the uploader's first part has been sent (everything else passed through)."""

    def __init__(self, tier: durable.DurableTier) -> None:
        self.inner = tier
        self.location = tier.location
        self.options = tier.options
        self.first = threading.Event()

    def upload(
        self,
        ckpt_dir: Any,
        *,
        on_part: durable.PartHook | None = None,
        node: str | None = None,
        pause: durable.PauseHook | None = None,
    ) -> durable.UploadReport:
        def hook(rel: str, number: int) -> None:
            if not self.first.is_set():
                self.first.set()
                _say(event="sending")
            if on_part is not None:
                on_part(rel, number)

        return self.inner.upload(ckpt_dir, on_part=hook, node=node, pause=pause)

    def list_checkpoints(self, *, deep: bool = False) -> durable.DurableListing:
        return self.inner.list_checkpoints(deep=deep)

    def inspect(self, step: int, *, deep: bool = False) -> Any:
        return self.inner.inspect(step, deep=deep)

    def manifest(self, step: int) -> Any:
        return self.inner.manifest(step)

    def read_range(self, step: int, token: str, rel: str, offset: int, length: int) -> bytes:
        return self.inner.read_range(step, token, rel, offset, length)

    def delete(self, step: int) -> int:
        return self.inner.delete(step)


def _one(path: str, url: str, options: durable.DurableOptions, hold_s: float) -> None:
    done = threading.Event()
    outcomes: list[Outcome] = []

    def finished(o: Outcome) -> None:
        outcomes.append(o)
        done.set()

    step = durable.read_local(path).manifest.step
    with durable.open_tier(url, options) as tier:
        watched = _Watched(tier)
        start = time.monotonic()
        uploader = Uploader(
            watched, on_outcome=finished, nice=UPLOAD_NICE, backoff_initial_s=0.5, backoff_max_s=2.0, hold_s=hold_s
        )
        try:
            uploader.submit(path)
            if not done.wait(WAIT_S):
                _say(event="dropped", error=f"not committed within {WAIT_S:.0f}s")
            elif outcomes[0].committed and outcomes[0].report is not None:
                _say(event="committed", seconds=time.monotonic() - start, bytes=outcomes[0].report.bytes_sent)
            else:
                _say(event="dropped", error=outcomes[0].error)
        finally:
            uploader.close()
            with contextlib.suppress(CheckpointError):  # a dropped upload committed nothing to delete
                tier.delete(step)
    _say(event="clean")


def main() -> int:
    """One command per line of standard input, for example

        {"upload": "/path/step-000001003", "url": "s3://bucket/prefix", "part_bytes": 16777216, "concurrency": 8}

    opens the tier at `url` with those options, submits the committed checkpoint to a new uploader and answers, on
    standard output, `{"event": "sending"}` once its first part is sent, then `{"event": "committed", "seconds": S,
    "bytes": B}` (or `{"event": "dropped", "error": E}`); then the step is deleted from the tier again and
    `{"event": "clean"}` ends the command. End of input ends the process."""
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            command = json.loads(line)
            options = durable.DurableOptions(
                part_bytes=int(command["part_bytes"]), concurrency=int(command["concurrency"])
            )
            _one(str(command["upload"]), str(command["url"]), options, float(command.get("hold_s", MAX_HOLD_S)))
        except Exception as e:  # noqa: BLE001 - reported to the rank that asked; the next command still runs
            _say(event="dropped", error=f"{type(e).__name__}: {e}")
            _say(event="clean")
    return 0


if __name__ == "__main__":
    sys.exit(main())
