"""Prometheus metrics of one supervisor: every metric is defined here, once, and fed by the daemon's loop.

Names as DESIGN.md, Contracts gives them; the feeds and the endpoint: docs/design/telemetry.md, Metrics.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from functools import partial
from importlib import metadata
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import choose_encoder

from ftsup.protocol import DROP_REASONS
from ftsup.store import layout
from ftsup.supervisor.config.job import split_host_port
from ftsup.supervisor.policy import detectors, evidence, goodput, nodes, saves
from ftsup.supervisor.policy import machine as policy
from ftsup.supervisor.telemetry.http import BoundedHTTPServer
from ftsup.supervisor.telemetry.logs import EVENTS

log = structlog.get_logger("ftsup.supervisor")

PHASES = tuple(p.value for p in policy.SupervisorPhase)
"""The policy's phases, one series each in `ftsup_phase`."""

FAILURE_KINDS = {
    "worker_exited": "crash",
    "heartbeat_timed_out": "hang",
    "progress_timed_out": "no_progress",
    "startup_timed_out": "startup",
}
"""Log events that end an attempt as a failure, and the `kind` label each counts under."""

STORAGE_PURPOSES = {
    "checkpoint_dir": "the checkpoint store (checkpoint.dir)",
    "journal": "the journal (job.state_dir)",
    "control_file": "the control file that asks the ranks to save (job.state_dir)",
    "log_file": "the supervisor's log file",
    "rank_status": "the ranks as last heard, for ftsup status (job.state_dir)",
    "incidents": "the incident records, for ftsup incidents (job.state_dir)",
    "quarantine": "this node's quarantine, kept across supervisors (job.state_dir)",
}
"""What the supervisor reads and writes, the `purpose` label of `ftsup_storage_errors_total`, and what each is
for (as the `storage_failed` log line says it)."""

DURABLE_OUTCOMES = ("committed", "already", "failed", "dropped")
"""How uploads to the durable tier ended, the `outcome` label of `ftsup_durable_uploads_total`: committed by this
upload, already there with the same content, a try that failed (retried), dropped (cannot go)."""

TRIGGERS = ("auto", "operator")
"""What started a rollback, the `trigger` label of `ftsup_rollbacks_total`."""


def _version() -> str:
    try:
        return metadata.version("ftsup")
    except metadata.PackageNotFoundError:  # a source checkout that was never installed
        return "unknown"


