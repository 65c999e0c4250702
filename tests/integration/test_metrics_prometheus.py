"""Metrics with a real Prometheus: a supervisor keeping the reference trainer alive through a
SIGKILLed rank is scraped by a Prometheus server on 127.0.0.1 that loads our alert rules; the
rules and the example config pass promtool; every dashboard and alert expression is valid
PromQL (the server parses it) over metrics that exist.

Needs the `prometheus` Debian package (prometheus + promtool; the README's test command
installs it). Where it is missing the tests are skipped, saying why.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ftsup.supervisor.telemetry.metrics import Metrics
from tests.integration.test_supervisor import events, write_job
from tests.procs import REPO, free_port, kill_tree, run, wait_for

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


@pytest.fixture(scope="module")
def supervised_run(tmp_path_factory) -> Iterator[tuple[Prometheus, Path]]:
    """One supervised run with a SIGKILLed rank, scraped every second; the server stays up for
    the module's queries after the run has ended."""
    tmp = tmp_path_factory.mktemp("metrics")
    port = free_port()
    prom = Prometheus(tmp / "prometheus", f"127.0.0.1:{port}")
    try:
        fault = ("--fault", "kill@7", "--fault-rank", "1", "--min-step-s", "0.3")
        job = write_job(tmp, *fault, metrics={"listen": f"127.0.0.1:{port}"})
        r = run([sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(job)], timeout=240)
        assert r.returncode == 0, r.output[-4000:]
        yield prom, tmp
    finally:
        prom.close()


def test_prometheus_scraped_the_crash_the_restart_and_the_progress(supervised_run):
    prom, tmp = supervised_run
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
    prom, _ = supervised_run
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
    prom, _ = supervised_run
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
