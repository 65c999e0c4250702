"""`ftsup run` with its durable tier behind a lying S3 endpoint (tests/lying_s3.py, SeaweedFS behind it): whatever
the store sends, the supervisor's memory stays within 256 MiB of an honest run's and the job trains throughout; a
restore whose newest durable step trickles passes over to the next one in the same attempt, within twice the save
timeout (ftsup/store/DESIGN.md, "Hostile answers"; docs/evictions-and-durable.md, "A store that misbehaves")."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from ftsup.store import durable, layout
from tests import lying_s3 as lies
from tests.hostile_s3 import Reply, Request
from tests.lying_s3 import LyingS3
from tests.procs import PYTHONPATH, REPO, kill_tree, run, wait_for
from tests.s3fixtures import client
from tests.s3server import SeaweedS3

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

BOUND_MIB = 256
MODEL = ["--n-layer", "1", "--n-embd", "32", "--seq-len", "16", "--corpus-bytes", "50000"]
LISTINGS = ("endless", "huge", "nested", "pages", "trickle", "cut", "error")
# 24 s of training at 0.2 s a step: the uploader meets every lie meanwhile (on a quiet 2-core host the last of them
# came 11 s after the first step)
STEPS = 120


def write_job(tmp: Path, tier: dict[str, Any], *, steps: int, min_step_s: float, **sections: Any) -> Path:
    command = [sys.executable, "-m", "ftsup.trainer.examples.gpt", *MODEL, "--steps", str(steps), "--ckpt-every", "3"]
    command += ["--min-step-s", str(min_step_s), "--loss-log", str(tmp / "loss.jsonl")]
    cfg = {
        "job": {
            "command": command,
            "workdir": str(REPO),
            "state_dir": str(tmp / "state"),
            "env": {"PYTHONPATH": PYTHONPATH},
        },
        "launch": {"nproc_per_node": 1, "warm_agent": False},
        "checkpoint": {"dir": str(tmp / "ckpt"), "durable": tier},
        "restart": {"backoff_initial_s": 0.2, "stop_grace_s": 3},
        **sections,
    }
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start(job: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    argv = [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(job)]
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def events(tmp: Path, name: str) -> list[dict[str, Any]]:
    path = tmp / "state" / "logs" / "supervisor.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e["event"] == name]


def steps_logged(tmp: Path) -> list[int]:
    log = tmp / "loss.jsonl"
    return [json.loads(x)["step"] for x in log.read_text().splitlines()] if log.exists() else []


class PeakMemory:
    """A process's peak resident memory (VmHWM, KiB), read every 0.1 s from /proc until it exits."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                status = Path(f"/proc/{self.pid}/status").read_text()
            except OSError:
                return
            for line in status.splitlines():
                if line.startswith("VmHWM:"):
                    self.kib = max(self.kib, int(line.split()[1]))
            self._stop.wait(0.1)  # a sampling interval

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.kib


class Liar:
    """What the store answers: the truth (`honest`), or a lie for every listing (in turn: a page without end, one
    of 1.5 million names, XML nested a million deep, pages without end, a page a byte at a time, a page cut short,
    an error without end), the first two writes and the first two reads of a manifest."""

    def __init__(self) -> None:
        self.honest = False
        self.store: LyingS3 | None = None
        self._turn = itertools.count()
        self._mode = "endless"
        self._pages = itertools.count(1)
        self._writes = itertools.count()
        self._manifests = itertools.count()
        self.served: set[str] = set()  # the listing lies told so far

    def __call__(self, request: Request) -> Reply | None:
        if self.honest:
            return None
        if lies.is_listing(request):
            if "continuation-token" not in request.query:  # a new listing: the next lie
                self._mode = LISTINGS[next(self._turn) % len(LISTINGS)]
            self.served.add(self._mode)
            return self._listing(request.query.get("prefix", ""))
        if request.method == "PUT" and next(self._writes) < 2:
            return lies.endless_error(500)
        if request.method == "GET" and request.key.endswith("/manifest.json") and next(self._manifests) < 2:
            return lies.endless_object()
        return None

    def _listing(self, prefix: str) -> Reply:
        mode = self._mode
        if mode == "endless":
            return lies.endless_listing(prefix)
        if mode == "huge":
            return lies.huge_listing(prefix, 1_500_000)
        if mode == "nested":
            return lies.nested_listing(1 << 20)
        if mode == "pages":
            return lies.page(prefix, next(self._pages))
        if mode == "trickle":
            assert self.store is not None
            return Reply(200, self.store.trickle(lies.XML_HEAD * 1000, 0.05), {})
        if mode == "cut":
            return lies.truncated(200, lies.XML_HEAD + b"<IsTruncated>false</IsTruncated></ListBucketResult>", 20)
        return lies.endless_error(500)