class Metrics:
    """The supervisor's metrics, in a registry of their own (several daemons in one test
    process must not share series)."""

    def __init__(self, run_id: str, node_id: str, *, started_unix: float) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        counter, gauge = partial(Counter, registry=r), partial(Gauge, registry=r)
        info = gauge(
            "ftsup_supervisor_info",
            "Constant 1; labels name the job, the node and the ftsup version.",
            ["run_id", "node_id", "version"],
        )
        info.labels(run_id, node_id, _version()).set(1)
        gauge("ftsup_supervisor_start_time_seconds", "When this supervisor started (Unix time).").set(started_unix)

        # ---- counters, from log events
        self.events = counter("ftsup_events_total", "Log events emitted, by event name.", ["event"])
        self.attempts = counter("ftsup_attempts_total", "Attempts launched (torchrun started).")
        self.restarts = counter("ftsup_restarts_total", "Restarts scheduled after a failed attempt.")
        self.failures = counter(
            "ftsup_failures_total", "Attempts that failed, by kind: crash, hang, no_progress, startup.", ["kind"]
        )
        self.evictions = counter("ftsup_evictions_noticed_total", "Eviction notices, by source.", ["source"])
        self.save_requests = counter(
            "ftsup_save_requests_total",
            "Saves the supervisor asked the ranks for; stop=true: save, then stop (an eviction).",
            ["stop"],
        )
        self.emergency = counter(
            "ftsup_emergency_checkpoints_total", "Emergency checkpoints committed before an eviction deadline."
        )
        self.emergency_tiers = counter(
            "ftsup_emergency_checkpoint_tiers_total",
            "Evictions whose emergency checkpoint reached a tier (memory, peers, disk, fallback, durable) before the "
            "node was lost, by tier; tier=none: it reached none.",
            ["tier"],
        )
        self.emergency_failed = counter(
            "ftsup_emergency_saves_failed_total",
            "Saves the supervisor asked for (an eviction's, an advisory notice's) that failed, or did not finish "
            "before the eviction's deadline.",
        )
        self.dir_recreated = counter(
            "ftsup_checkpoint_dir_recreated_total",
            "Times the checkpoint directory had vanished and the ranks' next save made it again.",
        )
        self.quarantined = counter(
            "ftsup_checkpoints_quarantined_total", "Checkpoints found corrupt and renamed step-N.corrupt."
        )
        self.orphans = counter("ftsup_orphans_found_total", "Processes of a stopped attempt that outlived the stop.")
        self.probe_failures = counter(
            "ftsup_health_probe_failures_total", "Slot health probes that failed (the last known world size was kept)."
        )
        self.steps_lost = counter(
            "ftsup_steps_lost_total",
            "Training steps done again after restarts: the best "
            "step reached before each relaunch minus the step it resumed from.",
        )
        self.watcher_blind = gauge(
            "ftsup_watcher_blind",
            "1 while an eviction watcher cannot see its source (its eviction state is unknown).",
            ["source"],
        )
        self.healthy_slots = gauge("ftsup_healthy_slots", "Healthy device slots at the last health probe.")
        self.heartbeats_dropped = counter(
            "ftsup_heartbeats_dropped_total",
            "Heartbeat messages and connections dropped, by reason: " + ", ".join(DROP_REASONS) + ".",
            ["reason"],
        )
        self.storage_errors = counter(
            "ftsup_storage_errors_total",
            "I/O errors the supervisor rode out (and retried), "
            "by what failed: checkpoint_dir, journal, control_file, log_file, rank_status.",
            ["purpose"],
        )
        self.anomalies = counter(
            "ftsup_anomalies_total",
            "Training anomalies detected, by kind: " + ", ".join(detectors.KINDS) + ".",
            ["kind"],
        )
        self.rollbacks = counter(
            "ftsup_rollbacks_total",
            "Rollbacks started, by trigger: auto (an anomaly), operator (ftsup rollback).",
            ["trigger"],
        )
        self.skipped = counter(
            "ftsup_skipped_samples_total", "Data positions newly put under a skip (the ranks never train on them)."
        )
        self.productive = counter(
            "ftsup_productive_seconds_total",
            "Seconds of the job's wall time that trained a "
            "step for the first time, across attempts and supervisors (as journaled).",
        )
        self.badput = counter(
            "ftsup_badput_seconds_total",
            "Seconds of the job's wall time lost, by cause: " + ", ".join(goodput.CAUSES) + " (as journaled).",
            ["cause"],
        )
        self.goodput_ratio = gauge(
            "ftsup_goodput_ratio",
            "Productive seconds over the job's wall time so far (productive plus every cause of badput).",
        )
        self.incidents = counter(
            "ftsup_incidents_total",
            "Incident records written, by trigger: " + ", ".join(evidence.TRIGGERS) + ".",
            ["trigger"],
        )
        self.capture_s = gauge(
            "ftsup_evidence_capture_seconds", "How long the last capture of the ranks' stacks took (NaN: none yet)."
        )
        self.escalations = counter(
            "ftsup_anomaly_escalations_total",
            "Anomalies that stopped the job (exit 7): the same again after its skip, or the rollback budget spent.",
        )

        # ---- this node: its checks before each attempt, its quarantine, a hot spare's wait
        self.node_healthy = gauge(
            "ftsup_node_healthy",
            "1 when every check of this node passed at its last check before an attempt; 0 when one failed or could "
            "not look (NaN: not checked yet).",
        )
        self.node_check = gauge(
            "ftsup_node_check",
            "1 for each check's result at this node's last check, by check (" + ", ".join(nodes.CHECKS) + ") and "
            "result (" + ", ".join(nodes.RESULTS) + ").",
            ["check", "result"],
        )
        self.node_quarantined_now = gauge(
            "ftsup_node_quarantined", "1 while this node is quarantined: held out of attempts (`ftsup nodes`)."
        )
        self.node_faults = counter("ftsup_node_faults_total", "Failures put on this node, which its quarantine counts.")
        self.standby = gauge(
            "ftsup_standby", "1 while this node, a hot spare, waits in the rendezvous for a free slot."
        )

        # ---- gauges, from the policy's state
        self.phase = gauge("ftsup_phase", "1 for the supervisor's current phase.", ["phase"])
        self.attempt = gauge("ftsup_attempt", "The current (or last) attempt number.")
        self.world_size = gauge("ftsup_world_size", "Ranks on this node in the current attempt (0: none running).")
        self.ranks_reporting = gauge("ftsup_ranks_reporting", "Ranks of the current attempt that sent heartbeats.")
        self.step = gauge("ftsup_step", "The highest optimizer step any rank reported (-1: none yet).")
        self.progress_ts = gauge(
            "ftsup_last_progress_timestamp_seconds",
            "When the step last advanced, or the current attempt was launched (Unix time).",
        )
        self.step_s = gauge("ftsup_step_duration_seconds", "Median seconds per optimizer step, recent steps.")
        self.hb_timeout = gauge(
            "ftsup_heartbeat_timeout_seconds",
            "The heartbeat timeout in force while training "
            "(configured or learned from step times; NaN until steps are seen, and while "
            "heartbeat.mode detects no hangs).",
        )
        self.restarts_window = gauge("ftsup_restarts_in_window", "Restarts inside restart.window_s.")
        self.budget = gauge("ftsup_restart_budget_remaining", "Restarts left before the budget is spent.")
        self.deadline = gauge(
            "ftsup_eviction_deadline_timestamp_seconds",
            "The pending eviction's deadline (Unix time); 0 when none is pending.",
        )
        self.save_s = gauge("ftsup_save_duration_seconds", "Duration of the last checkpoint save rank 0 reported.")
        self.loss = gauge("ftsup_loss", "The training loss rank 0 last reported.")
        self.time_ratio = gauge(
            "ftsup_rank_step_time_ratio",
            "A rank's median step time (its own work, compute_s, "
            "where reported; recent steps) over the median of this node's ranks'.",
            ["rank"],
        )
        self.stragglers = gauge("ftsup_stragglers", "Ranks of this node reported as stragglers now.")

        # ---- gauges, from the checkpoint directory
        self.ckpt_step = gauge("ftsup_checkpoint_latest_step", "Step of the newest consistent checkpoint (-1: none).")
        self.ckpt_ts = gauge(
            "ftsup_checkpoint_latest_timestamp_seconds",
            "When the newest consistent checkpoint was created (Unix time; 0: none).",
        )
        self.ckpt_bytes = gauge("ftsup_checkpoint_latest_bytes", "Tensor bytes of the newest consistent checkpoint.")
        self.mem_bytes = gauge("ftsup_memory_tier_bytes", "Bytes the node's memory tier holds (-1: no tier).")
        self.mem_replicas = gauge("ftsup_memory_tier_replicas", "Other nodes' parts this node's memory holds.")
        self.mem_replica_step = gauge(
            "ftsup_memory_tier_replica_step", "The oldest of the newest steps of those parts (-1: none held)."
        )
        self.ckpt_count = gauge("ftsup_checkpoints", "Committed checkpoints in the checkpoint directory.")

        # ---- the durable tier (checkpoint.durable), from its uploader
        self.durable_uploads = counter(
            "ftsup_durable_uploads_total",
            "Uploads to the durable tier, by outcome: " + ", ".join(DURABLE_OUTCOMES) + " (failed: a try, retried).",
            ["outcome"],
        )
        self.durable_bytes = counter(
            "ftsup_durable_uploaded_bytes_total", "Bytes sent to the durable tier (parts already there not counted)."
        )
        self.durable_step = gauge(
            "ftsup_durable_latest_step", "Step of the newest durable checkpoint known (-1: none)."
        )
        self.durable_ts = gauge(
            "ftsup_durable_latest_timestamp_seconds",
            "When the newest durable checkpoint was "
            "committed to the tier (Unix time; until one is, this supervisor's start).",
        )
        self.durable_pending = gauge(
            "ftsup_durable_pending", "Checkpoints waiting for the durable tier or being uploaded."
        )
        self.durable_rate = gauge(
            "ftsup_durable_upload_bytes_per_second",
            "Throughput of the last upload that sent enough to measure it (NaN: none yet).",
        )

        for name in sorted(EVENTS):  # the event label's values: the listed events, from zero
            self.events.labels(name)
        for name in PHASES:
            self.phase.labels(name)
        for kind in FAILURE_KINDS.values():
            self.failures.labels(kind)
        for stop in ("true", "false"):
            self.save_requests.labels(stop)
        for reason in DROP_REASONS:
            self.heartbeats_dropped.labels(reason)
        for purpose in STORAGE_PURPOSES:
            self.storage_errors.labels(purpose)
        for kind in detectors.KINDS:
            self.anomalies.labels(kind)
        for trigger in TRIGGERS:
            self.rollbacks.labels(trigger)
        for trigger in evidence.TRIGGERS:
            self.incidents.labels(trigger)
        self.capture_s.set(float("nan"))
        self.node_healthy.set(float("nan"))
        for check in nodes.CHECKS:
            for result in nodes.RESULTS:
                self.node_check.labels(check, result)
        for outcome in DURABLE_OUTCOMES:
            self.durable_uploads.labels(outcome)
        self.durable_step.set(-1)
        self.durable_ts.set(started_unix)
        self.durable_rate.set(float("nan"))
        for cause in goodput.CAUSES:
            self.badput.labels(cause)
        self._goodput = goodput.Totals()  # as last exported
        self.step.set(-1)
        self.ckpt_step.set(-1)
        self.hb_timeout.set(float("nan"))
        self._seen_attempt = 0
        self._state: policy.State | None = None
        self._health: detectors.Health | None = None

    # ------------------------------------------------------------------ feeds

    def event(self, name: str, fields: Mapping[str, Any]) -> None:
        """Count one log event (called with exactly what was logged)."""
        self.events.labels(name).inc()
        if name in FAILURE_KINDS:
            self.failures.labels(FAILURE_KINDS[name]).inc()
        elif name == "workers_launched":
            self.attempts.inc()
        elif name == "restart_scheduled":
            self.restarts.inc()
        elif name == "eviction_noticed":
            self.evictions.labels(str(fields.get("source", "unknown"))).inc()
        elif name == "save_requested":
            self.save_requests.labels("true" if fields.get("stop") else "false").inc()
        elif name == "checkpoint_committed" and fields.get("kind") == "emergency":
            self.emergency.inc()
        elif name == "checkpoint_quarantined":
            self.quarantined.inc()
        elif name == "emergency_tiers_reached":
            tiers = [t for t in saves.TIERS if t in (fields.get("tiers") or ())]
            for tier in tiers or ["none"]:
                self.emergency_tiers.labels(tier).inc()
        elif name == "emergency_save_failed":
            self.emergency_failed.inc()
        elif name == "checkpoint_dir_recreated":
            self.dir_recreated.inc()
        elif name == "orphans_found":
            self.orphans.inc(len(fields.get("pids") or ()) or 1)
        elif name == "health_probe_failed":
            self.probe_failures.inc()
        elif name == "health_probed":
            self.healthy_slots.set(len(fields.get("slots") or ()))
        elif name in ("watcher_went_blind", "watcher_recovered"):
            self.watcher_blind.labels(str(fields.get("source", "unknown"))).set(name == "watcher_went_blind")
        elif name == "anomaly_detected" and fields.get("kind") in detectors.KINDS:
            self.anomalies.labels(str(fields["kind"])).inc()
        elif name == "rollback_started" and fields.get("trigger") in TRIGGERS:
            self.rollbacks.labels(str(fields["trigger"])).inc()
        elif name == "data_skipped" and isinstance(fields.get("samples"), int) and fields["samples"] > 0:
            self.skipped.inc(fields["samples"])
        elif name == "anomaly_escalated":
            self.escalations.inc()
        elif name == "incident_recorded" and fields.get("trigger") in evidence.TRIGGERS:
            self.incidents.labels(str(fields["trigger"])).inc()
            if isinstance(fields.get("duration_s"), float) and fields["trigger"] != "anomaly":
                self.capture_s.set(fields["duration_s"])
        elif name == "durable_committed":
            self.durable_uploads.labels("already" if fields.get("outcome") == "already" else "committed").inc()
            sent = fields.get("bytes_sent")
            if isinstance(sent, int) and sent > 0:
                self.durable_bytes.inc(sent)
        elif name == "node_fault_recorded":
            self.node_faults.inc()
        elif name == "durable_upload_failed":
            self.durable_uploads.labels("failed").inc()
        elif name == "durable_dropped":
            self.durable_uploads.labels("dropped").inc()

    def node_checked(self, verdict: nodes.Verdict) -> None:
        """This node's checks before an attempt (`run.admission`)."""
        self.node_healthy.set(1 if verdict.healthy else 0)
        results = {c.name: c.result for c in verdict.checks}
        for check in nodes.CHECKS:
            for result in nodes.RESULTS:
                self.node_check.labels(check, result).set(1 if results.get(check) == result else 0)

    def node_quarantined(self, held: bool) -> None:
        self.node_quarantined_now.set(1 if held else 0)

    def storage_error(self, purpose: str) -> None:
        """Count one I/O error of `purpose` (the daemon names it from a fixed set: checkpoint_dir, journal, ...)."""
        self.storage_errors.labels(purpose).inc()

    def state(self, st: policy.State, settings: policy.Settings, now: float, wall: float) -> None:
        """Gauges from the policy's state; `now` is the policy's clock, `wall` the Unix time
        at the same instant (timestamps are exported in Unix time)."""
        if st is self._state:
            return  # nothing changed since the last call (states are immutable)
        self._state = st
        for name in PHASES:
            self.phase.labels(name).set(1 if st.phase == name else 0)
        self.attempt.set(st.attempt_no)
        att = st.attempt
        self.world_size.set(att.nproc if att is not None and st.phase in policy.ATTEMPT_PHASES else 0)
        waiting = settings.standby and att is not None and st.phase == policy.SupervisorPhase.RUNNING
        self.standby.set(1 if waiting and att is not None and att.ranks_at is None else 0)
        self.ranks_reporting.set(len(att.ranks) if att is not None else 0)
        self.step.set(st.best_step)
        if att is not None:
            self.progress_ts.set(wall - (now - att.progress_at))
            if att.number != self._seen_attempt:
                self._seen_attempt = att.number
                resumed = att.resume_step if att.resume_step is not None else 0
                if att.best_before > resumed:
                    self.steps_lost.inc(att.best_before - resumed)
        if st.step_times:
            self.step_s.set(statistics.median(st.step_times))
        hb = (
            policy.heartbeat_timeout(settings, st.step_times)
            if policy.hang_detection_on(settings, st.beating)
            else None
        )
        self.hb_timeout.set(float("nan") if hb is None else hb)
        in_window = sum(1 for t in st.restarts if now - t < settings.window_s)
        self.restarts_window.set(in_window)
        self.budget.set(max(0, settings.max_restarts - in_window))
        ej = st.eviction
        self.deadline.set(0 if ej is None else wall - (now - ej.deadline))
        if st.save_times:
            self.save_s.set(st.save_times[-1])
        health = st.anomaly.health
        if health is not self._health:  # the ranks of this attempt only: a rank gone has no ratio
            self._health = health
            self.time_ratio.clear()
            for rank, ratio in detectors.step_time_ratios(health).items():
                self.time_ratio.labels(str(rank)).set(ratio)
            self.stragglers.set(len(health.stragglers))

    def accounting(self, totals: goodput.Totals) -> None:
        """The job's time accounting as just journaled: counters never go back, across supervisor restarts too
        (a restarted supervisor starts from the journal's totals, which are what this one exported last)."""
        self.productive.inc(max(0.0, totals.productive_s - self._goodput.productive_s))
        for cause, now, before in zip(goodput.CAUSES, totals.badput, self._goodput.badput, strict=True):
            self.badput.labels(cause).inc(max(0.0, now - before))
        self.goodput_ratio.set(totals.ratio)
        self._goodput = totals

    def heartbeat(self, rank: int, figures: Mapping[str, float]) -> None:
        """Figures a rank reported; the job-wide ones are taken from global rank 0."""
        if rank == 0 and "loss" in figures:
            self.loss.set(figures["loss"])

    def checkpoint(self, latest: layout.CheckpointInfo | None, committed: int) -> None:
        self.ckpt_count.set(committed)
        if latest is None:
            self.ckpt_step.set(-1)
            self.ckpt_ts.set(0)
            self.ckpt_bytes.set(0)
            return
        self.ckpt_step.set(latest.step)
        self.ckpt_ts.set(latest.created_unix or 0)
        self.ckpt_bytes.set(latest.tensor_bytes or 0)

    def memory_tier(self, view: Mapping[str, Any] | None) -> None:
        """The memory tier's gauges, from the store scanner's read of it (`memview.read`)."""
        held = [max(s) for s in view["replicas"].values() if s] if view is not None else []
        self.mem_bytes.set(-1 if view is None else view["bytes_used"])
        self.mem_replicas.set(len(held))
        self.mem_replica_step.set(min(held, default=-1))

    def durable(self, *, newest_step: int | None, newest_unix: float, pending: int, rate: float | None) -> None:
        """The durable tier's gauges, from its keeper (`durable.keeper`)."""
        self.durable_step.set(-1 if newest_step is None else newest_step)
        self.durable_ts.set(newest_unix)
        self.durable_pending.set(pending)
        self.durable_rate.set(float("nan") if rate is None else rate)

    def render(self) -> bytes:
        """The exposition text, as a scrape would get it."""
        return generate_latest(self.registry)


class MetricsServer:
    """/metrics over HTTP on `listen` ("host:port"; port 0 picks a free one), until `close()`.
    `limits` override `telemetry.http`'s bounds (max_connections, request_timeout_s, ...)."""

    def __init__(self, metrics: Metrics, listen: str, **limits: Any) -> None:
        host, port = split_host_port(listen)
        registry = metrics.registry

        def render(accept: str) -> tuple[bytes, str]:
            encoder, content_type = choose_encoder(accept)  # the format the scraper asks for
            return encoder(registry), content_type

        def failed(reason: str) -> None:  # logged and counted, as the daemon's own events are
            log.error("metrics_scrape_failed", reason=reason)
            metrics.event("metrics_scrape_failed", {"reason": reason})

        self._httpd = BoundedHTTPServer(host, port, render, on_error=failed, **limits)
        self.host = host
        self.port = self._httpd.port

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def close(self) -> None:
        self._httpd.close()
