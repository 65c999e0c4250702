"""Metrics with a real Prometheus: a supervisor keeping the reference trainer alive through a
SIGKILLed rank is scraped by a Prometheus server on 127.0.0.1 that loads our alert rules; the
rules and the example config pass promtool; every dashboard and alert expression is valid
PromQL (the server parses it) over metrics that exist.

The same run's goodput accounting (resumed from the checkpoint of step 4 after the kill past step 7): its metrics
endpoint, scraped by the test as the run goes, agrees with `ftsup status --json` read at the end, and the kill's
cost shows under its causes. One run serves both sets of claims (test_goodput.py has the supervisor's own kill).

Needs the `prometheus` Debian package (prometheus + promtool; the README's test command
installs it). Where it is missing the tests that need it are skipped, saying why; the goodput claims still run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ftsup.supervisor.policy.goodput import CAUSES
from ftsup.supervisor.telemetry.metrics import Metrics
from tests.integration.test_goodput import stamp
from tests.integration.test_supervisor import events, ftsup, write_job
from tests.procs import PYTHONPATH, REPO, free_port, kill_tree, wait_for

pytestmark = pytest.mark.multiprocess

DEPLOY = REPO / "deploy"
RULES = DEPLOY / "prometheus" / "ftsup-alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "ftsup-dashboard.json"


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        reason = f"{name} is not installed (Debian: apt-get install prometheus)"
        warnings.warn(f"skipped: {reason}", stacklevel=2)  # shown in the summary even under -q
        pytest.skip(reason)
    return path


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_binary("promtool"), *args], capture_output=True, text=True, timeout=60, check=False)


class Prometheus:
    """A private Prometheus server: its own config, data dir and free port; stopped by close()."""

    def __init__(self, root: Path, target: str) -> None:
        binary = _binary("prometheus")
        root.mkdir(parents=True, exist_ok=True)
        shutil.copy(RULES, root / RULES.name)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [RULES.name],
            "scrape_configs": [{"job_name": "ftsup", "static_configs": [{"targets": [target]}]}],
        }
        (root / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(root / "prometheus.log", "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={root / 'prometheus.yml'}",
                f"--storage.tsdb.path={root / 'data'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=root,
        )
        self.root = root
        wait_for(self._ready, 60, lambda: f"prometheus did not become ready:\n{self._log_tail()}", poll_s=0.1)

    def _log_tail(self) -> str:
        self.log.flush()
        return (self.root / "prometheus.log").read_text()[-3000:]

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n{self._log_tail()}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:  # 400 for a bad expression: the body says why
            body = json.load(e)
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def scalar(self, expr: str) -> float | None:
        result = self.api("query", query=expr)["result"]
        return float(result[0]["value"][1]) if result else None

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            self.proc.wait()
        self.log.close()


def scrape(url: str) -> dict[str, Any] | None:
    """The goodput figures of one scrape (None: the endpoint did not answer)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    got: dict[str, Any] = {"badput_s": {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "ftsup_productive_seconds_total":
                got["productive_s"] = sample.value
            elif sample.name == "ftsup_badput_seconds_total":
                got["badput_s"][sample.labels["cause"]] = sample.value
            elif sample.name == "ftsup_goodput_ratio":
                got["ratio"] = sample.value
    return got


@dataclass
class Run:
    """The supervised run: its directory, the Prometheus server that scraped it (None where none is installed), the
    last scrape of its endpoint that answered with goodput figures, and `ftsup status --json`'s goodput after it."""

    tmp: Path
    prom: Prometheus | None
    scraped: dict[str, Any]
    status: dict[str, Any]


@pytest.fixture(scope="module")
def supervised_run(tmp_path_factory) -> Iterator[Run]:
    """One supervised run with a SIGKILLed rank, scraped every second by Prometheus and as it goes by the test; the
    server stays up for the module's queries after the run has ended."""
    tmp = tmp_path_factory.mktemp("metrics")
    port = free_port()
    prom = Prometheus(tmp / "prometheus", f"127.0.0.1:{port}") if shutil.which("prometheus") else None
    try:
        fault = ("--fault", "kill@7", "--fault-rank", "1", "--min-step-s", "0.3")
        job = write_job(tmp, *fault, metrics={"listen": f"127.0.0.1:{port}"})
        proc = subprocess.Popen(
            [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(job)],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            last: dict[str, Any] | None = None

            def ended() -> bool:
                nonlocal last
                if (got := scrape(f"http://127.0.0.1:{port}/metrics")) is not None and "productive_s" in got:
                    last = got
                return proc.poll() is not None

            wait_for(ended, 240, "the supervised run did not end within 240 s", poll_s=0.05)
            assert proc.returncode == 0, proc.stderr.read()[-4000:] if proc.stderr else ""
            assert last is not None, "the metrics endpoint never answered"
            status = ftsup("status", "--config", str(job), "--json", timeout=60)
            assert status.returncode == 0, status.output
            yield Run(tmp, prom, last, json.loads(status.output)["goodput"])
        finally:
            if proc.poll() is None:
                kill_tree(proc.pid)
            proc.wait()
            if proc.stderr:
                proc.stderr.close()
    finally:
        if prom is not None:
            prom.close()


def server(run: Run) -> Prometheus:
    """The run's Prometheus server; the test is skipped, saying why, where none is installed."""
    _binary("prometheus")
    assert run.prom is not None
    return run.prom


def test_prometheus_scraped_the_crash_the_restart_and_the_progress(supervised_run):
    prom, tmp = server(supervised_run), supervised_run.tmp
    started = [e for e in events(tmp) if e["event"] == "supervisor_started"]
    assert started and started[0]["metrics"].startswith("127.0.0.1:")

    def seen(expr: str) -> float | None:
        return prom.scalar(f"max_over_time({expr}[10m])")

    # The run is over; the head block holds every scrape it made.
    assert seen('up{job="ftsup"}') == 1
    assert seen('ftsup_failures_total{job="ftsup",kind="crash"}') == 1
    assert seen('ftsup_failures_total{job="ftsup",kind="hang"}') == 0
    assert seen('ftsup_attempts_total{job="ftsup"}') == 2
    assert seen('ftsup_restarts_total{job="ftsup"}') == 1
    assert seen('ftsup_world_size{job="ftsup"}') == 2
    assert (seen('ftsup_step{job="ftsup"}') or 0) > 7  # the second attempt got past the crash
    assert (seen('ftsup_checkpoint_latest_step{job="ftsup"}') or 0) >= 4
    assert seen('ftsup_steps_lost_total{job="ftsup"}') == 3  # killed after step 7, resumed from 4
    assert (seen('ftsup_loss{job="ftsup"}') or 0) > 0


def test_every_alert_rule_loads_and_evaluates_without_error(supervised_run):
    prom = server(supervised_run)
    groups = prom.api("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    names = {r["name"] for r in rules}
    assert {"FtsupSupervisorDown", "FtsupNoTrainingProgress", "FtsupFrequentRestarts"} <= names

    def rules_now() -> list[dict[str, Any]]:
        return [r for g in prom.api("rules")["groups"] for r in g["rules"]]

    # Prometheus reports a time of year 1 for a rule it has not evaluated yet.
    wait_for(
        lambda: all(not r["lastEvaluation"].startswith("0001") for r in rules_now()), 30, "rules were never evaluated"
    )
    assert [(r["name"], r.get("lastError")) for r in rules_now() if r["health"] != "ok"] == []


def _dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def _alert_exprs() -> list[str]:
    return [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_every_dashboard_and_alert_expression_is_valid_promql(supervised_run):
    prom = server(supervised_run)
    exprs = _dashboard_exprs() + _alert_exprs()
    assert len(exprs) > 20
    for expr in exprs:
        # Grafana fills in its variables before it queries.
        concrete = expr.replace("$instance", ".*").replace("$__rate_interval", "1m")
        prom.api("query", query=concrete, time=str(time.time()))


def test_dashboard_and_alerts_use_only_metrics_the_supervisor_exports():
    exported = {"up"}
    for fam in Metrics("job", "node", started_unix=0).registry.collect():
        exported |= {fam.name, f"{fam.name}_total"} if fam.type == "counter" else {fam.name}
    used = set()
    for expr in _dashboard_exprs() + _alert_exprs():
        used |= set(re.findall(r"\b(ftsup_[a-z_]+|up)\b", expr))
    assert used - exported == set()
    assert len(used) > 15


def test_rules_and_example_config_pass_promtool():
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = promtool("test", "rules", str(DEPLOY / "prometheus" / "ftsup-alerts.test.yml"))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    config = promtool("check", "config", str(DEPLOY / "prometheus" / "prometheus.yml"))
    assert config.returncode == 0, config.stdout + config.stderr


def test_the_prometheus_figures_agree_with_status_json_within_2_points(supervised_run):
    scraped, status = supervised_run.scraped, supervised_run.status
    badput = sum(scraped["badput_s"].values())
    assert abs(scraped["ratio"] - status["ratio"]) <= 0.02
    assert abs(scraped["productive_s"] / (scraped["productive_s"] + badput) - status["ratio"]) <= 0.02


def test_every_cause_is_exported_and_shown(supervised_run):
    scraped, status = supervised_run.scraped, supervised_run.status
    assert set(scraped["badput_s"]) == set(CAUSES) == set(status["badput_s"])


def test_the_accounted_wall_time_is_the_supervisors_whole_run(supervised_run):
    status = supervised_run.status
    stamps = [stamp(e) for e in events(supervised_run.tmp)]
    ran = max(stamps) - min(stamps)  # from supervisor_started to supervisor_exited
    assert ran - 1.0 <= status["wall_s"] <= ran
    assert status["wall_s"] == pytest.approx(status["productive_s"] + sum(status["badput_s"].values()), abs=0.01)


def test_the_kill_shows_as_startup_detection_backoff_and_wasted_progress(supervised_run):
    status = supervised_run.status
    lost = status["badput_s"]
    assert lost["startup"] > 0 and lost["detection"] > 0 and lost["checkpoint_save"] > 0
    assert lost["backoff"] == pytest.approx(0.0, abs=0.15)  # a failure after progress restarts at once
    # Steps 5, 6 and 7 trained again, --min-step-s each at least, as beats read once a tick (0.1 s) time them.
    assert lost["wasted_progress"] >= 3 * 0.3 - 2 * 0.1
    assert lost["eviction"] == 0
    assert 0 < status["ratio"] < 1
