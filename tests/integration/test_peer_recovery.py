"""A node lost whole, recovered from its peer's memory: two supervisors on 127.0.0.1 (`nnodes: "2:2"`, one rank
each), each node with its own disk and memory directories and no durable tier. Node B is killed whole (its
supervisor, torchrun and rank) and its directories wiped; a fresh node B with the same config joins, and the job
resumes from A's replica of B's part, its losses bitwise those of an uninterrupted run at the same world size.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ftsup.store import layout
from tests.integration.test_multinode import lines, node_config, start
from tests.procs import free_port, kill_tree, wait_for

pytestmark = pytest.mark.multiprocess

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
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    out: dict = {}
    procs: list[subprocess.Popen] = []
    try:
        ref = tmp_path_factory.mktemp("reference")
        port = free_port()
        both = [start(config(ref, n, port), ref / f"{n}.out") for n in ("node-a", "node-b")]
        procs += both
        out["reference_exit"] = [p.wait(timeout=300) for p in both]
        out["reference"] = ref

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
