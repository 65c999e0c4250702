"""Notice values and the pure parsing of each provider's documented responses."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime


@dataclass(frozen=True)
class Notice:
    """An eviction is coming: save before `deadline_unix` (wall clock), then leave."""

    source: str  # signal:SIGTERM, aws, gcp, azure, file, command
    deadline_unix: float
    detail: str = ""
    ack_id: str | None = None  # Azure: the EventId to acknowledge once the save is committed
    advisory: bool = False  # AWS rebalance recommendation: save now, do not stop


@dataclass(frozen=True)
class Blind:
    """A watcher cannot see: the eviction state is unknown (logged, never taken as 'none')."""

    source: str
    reason: str


@dataclass(frozen=True)
class Seeing:
    """A watcher that was blind can see again."""

    source: str


class BadResponse(ValueError):
    """A metadata response that does not follow the provider's documented format."""


def from_signal(name: str, now_unix: float, default_deadline_s: float) -> Notice:
    return Notice(f"signal:{name}", now_unix + default_deadline_s, f"received {name}")


def _iso(ts: str) -> float:
    try:
        return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
    except (ValueError, AttributeError) as e:
        raise BadResponse(f"bad timestamp {ts!r}: {e}") from None


def aws_instance_action(status: int, body: bytes, now_unix: float) -> Notice | None:
    """`GET /latest/meta-data/spot/instance-action`: 404 nothing; 200 {"action", "time"}."""
    if status == 404:
        return None
    if status != 200:
        raise BadResponse(f"instance-action answered HTTP {status}")
    try:
        obj = json.loads(body)
        action, when = obj["action"], obj["time"]
    except (ValueError, KeyError, TypeError) as e:
        raise BadResponse(f"instance-action body is not {{action, time}}: {e}") from None
    if action not in ("terminate", "stop", "hibernate"):
        raise BadResponse(f"instance-action has unknown action {action!r}")
    return Notice("aws", _iso(when), f"spot instance-action {action} at {when}")


def aws_rebalance(status: int, body: bytes, now_unix: float, default_deadline_s: float) -> Notice | None:
    """`GET /latest/meta-data/events/recommendations/rebalance`: 404 nothing; 200 {"noticeTime"}."""
    if status == 404:
        return None
    if status != 200:
        raise BadResponse(f"rebalance recommendation answered HTTP {status}")
    try:
        when = json.loads(body)["noticeTime"]
    except (ValueError, KeyError, TypeError) as e:
        raise BadResponse(f"rebalance body is not {{noticeTime}}: {e}") from None
    _iso(when)
    return Notice("aws", now_unix + default_deadline_s, f"rebalance recommendation at {when}", advisory=True)


def gcp_preempted(
    status: int, body: bytes, flavor: str | None, now_unix: float, default_deadline_s: float
) -> Notice | None:
    """`GET /computeMetadata/v1/instance/preempted`: "TRUE" or "FALSE", with `Metadata-Flavor: Google`."""
    if status != 200:
        raise BadResponse(f"preempted answered HTTP {status}")
    if flavor != "Google":
        raise BadResponse("response lacks the Metadata-Flavor: Google header (not the metadata server?)")
    value = body.decode(errors="replace").strip().upper()
    if value == "FALSE":
        return None
    if value == "TRUE":
        return Notice("gcp", now_unix + default_deadline_s, "instance preempted")
    raise BadResponse(f"preempted is neither TRUE nor FALSE: {value[:40]!r}")


EVICTING_AZURE_EVENTS = ("Preempt", "Terminate")


def azure_scheduled_events(status: int, body: bytes, now_unix: float, default_deadline_s: float) -> Notice | None:
    """`GET /metadata/scheduledevents?api-version=2020-07-01`: the earliest Preempt/Terminate event."""
    if status != 200:
        raise BadResponse(f"scheduledevents answered HTTP {status}")
    try:
        doc = json.loads(body)
        events = doc["Events"]
        if not isinstance(events, list):
            raise TypeError("Events is not a list")
    except (ValueError, KeyError, TypeError) as e:
        raise BadResponse(f"scheduledevents body has no Events list: {e}") from None
    found: list[Notice] = []
    for ev in events:
        if not isinstance(ev, dict) or ev.get("EventType") not in EVICTING_AZURE_EVENTS:
            continue
        not_before = ev.get("NotBefore") or ""
        try:
            deadline = parsedate_to_datetime(not_before).timestamp() if not_before else now_unix + default_deadline_s
        except (TypeError, ValueError):
            raise BadResponse(f"bad NotBefore {not_before!r}") from None
        what = f"{ev['EventType']} not before {not_before or 'now'}"
        found.append(Notice("azure", deadline, what, ack_id=str(ev.get("EventId", ""))))
    return min(found, key=lambda n: n.deadline_unix) if found else None


def utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat()