def supervised_run(tmp: Path, s3_server: SeaweedS3, bucket: str, liar: Liar, steps: int) -> tuple[int, int, set[str]]:
    """(exit status, the supervisor's peak KiB, the listing lies told while the job trained) of a job whose tier is
    behind `liar`, which turns honest once the last step is logged (so that the final checkpoint can be made
    durable)."""
    with LyingS3(s3_server.endpoint, liar) as store:
        liar.store = store
        tier = {"url": f"s3://{bucket}/job", "endpoint_url": store.endpoint, "request_timeout_s": 3}
        proc = start(write_job(tmp, tier, steps=steps, min_step_s=0.2))
        memory = PeakMemory(proc.pid)
        try:
            wait_for(lambda: steps_logged(tmp)[-1:] == [steps] or proc.poll() is not None, 240, "no last step")
            told = set(liar.served)
            liar.honest = True
            status = proc.wait(timeout=240)
        finally:
            kib = memory.stop()
            kill_tree(proc.pid)
    return status, kib, told


def test_the_supervisor_stays_within_256_mib_of_an_honest_run_and_trains_throughout_whatever_the_store_sends(
    bucket: str, s3_server: SeaweedS3, tmp_path: Path
) -> None:
    honest = Liar()
    honest.honest = True
    client(s3_server).create_bucket(Bucket=f"{bucket}-honest")
    code, idle_kib, _ = supervised_run(tmp_path / "honest", s3_server, f"{bucket}-honest", honest, steps=12)
    liar = Liar()
    status, kib, told = supervised_run(tmp_path / "lied-to", s3_server, bucket, liar, steps=STEPS)
    print(f"supervisor peak: {kib // 1024} MiB with the lies ({len(told)} kinds), {idle_kib // 1024} MiB without")
    assert (code, status, steps_logged(tmp_path / "lied-to"), told) == (0, 0, list(range(1, STEPS + 1)), set(LISTINGS))
    assert kib - idle_kib <= BOUND_MIB * 1024
    assert events(tmp_path / "lied-to", "durable_upload_failed")  # uploads waited, training did not


def test_a_restore_whose_newest_durable_step_trickles_resumes_from_the_next_one_within_twice_the_save_timeout(
    bucket: str, s3_server: SeaweedS3, tmp_path: Path
) -> None:
    old = tmp_path / "old-vm"
    trainer = [sys.executable, "-m", "ftsup.trainer.examples.gpt", *MODEL, "--steps", "9", "--ckpt-every", "3"]
    made = run([*trainer, "--ckpt-dir", str(old / "ckpt"), "--loss-log", str(old / "loss.jsonl")], timeout=180)
    assert made.returncode == 0, made.output[-3000:]
    with durable.open_tier(f"s3://{bucket}/job") as tier:
        for step in (3, 6):
            tier.upload(old / "ckpt" / layout.step_dirname(step))

    def trickle_step_6(request: Request) -> Reply | None:
        if request.method == "GET" and "/step-000000006/data-" in request.key and ".safetensors" in request.key:
            assert store_of[0] is not None
            return Reply(206, store_of[0].trickle(b"\0" * 100_000, 0.5), {})
        return None

    save_timeout_s = 20.0  # a load gives up on a checkpoint after half of it (10 s), then reads the next
    store_of: list[LyingS3 | None] = [None]
    new = tmp_path / "new-vm"
    with LyingS3(s3_server.endpoint, trickle_step_6) as store:
        store_of[0] = store
        section = {"url": f"s3://{bucket}/job", "endpoint_url": store.endpoint}
        proc = start(write_job(new, section, steps=9, min_step_s=0.0, heartbeat={"save_timeout_s": save_timeout_s}))
        try:
            wait_for(lambda: events(new, "workers_launched"), 180, "never launched")
            launched = time.monotonic()
            bound = 2 * save_timeout_s
            wait_for(lambda: steps_logged(new) or proc.poll() is not None, bound, f"no step within {bound:g}s")
            resumed_in = time.monotonic() - launched
            status = proc.wait(timeout=180)
        finally:
            kill_tree(proc.pid)
    chosen = [(e["step"], e.get("tier")) for e in events(new, "checkpoint_chosen")]
    print(f"trained from step 4 {resumed_in:.1f} s after the launch; the tier trickled {store.lies} reads")
    assert (status, steps_logged(new)[0], chosen, store.lies >= 1) == (0, 4, [(6, "durable")], True)
