"""The durable stall rows, run inside the ranks: the stall of ftsup's async save while the durable tier uploads the
previous checkpoint beside the ranks as the supervisor runs it (`upload_beside`), and of the same save with none,
in pairs whose order alternates (docs/benchmarks.md, "The durable tier against plain S3").
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ftsup import guard
from ftsup.tools.bench.checkpoint import probes
from ftsup.tools.bench.checkpoint.ctx import Ctx, RowFn, RowUnavailable
from ftsup.tools.bench.checkpoint.ftsup_rows import KEEP_LAST, engine_class
from ftsup.tools.bench.checkpoint.peer_rows import total_bytes

UPLOADING, ALONE = "ftsup_async_durable", "ftsup_async_alone"
_SETTLE_S = 10.0
_EVENT_S = 300.0  # the longest rank 0 waits for one answer of the upload process


class _Beside:
    """The upload process beside the ranks (rank 0's), and its answers."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.options = {"part_bytes": int(spec["durable_part_bytes"]), "concurrency": int(spec["durable_concurrency"])}
        env = dict(os.environ)
        guarded, guard_env = guard.wrap([sys.executable, "-m", "ftsup.tools.bench.checkpoint.upload_beside"])
        self.proc = subprocess.Popen(  # dies with this rank; a session of its own, as the supervisor's
            guarded,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**env, **guard_env},
            text=True,
            start_new_session=True,
        )
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except json.JSONDecodeError:
                continue
        self.events.put(None)

    def upload(self, path: Path, url: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"upload": str(path), "url": url, **self.options}) + "\n")
        self.proc.stdin.flush()

    def next(self, wanted: str) -> dict[str, Any]:
        """The next answer, which must be `wanted` (an upload dropped, or the process gone, raises)."""
        try:
            event = self.events.get(timeout=_EVENT_S)
        except queue.Empty:
            raise TimeoutError(f"the upload beside the ranks gave no {wanted!r} within {_EVENT_S:.0f}s") from None
        if event is None:
            raise RuntimeError(f"the upload process ended (exit {self.proc.wait()}) before {wanted!r}")
        if event.get("event") != wanted:
            raise RuntimeError(f"the upload beside the ranks: {event} where {wanted!r} was expected")
        return event

    def running(self) -> bool:
        """Whether the upload in progress has not reported its end yet."""
        return self.events.empty()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _settle(ctx: Ctx, root: Path) -> None:
    """As `ftsup_rows` settles: retention's deletion done (bounded), the page cache written back, then a barrier."""
    if ctx.rank == 0:
        from ftsup.store import layout

        deadline = time.monotonic() + _SETTLE_S
        while len(layout.committed_dirs(root)) > KEEP_LAST and time.monotonic() < deadline:
            time.sleep(0.02)
        os.sync()
    ctx.barrier()


def durable_stall(ctx: Ctx) -> list[str]:
    """Both rows, `ctx.repeats` pairs, after KEEP_LAST + 1 unmeasured saves (the engine's steady state, and a
    committed checkpoint there to upload)."""
    url = ctx.spec.get("durable_url")
    if not url:
        raise RowUnavailable("no --durable tier given")
    from ftsup.store import layout
    from ftsup.trainer.checkpoint import RetentionPolicy

    root = ctx.run_dir / "durable_stall"
    eng = engine_class()(
        root,
        max_in_flight=1,
        retention=RetentionPolicy(keep_last=KEEP_LAST),
        recycle=bool(ctx.spec.get("recycle", True)),
    )
    total = total_bytes(ctx)
    beside = _Beside(ctx.spec) if ctx.rank == 0 else None
    tag = f"{str(url).rstrip('/')}/ftsup-bench-stall-{os.getpid()}-{time.strftime('%Y%m%d%H%M%S')}"
    step = 0
    try:
        for _ in range(KEEP_LAST + 1):
            step += 1
            eng.save(step, ctx.syn.state(), kind="periodic").wait()
        for i in range(ctx.repeats):
            for uploading in (True, False) if i % 2 == 0 else (False, True):
                step += 1
                _settle(ctx, root)
                before = ctx.trainer.time_steps(int(ctx.spec["baseline_steps"]))
                if beside is not None and uploading:
                    newest = max(layout.committed_dirs(root))[1]
                    beside.upload(newest, f"{tag}/step-{step}")
                    beside.next("sending")
                ctx.barrier()
                upload_cpu = probes.process_cpu_s(beside.proc.pid) if beside is not None else None
                start = time.perf_counter()
                handle = eng.save(step, ctx.syn.state(), kind="periodic")
                block = time.perf_counter() - start
                waiter = probes.Waiter(handle.wait, start)
                log = ctx.trainer.run_while(waiter, int(ctx.spec["steps_during"]), before)
                durable_s = waiter.join(float(ctx.spec["save_timeout_s"]))
                fields: dict[str, Any] = {}
                if beside is not None and uploading:
                    if upload_cpu is not None and (now := probes.process_cpu_s(beside.proc.pid)) is not None:
                        fields["upload_cpu_s"] = now - upload_cpu
                    fields["upload_overlapped"] = beside.running()
                    fields["upload_s"] = beside.next("committed")["seconds"]
                    beside.next("clean")
                _settle(ctx, root)
                log.after = ctx.trainer.time_steps(int(ctx.spec["baseline_steps"]))
                ctx.rec.record(
                    UPLOADING if uploading else ALONE,
                    i,
                    stall_s=block + log.extra_s,
                    block_s=block,
                    extra_step_s=log.extra_s,
                    steps_during=len(log.during),
                    baseline_step_s=log.baseline_s,
                    durable_s=durable_s,
                    bytes=total,
                    **fields,
                )
                ctx.barrier()
        eng.wait()
    finally:
        if beside is not None:
            beside.close()
    return [UPLOADING, ALONE]


ROWS: dict[str, RowFn] = {"durable_stall": durable_stall}
