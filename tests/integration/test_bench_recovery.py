"""`ftsup bench recovery`, run small for real (ftsup only: one kill, one hang, 2 fault cycles,
then SIGKILL of the supervisor): the JSON has its documented shape, ftsup recovers from both
faults, and no process is left at any of the three counts.

One module-scoped run serves every claim. torchrun's rows are left out here: its hang row waits
out --hang-wait-s by design.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from ftsup.tools.bench.recovery.common import aim
from tests.procs import REPO, run

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

TIMEOUT_S = 170
ROW_KEYS = {"name", "fault", "detect_s", "recover_s", "lost_steps", "orphans", "split", "note"}
SPLIT_KEYS = {"detection_s", "teardown_s", "backoff_s", "launch_s", "load_s"}


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("bench-recovery")
    out = work / "out.json"
    argv = [sys.executable, "-m", "ftsup.supervisor.cli", "bench", "recovery", "--repeats", "1", "--hang-repeats", "1"]
    argv += ["--cycles", "2", "--peers", "ftsup", "--dir", str(work / "d"), "--json", str(out)]
    done = run(argv, timeout=TIMEOUT_S)
    return {"rc": done.returncode, "output": done.output, "data": json.loads(out.read_text()) if out.exists() else None}


def test_the_benchmark_exits_0_and_writes_results_and_checks(bench: dict[str, Any]) -> None:
    assert (bench["rc"], sorted(bench["data"] or {})) == (0, ["checks", "environment", "results"]), bench["output"]


def test_every_row_has_the_documented_keys_and_ftsup_rows_a_full_split(bench: dict[str, Any]) -> None:
    rows = bench["data"]["results"]
    assert [(r["name"], r["fault"]) for r in rows] == [("ftsup", "kill"), ("ftsup", "hang")]
    assert [(ROW_KEYS <= set(r), set(r["split"])) for r in rows] == [(True, SPLIT_KEYS)] * 2


def test_ftsup_recovers_from_a_kill_and_a_hang_detected_by_their_own_events(bench: dict[str, Any]) -> None:
    rows = bench["data"]["results"]
    got = [(r["fault"], r["recover_s"] is not None, r["samples"][0]["detected_by"]) for r in rows]
    assert got == [("kill", True, "worker_exited"), ("hang", True, "heartbeat_timed_out")], bench["output"]


def test_no_orphans_after_the_cycles_the_supervisor_sigkill_and_the_run(bench: dict[str, Any]) -> None:
    checks = bench["data"]["checks"]
    counts = [
        checks[k]["orphans"] for k in ("orphans_after_cycles", "orphans_after_supervisor_sigkill", "orphans_after_run")
    ]
    assert (counts, [r["orphans"] for r in bench["data"]["results"]]) == ([0, 0, 0], [0, 0]), bench["output"]


def test_a_hang_is_detected_within_the_bound_of_the_issue(bench: dict[str, Any]) -> None:
    hang = bench["data"]["checks"]["hang_detection"]
    assert hang["pass"] is True, hang


def test_the_table_is_printed(bench: dict[str, Any]) -> None:
    assert "name   fault  detect_s  recover_s  lost_steps  orphans" in bench["output"]


def test_ftsup_bench_recovery_does_not_import_torch_or_the_checkpoint_benchmark() -> None:
    probe = (
        "import sys, json\n"
        "from ftsup.supervisor.cli import main\n"
        "try:\n    main(['bench', 'recovery', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    loaded = set(json.loads(done.stdout.splitlines()[-1]))
    assert {"torch", "ftsup.tools.bench.checkpoint"} & loaded == set()


@pytest.mark.parametrize(("at_least", "expected"), [(0, 13), (13, 13), (14, 18), (19, 23)])
def test_faults_are_aimed_three_steps_past_a_checkpoint(at_least: int, expected: int) -> None:
    assert aim(at_least, 5) == expected
