"""sd_notify without libsystemd: READY, STATUS, EXTEND_TIMEOUT_USEC and STOPPING datagrams.

A no-op when `NOTIFY_SOCKET` is not set (not started by systemd with Type=notify).
"""

from __future__ import annotations

import os
import socket


def notify(*fields: str, env: dict[str, str] | None = None) -> bool:
    path = (env if env is not None else os.environ).get("NOTIFY_SOCKET")
    if not path:
        return False
    addr = "\0" + path[1:] if path.startswith("@") else path  # '@' marks an abstract socket
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto("\n".join(fields).encode(), addr)
        return True
    except OSError:
        return False


def extend_timeout(seconds: float) -> bool:
    """Ask systemd for `seconds` more before it gives up on a stop (while a save runs)."""
    return notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}", "STATUS=saving before eviction")
