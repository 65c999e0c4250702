"""A node lost whole, recovered from its peer's memory: two supervisors on 127.0.0.1 (`nnodes: "2:2"`, one rank
each), each node with its own disk and memory directories and no durable tier. Node B is killed whole (its
supervisor, torchrun and rank) and its directories wiped; a fresh node B with the same config joins, and the job
resumes from A's replica of B's part, its losses bitwise those of an uninterrupted run at the same world size.
Then the same after an eviction of B (5 s to go, a durable tier nothing answers at): its emergency checkpoint is in
A's memory before B is lost, and the job resumes from it on a fresh B with no step lost.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ftsup.store import layout
from tests.integration.test_multinode import lines, node_config, start
from tests.procs import free_port, kill_tree, run, wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

STEPS = 40


def config(tmp: Path, node: str, port: int) -> Path:
    checkpoint = {
        "dir": str(tmp / node / "disk"),
        "dir_shared": False,
        "memory": {"dir": str(tmp / node / "memory"), "replicas": 1, "keep_last": 2},
    }
    path = node_config(tmp, node, port, run_id="peer-test", checkpoint=checkpoint)
    cfg = yaml.safe_load(path.read_text())
    cfg["launch"]["nnodes"] = "2:2"
    cfg["job"]["state_dir"] = str(tmp / node / "state")
    command = cfg["job"]["command"]
    command[command.index("--steps") + 1] = str(STEPS)
    path.write_text(yaml.safe_dump(cfg))
    return path


def replicated(tmp: Path, holder: str, of: str) -> int:
    """The newest step of `of`'s part that `holder`'s memory holds committed (0: none)."""
    steps = [s for s, _ in layout.committed_dirs(tmp / holder / "memory" / "peers" / of)]
    return max(steps, default=0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The uninterrupted run at the same world size, whose losses every test of the module compares against."""
    ref = tmp_path_factory.mktemp("reference")
    port = free_port()
    both = [start(config(ref, n, port), ref / f"{n}.out") for n in ("node-a", "node-b")]
    try:
        yield {"exit": [p.wait(timeout=300) for p in both], "tmp": ref}
    finally:
        for p in both:
            kill_tree(p.pid)
            p.wait(timeout=10)


@pytest.fixture(scope="module")
def runs(reference: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    out: dict = {"reference_exit": reference["exit"], "reference": reference["tmp"]}
    procs: list[subprocess.Popen] = []
    try:
        tmp = tmp_path_factory.mktemp("lost")
        port = free_port()
        a = start(config(tmp, "node-a", port), tmp / "node-a.out")
        b = start(config(tmp, "node-b", port), tmp / "node-b.out")
        procs += [a, b]
        wait_for(lambda: replicated(tmp, "node-a", "node-b") >= 8, 180, "A never held a replica of B's part")
        kill_tree(b.pid)  # the supervisor, its torchrun and its rank, at once
        b.wait(timeout=10)
        out["replica_step"] = replicated(tmp, "node-a", "node-b")
        shutil.rmtree(tmp / "node-b")  # its disk, its memory, its state: a new machine
        b2 = start(config(tmp, "node-b", port), tmp / "node-b2.out")
        procs.append(b2)
        out["exit"] = [a.wait(timeout=300), b2.wait(timeout=120)]
        out["tmp"] = tmp
    finally:
        for p in procs:
            kill_tree(p.pid)
            p.wait(timeout=10)
    yield out


def test_both_runs_finish(runs: dict) -> None:
    assert (runs["reference_exit"], runs["exit"]) == ([0, 0], [0, 0])


def test_the_lost_node_resumed_from_its_peers_memory_bitwise(runs: dict) -> None:
    tmp = runs["tmp"]
    want = {j["step"]: j["loss_hex"] for j in lines(runs["reference"] / "loss.jsonl")}
    got = {j["step"]: j["loss_hex"] for j in lines(tmp / "loss.jsonl")}  # the last time each step was trained
    assert sorted(want) == list(range(1, STEPS + 1))
    assert got == want
    assert {j["world_size"] for j in lines(tmp / "loss.jsonl")} == {2}
    logs = [
        line for f in (tmp / "node-b" / "state" / "logs").glob("attempt-*.log") for line in f.read_text().splitlines()
    ]
    restored = [line for line in logs if "checkpoint_peer_restored" in line]
    assert restored and all("tier=peers" in line for line in restored), restored
    loaded = [line for line in logs if "checkpoint_loaded" in line]  # nothing on its disk: every byte from A's memory
    assert len(loaded) == 1 and "tier=peers" in loaded[0] and f"step={runs['replica_step']} " in loaded[0], loaded


# The eviction's: a 5 s deadline, and a durable tier no request reaches (nothing listens at its endpoint), so the
# emergency checkpoint never becomes durable; what keeps it is the peer's memory.
EVICTION = {"poll_interval_s": 0.1, "default_deadline_s": 5, "save_margin_s": 1}
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "ftsup-test", "AWS_SECRET_ACCESS_KEY": "ftsup-test", "AWS_REGION": "us-east-1"}


