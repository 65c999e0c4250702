"""Cloud metadata watchers: AWS EC2 spot (IMDSv2), GCP preemption, Azure Scheduled Events.

Each `poll(now_unix)` asks its endpoint once: a `Notice`, None (no eviction), or `WatchError` (blind).
"""

from __future__ import annotations

import json
import time

from ftsup.supervisor.eviction import notices
from ftsup.supervisor.eviction.http import HttpError, request
from ftsup.supervisor.eviction.notices import BadResponse, Notice

AWS_BASE = "http://169.254.169.254"
GCP_BASE = "http://metadata.google.internal"
AZURE_BASE = "http://169.254.169.254"
AZURE_API = "api-version=2020-07-01"


class WatchError(Exception):
    """The watcher could not see (unreachable, timed out, or a response it cannot trust)."""


class AwsWatcher:
    """IMDSv2: PUT a session token, then GET spot/instance-action and the rebalance recommendation."""

    name = "aws"
    TOKEN_TTL_S = 21600

    def __init__(self, base: str | None, default_deadline_s: float, timeout_s: float = 2.0):
        self.base = (base or AWS_BASE).rstrip("/")
        self.default_deadline_s = default_deadline_s
        self.timeout_s = timeout_s
        self._token: str | None = None
        self._token_expires = 0.0

    def _get(self, path: str) -> tuple[int, bytes]:
        if self._token is None or time.monotonic() > self._token_expires:
            r = request(
                "PUT",
                f"{self.base}/latest/api/token",
                timeout_s=self.timeout_s,
                headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.TOKEN_TTL_S)},
            )
            if r.status != 200 or not r.body:
                raise WatchError(f"IMDSv2 token request answered HTTP {r.status}")
            self._token = r.body.decode().strip()
            self._token_expires = time.monotonic() + self.TOKEN_TTL_S / 2
        r = request(
            "GET", f"{self.base}{path}", headers={"X-aws-ec2-metadata-token": self._token}, timeout_s=self.timeout_s
        )
        if r.status == 401:  # the token expired early: fetch a new one next time
            self._token = None
            raise WatchError("IMDSv2 token rejected (401)")
        return r.status, r.body

    def poll(self, now_unix: float) -> Notice | None:
        try:
            notice = notices.aws_instance_action(*self._get("/latest/meta-data/spot/instance-action"), now_unix)
            if notice is not None:
                return notice
            status, body = self._get("/latest/meta-data/events/recommendations/rebalance")
            return notices.aws_rebalance(status, body, now_unix, self.default_deadline_s)
        except (HttpError, BadResponse) as e:
            raise WatchError(str(e)) from None

    def ack(self, notice: Notice) -> None:
        pass


class GcpWatcher:
    """GET instance/preempted with `Metadata-Flavor: Google`, long-polling with wait_for_change."""

    name = "gcp"

    def __init__(self, base: str | None, default_deadline_s: float, timeout_s: float = 2.0, long_poll_s: int = 10):
        self.base = (base or GCP_BASE).rstrip("/")
        self.default_deadline_s = default_deadline_s
        self.timeout_s = timeout_s
        self.long_poll_s = long_poll_s
        self._first = True

    def poll(self, now_unix: float) -> Notice | None:
        url = f"{self.base}/computeMetadata/v1/instance/preempted"
        timeout = self.timeout_s
        if not self._first:  # after the first answer, wait on the server for a change
            url += f"?wait_for_change=true&timeout_sec={self.long_poll_s}"
            timeout = self.long_poll_s + self.timeout_s
        try:
            r = request("GET", url, headers={"Metadata-Flavor": "Google"}, timeout_s=timeout)
            notice = notices.gcp_preempted(
                r.status, r.body, r.headers.get("metadata-flavor"), time.time(), self.default_deadline_s
            )
        except (HttpError, BadResponse) as e:
            self._first = True
            raise WatchError(str(e)) from None
        self._first = False
        return notice

    def ack(self, notice: Notice) -> None:
        pass


class AzureWatcher:
    """Scheduled Events: GET the document; acknowledge (StartRequests) once the save is committed."""

    name = "azure"

    def __init__(self, base: str | None, default_deadline_s: float, timeout_s: float = 2.0):
        self.base = (base or AZURE_BASE).rstrip("/")
        self.default_deadline_s = default_deadline_s
        self.timeout_s = timeout_s

    @property
    def url(self) -> str:
        return f"{self.base}/metadata/scheduledevents?{AZURE_API}"

    def poll(self, now_unix: float) -> Notice | None:
        try:
            r = request("GET", self.url, headers={"Metadata": "true"}, timeout_s=self.timeout_s)
            return notices.azure_scheduled_events(r.status, r.body, now_unix, self.default_deadline_s)
        except (HttpError, BadResponse) as e:
            raise WatchError(str(e)) from None

    def ack(self, notice: Notice) -> None:
        if not notice.ack_id:
            return
        body = json.dumps({"StartRequests": [{"EventId": notice.ack_id}]}).encode()
        try:
            r = request(
                "POST",
                self.url,
                headers={"Metadata": "true", "Content-Type": "application/json"},
                body=body,
                timeout_s=self.timeout_s,
            )
        except HttpError as e:
            raise WatchError(f"acknowledging {notice.ack_id}: {e}") from None
        if r.status not in (200, 204):
            raise WatchError(f"acknowledging {notice.ack_id}: HTTP {r.status}")
