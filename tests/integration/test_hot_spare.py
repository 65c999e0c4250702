"""A hot spare on 127.0.0.1: three supervisors of one job (`nnodes: "2:2"`, c10d rendezvous, one rank each), two
active and one standby. Node B is killed whole (its supervisor, torchrun and rank); the standby takes its slot at the
next round, the world size stays 2, and the job finishes with every step's samples once and in order.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import subprocess
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import yaml

from ftsup import procs as ftprocs
from ftsup.store import layout
from ftsup.supervisor.cli.commands import main
from ftsup.tools.faults.invariants import sample_ids
from tests.integration.test_multinode import lines, node_config, start
from tests.procs import free_port, kill_tree, wait_for

pytestmark = pytest.mark.multiprocess

# 18 s at 0.15 s a step at least: long enough for the spare to start and wait while A and B train (on a quiet 2-core
# host it waited 3 s after their first step, and B was killed at step 21)
STEPS = 120


def spare_config(tmp: Path, node: str, port: int, *, standby: bool) -> Path:
    path = node_config(tmp, node, port, run_id="spare-test")
    cfg = yaml.safe_load(path.read_text())
    cfg["launch"].update(nnodes="2:2", standby=standby)
    command = cfg["job"]["command"]
    command[command.index("--steps") + 1] = str(STEPS)
    command += ["--sample-log", str(tmp / "samples-{rank}.jsonl")]
    path.write_text(yaml.safe_dump(cfg))
    return path


def events(tmp: Path, node: str) -> list[dict]:
    return lines(tmp / node / "logs" / "supervisor.jsonl")


def named(tmp: Path, node: str, name: str) -> list[dict]:
    return [e for e in events(tmp, node) if e["event"] == name]


def view(tmp: Path, node: str) -> dict:
    path = tmp / node / "node-health.json"
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}


def spares(port: int, rdzv_id: str) -> int | None:
    """The nodes in the redundancy list of the rendezvous (the c10d store's state, as torchrun's own backend reads
    it); None while the store cannot be read."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    try:
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
        got = C10dRendezvousBackend(store, rdzv_id).get_state()
    except (RuntimeError, TimeoutError, ValueError, OSError):
        return None
    return None if got is None else len(pickle.loads(got[0]).redundancy_list)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The job, run once: A and B train together, C waits as a spare, B is killed whole, C takes its place."""
    tmp = tmp_path_factory.mktemp("spare")
    port = free_port()
    procs: dict[str, subprocess.Popen] = {}
    out: dict = {"tmp": tmp}
    seen: dict[int, psutil.Process] = {}  # every process of the job seen on the way

    def sample() -> None:
        seen.update((p.pid, p) for p in ftprocs.descendants(x.pid for x in procs.values()))

    try:
        for node in ("node-a", "node-b"):
            procs[node] = start(spare_config(tmp, node, port, standby=False), tmp / f"{node}.out")
        wait_for(lambda: any(j["world_size"] == 2 for j in lines(tmp / "loss.jsonl")), 120, "A and B never trained")
        procs["node-c"] = start(spare_config(tmp, "node-c", port, standby=True), tmp / "node-c.out")
        wait_for(lambda: view(tmp, "node-c").get("standby") == "waiting", 60, "C never launched as a spare")
        wait_for(lambda: spares(port, "spare-test") == 1, 120, "C never waited in the round as a spare")
        with contextlib.redirect_stdout(io.StringIO()) as said:
            out["c_nodes_exit"] = main(["nodes", "--config", str(tmp / "node-c.yaml")])
        out["c_nodes_while_waiting"] = said.getvalue()
        sample()
        out["step_when_c_waited"] = max(j["step"] for j in lines(tmp / "loss.jsonl"))
        wait_for(
            lambda: (i := layout.latest_consistent(tmp / "ckpt")) is not None and i.step >= out["step_when_c_waited"],
            120,
            "no checkpoint while C waited",
        )
        out["a_launches_before_kill"] = len(named(tmp, "node-a", "workers_launched"))
        saved = layout.latest_consistent(tmp / "ckpt")
        assert saved is not None
        out["saved_before_kill"] = saved.step
        kill_tree(procs["node-b"].pid)  # the supervisor, its torchrun and its rank, at once
        procs["node-b"].wait(timeout=10)
        wait_for(lambda: named(tmp, "node-c", "standby_joined"), 180, "the spare never joined")
        sample()
        out["a_exit"] = procs["node-a"].wait(timeout=300)
        out["c_exit"] = procs["node-c"].wait(timeout=60)
        out["left"] = sorted(p.pid for p in seen.values() if ftprocs.alive(p))
    finally:
        for p in procs.values():
            kill_tree(p.pid)
            p.wait(timeout=10)
    out["outputs"] = {n: (tmp / f"{n}.out").read_text()[-3000:] for n in procs}
    yield out


def test_both_remaining_nodes_finish_the_job_and_leave_nothing_running(run: dict) -> None:
    assert (run["a_exit"], run["c_exit"], run["left"]) == (0, 0, []), run["outputs"]


def test_the_spare_waited_without_disturbing_the_two_nodes_training(run: dict) -> None:
    tmp = run["tmp"]
    assert (run["c_nodes_exit"], "hot spare: waiting in the rendezvous" in run["c_nodes_while_waiting"]) == (0, True)
    assert run["a_launches_before_kill"] == 1  # C's wait in the rendezvous never restarted A and B
    before = [j for j in lines(tmp / "loss.jsonl") if j["step"] <= run["saved_before_kill"]]
    assert {j["world_size"] for j in before} == {2}


def test_the_spare_took_the_lost_nodes_slot_and_the_world_size_stayed_two(run: dict) -> None:
    tmp = run["tmp"]
    assert len(named(tmp, "node-c", "standby_released")) >= 1  # the round it waited on ended with B
    joined = named(tmp, "node-c", "standby_joined")
    assert len(joined) == 1 and joined[0]["world_size"] == 1  # its one rank
    after = [j for j in lines(tmp / "loss.jsonl") if j["step"] > run["saved_before_kill"]]
    assert after and {j["world_size"] for j in after} == {2}
    launches = named(tmp, "node-a", "workers_launched")
    assert len(launches) >= 2 and launches[-1]["resume_step"] is not None  # A relaunched from a checkpoint


def test_every_step_trained_once_on_the_samples_that_follow(run: dict) -> None:
    final = {j["step"]: j for j in lines(run["tmp"] / "loss.jsonl")}  # the last time each step was trained
    assert sorted(final) == list(range(1, STEPS + 1))
    assert [final[s]["samples"] for s in sorted(final)] == [12 * s for s in range(1, STEPS + 1)]


def test_every_sample_was_trained_once_across_the_lost_node_and_the_spare(run: dict) -> None:
    tmp = run["tmp"]
    ids = sample_ids(tmp / "loss.jsonl", sorted(tmp.glob("samples-*.jsonl")))  # as the last attempt of each step
    trained = [i for step in range(1, STEPS + 1) for i in ids[step]]
    assert ([len(ids[s]) for s in range(1, STEPS + 1)], len(set(trained))) == ([12] * STEPS, 12 * STEPS)


def test_the_spares_wait_counted_no_failure_and_its_checks_passed(run: dict) -> None:
    tmp = run["tmp"]
    failed = {"restart_scheduled", "worker_exited", "startup_timed_out", "job_failed"}
    assert [e["event"] for e in events(tmp, "node-c") if e["event"] in failed] == []
    assert [e["healthy"] for e in named(tmp, "node-c", "node_checked")][:1] == [True]


def test_the_lost_peer_is_not_put_on_the_node_that_survived_it(run: dict) -> None:
    assert named(run["tmp"], "node-a", "node_fault_recorded") == []