def evicting_config(tmp: Path, node: str, port: int, endpoint: str) -> Path:
    path = config(tmp, node, port)
    cfg = yaml.safe_load(path.read_text())
    cfg["eviction"] = EVICTION
    durable = {"url": "s3://nowhere/job", "endpoint_url": endpoint, "request_timeout_s": 1, "final": False}
    cfg["checkpoint"]["durable"] = durable
    path.write_text(yaml.safe_dump(cfg))
    return path


def trained(tmp: Path) -> int:
    """The newest step the job logged a loss for (0: none yet)."""
    return max((j["step"] for j in lines(tmp / "loss.jsonl")), default=0)


def events(state: Path, name: str) -> list[dict]:
    return [e for e in lines(state / "logs" / "supervisor.jsonl") if e["event"] == name]


@pytest.fixture(scope="module")
def evicted(reference: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Node B told it is evicted (SIGTERM, 5 s to go), then lost whole and replaced by a fresh node B."""
    out: dict = {"reference": reference["tmp"]}
    procs: list[subprocess.Popen] = []
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)  # the supervisors' own, read by their S3 client
    try:
        tmp = tmp_path_factory.mktemp("evicted")
        port, endpoint = free_port(), f"http://127.0.0.1:{free_port()}"
        cfg = {n: evicting_config(tmp, n, port, endpoint) for n in ("node-a", "node-b")}
        a, b = start(cfg["node-a"], tmp / "node-a.out"), start(cfg["node-b"], tmp / "node-b.out")
        procs += [a, b]
        wait_for(lambda: trained(tmp) >= 6, 180, "the job never trained 6 steps")
        b.send_signal(signal.SIGTERM)
        out["b_exit"] = b.wait(timeout=60)
        out["reached"] = trained(tmp)  # every rank stopped at the step the eviction saved
        out["replica_step"] = replicated(tmp, "node-a", "node-b")  # in A's memory before B is lost
        out["b_events"] = {n: events(tmp / "node-b" / "state", n) for n in ("emergency_tiers_reached", "job_stopped")}
        status = [sys.executable, "-m", "ftsup.supervisor.cli", "status", "--config", str(cfg["node-b"]), "--json"]
        out["b_status"] = json.loads(run(status, timeout=60).output)
        kill_tree(b.pid)  # whatever of node B is left
        shutil.rmtree(tmp / "node-b")  # its disk, its memory, its state: a new machine
        b2 = start(cfg["node-b"], tmp / "node-b2.out")
        procs.append(b2)
        out["exit"] = [a.wait(timeout=300), b2.wait(timeout=120)]
        out["tmp"] = tmp
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        for p in procs:
            kill_tree(p.pid)
            p.wait(timeout=10)
    yield out


def test_the_evicted_nodes_checkpoint_reached_its_peers_memory_before_the_node_was_lost(evicted: dict) -> None:
    [tiers], [stopped] = evicted["b_events"]["emergency_tiers_reached"], evicted["b_events"]["job_stopped"]
    assert (evicted["b_exit"], evicted["replica_step"], tiers["step"]) == (5, evicted["reached"], evicted["reached"])
    assert tiers["tiers"][:2] == ["memory", "peers"] and "durable" not in tiers["tiers"], tiers
    assert 0 < tiers["left_s"]["peers"] <= tiers["left_s"]["memory"] <= 5, tiers  # memory first, the peers next
    assert "not the durable tier; it outlives this node's loss" in tiers["reason"], tiers
    assert evicted["b_status"]["last_eviction"]["tiers"] == tiers["tiers"], evicted["b_status"]
    assert stopped["reason"].startswith("evicted: signal:SIGTERM"), stopped


def test_the_job_resumed_on_a_new_node_from_the_step_the_eviction_saved_bitwise(evicted: dict) -> None:
    tmp, reached = evicted["tmp"], evicted["reached"]
    assert evicted["exit"] == [0, 0]
    want = {j["step"]: j["loss_hex"] for j in lines(evicted["reference"] / "loss.jsonl")}
    trained_steps = [j["step"] for j in lines(tmp / "loss.jsonl")]
    assert trained_steps == list(range(1, STEPS + 1))  # the step after the one saved is the next trained: 0 lost
    assert {j["step"]: j["loss_hex"] for j in lines(tmp / "loss.jsonl")} == want
    [rejoined] = events(tmp / "node-a" / "state", "peer_eviction_followed")
    assert rejoined["step"] == reached, rejoined
    for node in ("node-a", "node-b"):  # which tier each rank read: B's part came from A's memory, on both nodes
        logs = "".join(f.read_text() for f in sorted((tmp / node / "state" / "logs").glob("attempt-*.log")))
        loaded = [line for line in logs.splitlines() if "checkpoint_loaded" in line]
        assert len(loaded) == 1 and "tier=peers" in loaded[0] and f"step={reached} " in loaded[0], loaded
