"""`ftsup bench node-loss`, run small for real: the two ftsup contenders (the peer-memory tier; the durable tier on
the SeaweedFS the command starts), 130 steps, one loss of node B (killed whole, its disk and memory wiped) 11 s
after both nodes first trained together (by then at most step 113: steps last at least 0.1 s), a replacement 1 s
later that the survivor waits for (`--nnodes 2:2`: one restart, reading B's part from A's memory or from the
durable tier). The torchrun contender's command line is a unit test's (tests/unit/test_bench_node_loss.py): its run
would double this one's CPU time.
"""

from __future__ import annotations

import math
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from ftsup.tools.bench.goodput.account import CAUSES
from tests.procs import kill_tree, run, wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

STEPS = 130
NAMES = ["ftsup-peers", "ftsup-durable"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import json

    work = tmp_path_factory.mktemp("bench-node-loss")
    out = work / "out.json"
    argv = [sys.executable, "-m", "ftsup.supervisor.cli", "bench", "node-loss", "--contenders", ",".join(NAMES)]
    argv += ["--steps", str(STEPS), "--ckpt-every", "5", "--losses", "1", "--mean-interval-s", "6"]
    argv += ["--replace-s", "1", "--nnodes", "2:2", "--timeout-s", "240", "--dir", str(work / "d"), "--json", str(out)]
    done = run(argv, timeout=600)
    data = json.loads(out.read_text()) if out.exists() else None
    return {"rc": done.returncode, "output": done.output, "data": data, "work": work}


def rows(bench: dict[str, Any]) -> dict[str, dict[str, Any]]:
    assert bench["data"] is not None, bench["output"]
    return {r["name"]: r for r in bench["data"]["results"]}


def left_under(path: Path) -> list[str]:
    """Live processes whose command line or environment mentions `path`."""
    out = []
    for p in psutil.process_iter(["cmdline", "environ"], ad_value=None):
        text = " ".join(p.info["cmdline"] or ()) + " ".join((p.info["environ"] or {}).values())
        if str(path) in text:
            out.append(f"{p.pid}: {text[:200]}")
    return out


def test_the_benchmark_exits_0_with_a_row_for_each_contender_in_order(bench: dict[str, Any]) -> None:
    names = [r["name"] for r in (bench["data"] or {}).get("results", [])]
    assert (bench["rc"], names) == (0, NAMES), bench["output"][-4000:]


def test_each_contender_met_one_loss_and_completed_its_job(bench: dict[str, Any]) -> None:
    got = {n: (r["completed"], r["losses_delivered"], r["orphans"]) for n, r in rows(bench).items()}
    assert got == dict.fromkeys(NAMES, (True, 1, [])), bench["output"][-4000:]


def test_the_peer_contender_resumed_from_the_peers_memory_and_the_other_from_the_durable_tier(
    bench: dict[str, Any],
) -> None:
    got = {n: r["resume_tiers"] for n, r in rows(bench).items()}
    # the durable contender's survivor may read its own part from its disk (`fast`): B's comes from the store
    assert (got["ftsup-peers"], "durable" in got["ftsup-durable"], "peers" in got["ftsup-durable"]) == (
        ["peers"],
        True,
        False,
    ), bench["output"][-4000:]


def test_neither_contender_started_over_after_the_loss(bench: dict[str, Any]) -> None:
    for r in rows(bench).values():
        [loss] = r["losses"]
        assert loss["first_step"] is not None and loss["first_step"] > 1, r["losses"]


def test_every_second_of_each_run_is_productive_or_badput_of_one_of_the_shared_causes(bench: dict[str, Any]) -> None:
    for r in rows(bench).values():
        total = r["productive_s"] + sum(r["badput_s"].values())
        assert (list(r["badput_s"]), math.isclose(total, r["wall_s"], abs_tol=0.01)) == (list(CAUSES), True), r


def test_the_table_and_the_json_carry_the_check_of_the_peer_tier_against_the_durable_one(bench: dict[str, Any]) -> None:
    check = (bench["data"] or {}).get("checks", {}).get("peers_over_ftsup_durable", {})
    assert (sorted(check), "peers_over_ftsup_durable:" in bench["output"]) == (["completed", "margin", "pass"], True)


def test_nothing_the_benchmark_started_is_left_running(bench: dict[str, Any]) -> None:
    assert left_under(bench["work"]) == []


def test_sigterm_to_the_benchmark_stops_its_store_and_both_nodes_and_leaves_nothing(tmp_path: Path) -> None:
    work = tmp_path / "d"
    argv = [sys.executable, "-m", "ftsup.supervisor.cli", "bench", "node-loss", "--contenders", "ftsup-durable"]
    argv += ["--steps", "3000", "--mean-interval-s", "600", "--dir", str(work)]
    bench = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(list((work / "ftsup-durable").glob("*-b-1.out"))) == 1, 120, "node B never started")
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        kill_tree(bench.pid)
        bench.wait(timeout=30)
    assert left_under(work) == []
