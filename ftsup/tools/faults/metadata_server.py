"""A cloud metadata server on 127.0.0.1 speaking the documented AWS (IMDSv2), GCP and Azure protocols, for tests and
for `ftsup chaos` (eviction notices through the metadata watchers); `MetadataState.mode` makes it misbehave.
"""

from __future__ import annotations

import json
import threading
import time
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class MetadataState:
    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.mode = "ok"
        self.slow_s = 5.0
        self.aws_action: dict[str, str] | None = None
        self.aws_rebalance: dict[str, str] | None = None
        self.gcp_preempted = False
        self.azure_events: list[dict[str, Any]] = []
        self.azure_incarnation = 1
        self.acks: list[str] = []
        self.requests: list[str] = []
        self.tokens: set[str] = set()

    def set(self, **changes: Any) -> None:
        with self.lock:
            for k, v in changes.items():
                setattr(self, k, v)
            self.lock.notify_all()

    def evict_aws(self, in_s: float = 30.0) -> None:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + in_s))
        self.set(aws_action={"action": "terminate", "time": when})

    def evict_gcp(self) -> None:
        self.set(gcp_preempted=True)

    def evict_azure(self, in_s: float = 30.0, event_id: str = "602d9444-d2cd-49c7-8624-8643e7171297") -> None:
        event = {
            "EventId": event_id,
            "EventType": "Preempt",
            "ResourceType": "VirtualMachine",
            "Resources": ["vm-0"],
            "EventStatus": "Scheduled",
            "NotBefore": formatdate(time.time() + in_s, usegmt=True),
            "Description": "Spot eviction",
            "EventSource": "Platform",
            "DurationInSeconds": -1,
        }
        self.set(azure_events=[event], azure_incarnation=self.azure_incarnation + 1)


class _Handler(BaseHTTPRequestHandler):
    """The documented protocols, answered from the server's `MetadataState`:

    - AWS IMDSv2: `PUT /latest/api/token` (needs `X-aws-ec2-metadata-token-ttl-seconds`) returns a token;
      `GET /latest/meta-data/spot/instance-action` and `.../events/recommendations/rebalance` need
      `X-aws-ec2-metadata-token` (401 otherwise) and answer 404 until a notice is set.
    - GCP: `GET /computeMetadata/v1/instance/preempted` needs `Metadata-Flavor: Google` (403 otherwise), answers
      "TRUE"/"FALSE" with that header; `?wait_for_change=true` holds the request until the value changes or
      `timeout_sec` passes.
    - Azure: `GET /metadata/scheduledevents?api-version=2020-07-01` needs `Metadata: true`; answers the document
      `{"DocumentIncarnation", "Events": [...]}`; `POST` with `{"StartRequests": [{"EventId"}]}` acknowledges
      (recorded in `acks`).

    The state's `mode` switches the whole server to misbehave: "ok", "garbage" (200 with nonsense), "slow" (answers
    after `slow_s`), "error" (500)."""

    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes | str, headers: dict[str, str] | None = None) -> None:
        raw = body.encode() if isinstance(body, str) else body
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _misbehave(self) -> bool:
        st = self.server.state
        if st.mode == "slow":
            time.sleep(st.slow_s)
        if st.mode == "garbage":
            self._send(200, b"\x00<html>not metadata</html>", {"Metadata-Flavor": "Google"})
            return True
        if st.mode == "error":
            self._send(500, "internal error")
            return True
        return False

    def do_PUT(self) -> None:
        st = self.server.state
        st.requests.append(f"PUT {self.path}")
        if self._misbehave():
            return
        if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            token = f"token-{len(st.tokens)}"
            st.tokens.add(token)
            self._send(200, token)
        else:
            self._send(400, "missing TTL header")

    def do_GET(self) -> None:
        st = self.server.state
        st.requests.append(f"GET {self.path}")
        if self._misbehave():
            return
        path, _, query = self.path.partition("?")
        if path.startswith("/latest/"):
            if self.headers.get("X-aws-ec2-metadata-token") not in st.tokens:
                return self._send(401, "")
            docs = {
                "/latest/meta-data/spot/instance-action": st.aws_action,
                "/latest/meta-data/events/recommendations/rebalance": st.aws_rebalance,
            }
            doc = docs.get(path)
            return self._send(404, "Not Found") if doc is None else self._send(200, json.dumps(doc))
        if path == "/computeMetadata/v1/instance/preempted":
            if self.headers.get("Metadata-Flavor") != "Google":
                return self._send(403, "Missing Metadata-Flavor:Google header.")
            params = dict(p.split("=", 1) for p in query.split("&") if "=" in p)
            if params.get("wait_for_change") == "true":
                deadline = time.monotonic() + float(params.get("timeout_sec", "60"))
                with st.lock:
                    first = st.gcp_preempted
                    while st.gcp_preempted == first and time.monotonic() < deadline:
                        st.lock.wait(timeout=max(0.0, deadline - time.monotonic()))
            value = "TRUE" if st.gcp_preempted else "FALSE"
            return self._send(200, value, {"Metadata-Flavor": "Google", "Content-Type": "application/text"})
        if path == "/metadata/scheduledevents":
            if self.headers.get("Metadata") != "true" or "api-version=" not in query:
                return self._send(400, json.dumps({"error": "Bad request"}))
            events = {"DocumentIncarnation": st.azure_incarnation, "Events": st.azure_events}
            return self._send(200, json.dumps(events), {"Content-Type": "application/json"})
        self._send(404, "Not Found")

    def do_POST(self) -> None:
        st = self.server.state
        st.requests.append(f"POST {self.path}")
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path.startswith("/metadata/scheduledevents") and self.headers.get("Metadata") == "true":
            try:
                for req in json.loads(body)["StartRequests"]:
                    st.acks.append(req["EventId"])
            except (ValueError, KeyError, TypeError):
                return self._send(400, "")
            return self._send(200, "")
        self._send(404, "")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: MetadataState

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that gave up on a slow answer (the "slow" mode) closes its socket: expected.
        import sys

        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class MetadataServer:
    """`with MetadataServer() as srv:` serves on 127.0.0.1:<free port> at `srv.url`."""

    def __init__(self) -> None:
        self.state = MetadataState()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.state = self.state
        self._thread = threading.Thread(target=self._server.serve_forever, name="metadata-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def __enter__(self) -> MetadataServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
