"""A node's checks before each attempt and its quarantine: a node that fails a check, or that failures quarantined,
does not join and says why (log, `ftsup status`, `ftsup nodes`); a quarantine outlives its supervisor until it ends
or `ftsup nodes clear` ends it."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from structlog.testing import capture_logs

from ftsup.supervisor import statedir
from ftsup.supervisor.cli.commands import main
from ftsup.supervisor.config.job import load_config
from ftsup.supervisor.config.launch import LaunchConfig
from ftsup.supervisor.errors import ConfigError
from ftsup.supervisor.policy import nodes
from ftsup.supervisor.policy.events import LaunchReady, RankExited, RankFailure, SupervisorPhase, WorkersExited
from ftsup.supervisor.run import nodehealth
from ftsup.supervisor.run.admission import Admission
from ftsup.supervisor.run.daemon import Daemon
from ftsup.supervisor.run.outages import Outages
from ftsup.supervisor.state import nodes as nodefiles
from ftsup.supervisor.telemetry.metrics import Metrics
from tests.procs import wait_for

RUNNING, BACKOFF = SupervisorPhase.RUNNING, SupervisorPhase.BACKOFF
RULES = nodes.Rules(failures=2, window_s=100.0, quarantine_s=50.0)


def config(tmp: Path, **launch: Any) -> Path:
    cfg = {
        "job": {"command": ["true"], "state_dir": str(tmp / "state"), "workdir": str(tmp)},
        "checkpoint": {"dir": str(tmp / "ckpt")},
        "launch": {"nproc_per_node": 1, "node_id": "node-a", **launch},
        "restart": {"backoff_initial_s": 0.5},
    }
    (tmp / "state").mkdir(mode=0o700, exist_ok=True)
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def admission(path: Path, metrics: Metrics | None = None, **kw: Any) -> tuple[Admission, list[tuple[str, dict]]]:
    """An admission of the node of `path`, whose events are said and counted, as the daemon's are."""
    said: list[tuple[str, dict]] = []
    cfg = load_config(path)
    metrics = metrics or Metrics(cfg.job.run_id, cfg.launch.node_id, started_unix=0.0)

    def emit(level: str, event: str, **fields: Any) -> None:
        said.append((event, fields))
        metrics.event(event, fields)

    keeper = Admission(cfg, emit=emit, metrics=metrics, outages=Outages(emit, lambda p: None, time.monotonic), **kw)
    return keeper, said


def events(said: list[tuple[str, dict]], name: str) -> list[dict]:
    return [f for e, f in said if e == name]


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


# ---------------------------------------------------------------------- checks before an attempt


def test_a_node_whose_health_command_fails_is_not_launched_on_and_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sick = "import sys; print('GPU 3 fell off the bus', file=sys.stderr); sys.exit(3)"
    path = config(tmp_path, health_command=[sys.executable, "-c", sick])
    d = Daemon(load_config(path))
    with capture_logs() as logs:
        d.resume.prepare_or_retry(1)
    said = {e["event"]: e for e in logs}
    assert d.pending == []  # nothing for the policy to launch
    assert (said["node_checked"]["healthy"], said["node_checked"]["checks"]["command"]["result"]) == (False, "failed")
    assert 'exited 3: "GPU 3 fell off the bus"' in said["launch_deferred"]["reason"]
    assert d.resume.held_s == 0.5  # it checks again with the restart backoff
    code, out = cli(capsys, "status", "--config", str(path), "--json")
    node = json.loads(out)["node"]
    assert (code, node["healthy"], "GPU 3 fell off the bus" in node["waiting"]) == (0, False, True)
    code, out = cli(capsys, "status", "--config", str(path))
    assert code == 0 and "next attempt waits: node checks failed" in out and "command failed" in out


def test_a_node_that_passes_its_checks_goes_on_to_launch(tmp_path: Path) -> None:
    d = Daemon(load_config(config(tmp_path, health_command=[sys.executable, "-c", "print(0)"])))
    with capture_logs() as logs:
        d.resume.prepare_or_retry(1)
    checked = next(e for e in logs if e["event"] == "node_checked")
    (ready,) = d.pending
    assert isinstance(ready, LaunchReady) and (checked["healthy"], ready.healthy_slots) == (True, 1)


def test_without_nvidia_smi_or_a_device_there_is_no_gpu_to_check(tmp_path: Path) -> None:
    assert nodehealth.gpus(5, which=lambda _: None, dev=tmp_path) == nodes.Check(
        "gpus", "skipped", "no NVIDIA GPU here"
    )


def test_a_device_without_nvidia_smi_is_unknown_never_a_pass(tmp_path: Path) -> None:
    (tmp_path / "nvidia0").touch()
    assert nodehealth.gpus(5, which=lambda _: None, dev=tmp_path).result == "unknown"


def test_an_nvidia_smi_that_fails_fails_the_node(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'Unable to determine the device handle for GPU0: Unknown Error'\nexit 9\n")
    smi.chmod(0o755)
    check = nodehealth.gpus(5, which=lambda _: str(smi), dev=tmp_path)
    assert (check.result, check.detail) == (
        "failed",
        'nvidia-smi exited 9: "Unable to determine the device handle for GPU0: Unknown Error"',
    )


def test_too_little_disk_or_memory_fails_the_node(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 8000000 kB\nMemAvailable:  1024 kB\n")
    assert nodehealth.memory(1 << 20, meminfo).result == "ok"
    assert nodehealth.memory(2 << 20, meminfo).detail == "1.0 MiB available, below 2.0 MiB"
    assert nodehealth.disk("disk_state", tmp_path / "not-yet", 1 << 62).result == "failed"
    assert nodehealth.disk("disk_state", tmp_path, 1).result == "ok"


def test_by_default_only_a_full_disk_fails_a_small_store_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    free = {"bytes": 200 << 20}  # a store on a small tmpfs or under a quota

    class Vfs:
        f_frsize = 4096

        @property
        def f_bavail(self) -> int:
            return free["bytes"] // 4096

    monkeypatch.setattr(nodehealth.os, "statvfs", lambda _: Vfs())
    minimum = LaunchConfig(node_id="n", rdzv_id="r").min_free_disk_bytes
    assert nodehealth.disk("disk_checkpoint", tmp_path, minimum).result == "ok"
    free["bytes"] = 4 << 20
    assert nodehealth.disk("disk_checkpoint", tmp_path, minimum).detail == f"4.0 MiB free in {tmp_path}, below 16.0 MiB"


def test_a_meminfo_without_the_figure_is_unknown(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable: lots\n")
    assert nodehealth.memory(1, meminfo).result == "unknown"


# ---------------------------------------------------------------------- failures put on this node


def crash(rank: int, *output: str, code: int = 1) -> WorkersExited:
    return WorkersExited(7, 1, (RankFailure(rank, rank, 100 + rank, code, tuple(output), root=True),))


def test_a_crash_of_one_of_its_ranks_is_put_on_the_node() -> None:
    (fault,) = nodes.faults(RUNNING, BACKOFF, 7, crash(1, "RuntimeError: CUDA error: an illegal memory access"))
    assert (fault.attempt, fault.local_rank) == (7, 1)


def test_a_rank_that_failed_for_a_lost_peer_puts_nothing_on_the_node() -> None:
    assert (
        nodes.faults(RUNNING, BACKOFF, 7, crash(0, "torch.distributed.DistNetworkError: Connection reset by peer"))
        == []
    )


def test_a_rank_stopped_by_torchrun_puts_nothing_on_the_node() -> None:
    assert nodes.faults(RUNNING, BACKOFF, 7, crash(0, code=-signal.SIGTERM)) == []
    assert nodes.faults(RUNNING, RUNNING, 7, RankExited(7, 5, None, signal.SIGKILL)) == []  # still running: not yet


def test_failures_within_the_window_quarantine_the_node_and_older_ones_do_not_count() -> None:
    fault = nodes.NodeFault(1, 0, "rank 0 exited with code 1")
    book, node, held = nodes.record(RULES, nodes.Book(), fault, 0.0)
    book, node, held = nodes.record(RULES, book, fault, 150.0)  # the first is out of the window
    assert (held, node.faults) == (False, (150.0,))
    book, node, held = nodes.record(RULES, book, fault, 160.0)
    assert (held, node.until, nodes.held(book, 209.0) is node, nodes.held(book, 210.0)) == (True, 210.0, True, None)
    slot = book.get("slot:0")
    assert slot is not None and slot.until is None  # a slot is counted, never held


def test_a_clear_forgets_the_quarantine_once_per_request() -> None:
    book, _, _ = nodes.record(nodes.Rules(1, 100.0, 50.0), nodes.Book(), nodes.NodeFault(1, None, "x"), 0.0)
    book, gone = nodes.clear(book, "abcd")
    assert (gone, nodes.held(book, 1.0), book.served) == (["node"], None, ("abcd",))
    book, _, _ = nodes.record(nodes.Rules(1, 100.0, 50.0), book, nodes.NodeFault(2, None, "x"), 2.0)
    assert nodes.clear(book, "abcd") == (book, [])  # served already


# ---------------------------------------------------------------------- the quarantine across supervisors


def test_a_quarantined_node_stays_out_across_a_restart_until_cleared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = config(tmp_path, quarantine_failures=2, quarantine_s=3600)
    first, said = admission(path)
    first.adopt()
    for attempt in (1, 2):
        first.fault(nodes.NodeFault(attempt, 0, f"rank 0 (pid {attempt}) was killed by SIGKILL"))
    assert [f["target"] for f in events(said, "node_quarantined")] == ["node"]

    again, said = admission(path)  # a new supervisor on the same state directory
    again.adopt()
    assert "still quarantined from before" in events(said, "node_quarantined")[0]["reason"]
    ran, wait = again.admit(3)
    assert (ran, wait is not None and 3500 < wait <= 3600, events(said, "node_checked")) == (None, True, [])
    assert "this node is quarantined until" in events(said, "launch_deferred")[0]["reason"]
    code, out = cli(capsys, "nodes", "--config", str(path), "--json")
    (node,) = json.loads(out)["nodes"]
    assert (code, node["quarantined"], node["targets"][0]["quarantines"]) == (0, True, 1)

    code, out = cli(capsys, "nodes", "clear", "node-a", "--config", str(path))  # no supervisor runs: done here
    assert (code, "cleared node, slot:0" in out) == (0, True)
    after, said = admission(path)
    after.adopt()
    assert after.admit(4)[1] is None and events(said, "launch_deferred") == []


def test_a_clear_of_a_running_supervisor_is_served_by_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = config(tmp_path, quarantine_failures=1, quarantine_s=3600)
    running, said = admission(path)
    running.adopt()
    running.fault(nodes.NodeFault(1, None, "a hang with rank 0 stopped"))
    assert running.admit(2)[1] is not None
    lock = statedir.InstanceLock(tmp_path / "state")  # what a running supervisor holds
    result: list[int] = []
    asking = threading.Thread(target=lambda: result.append(main(["nodes", "clear", "--all", "--config", str(path)])))
    try:
        asking.start()
        wait_for(lambda: (tmp_path / "state" / nodefiles.CLEAR).exists(), 10, "no clear request written")
        wait_for(running.poll, 10, "the supervisor never served the clear")
        asking.join(timeout=10)
    finally:
        lock.close()
    assert (result, events(said, "quarantine_cleared")[0]["targets"]) == ([0], ["node"])
    assert running.admit(3)[1] is None
    assert "cleared by its supervisor" in capsys.readouterr().out


def test_a_journal_that_is_not_one_is_set_aside_and_the_node_starts_with_none(tmp_path: Path) -> None:
    path = config(tmp_path)
    (tmp_path / "state" / nodefiles.QUARANTINE).write_text('{"v": 1, "entries": "all of them"}')
    keeper, said = admission(path)
    keeper.adopt()
    (ignored,) = events(said, "quarantine_ignored")
    assert ignored["reason"].startswith(str(tmp_path / "state" / nodefiles.QUARANTINE))
    assert Path(ignored["kept"]).read_text() == '{"v": 1, "entries": "all of them"}'  # kept for a person to read
    assert keeper.admit(1)[1] is None


def test_a_clear_naming_another_node_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["nodes", "clear", "node-b", "--config", str(config(tmp_path))])
    assert (code, "is node 'node-a', not 'node-b'" in capsys.readouterr().err) == (2, True)


def test_the_checks_and_the_quarantine_are_in_the_metrics(tmp_path: Path) -> None:
    path = config(tmp_path, health_command=[sys.executable, "-c", "exit(2)"], quarantine_failures=1)
    metrics = Metrics("test", "node-a", started_unix=0.0)
    keeper, _ = admission(path, metrics)
    keeper.admit(1)
    value = metrics.registry.get_sample_value
    assert (value("ftsup_node_healthy"), value("ftsup_node_check", {"check": "command", "result": "failed"})) == (0, 1)
    assert value("ftsup_node_check", {"check": "command", "result": "ok"}) == 0
    keeper.fault(nodes.NodeFault(1, 0, "rank 0 exited with code 1"))
    assert (value("ftsup_node_quarantined"), value("ftsup_node_faults_total")) == (1, 1)


def test_a_standby_on_a_single_node_job_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="launch.standby: a hot spare needs a job of several nodes"):
        load_config(config(tmp_path, standby=True))


def test_the_quarantine_is_on_by_default_only_where_another_node_can_run(tmp_path: Path) -> None:
    one = load_config(config(tmp_path)).launch
    several = load_config(config(tmp_path, nnodes="1:2", rdzv_endpoint="127.0.0.1:29400")).launch
    given = load_config(config(tmp_path, quarantine_failures=5)).launch
    assert (one.quarantine_after, several.quarantine_after, given.quarantine_after) == (0, 3, 5)
