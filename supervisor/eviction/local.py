"""Local notice sources: a file that appears, or a command that prints a notice (docs/design/eviction.md, Local
sources: the file's contents and the command's exit statuses).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

from ftsup.supervisor.eviction.notices import Notice
from ftsup.supervisor.eviction.providers import WatchError


def _deadline(text: str, now_unix: float, default_deadline_s: float) -> float:
    text = text.strip()
    if not text:
        return now_unix + default_deadline_s
    try:
        obj = json.loads(text)
    except ValueError:
        return now_unix + default_deadline_s
    if isinstance(obj, dict):
        if isinstance(obj.get("deadline_unix"), (int, float)):
            return float(obj["deadline_unix"])
        if isinstance(obj.get("deadline_s"), (int, float)):
            return now_unix + float(obj["deadline_s"])
    return now_unix + default_deadline_s


class FileWatcher:
    name = "file"

    def __init__(self, path: Path, default_deadline_s: float):
        self.path = Path(path)
        self.default_deadline_s = default_deadline_s

    def poll(self, now_unix: float) -> Notice | None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise WatchError(f"{self.path}: {e.strerror}") from None
        return Notice("file", _deadline(text, now_unix, self.default_deadline_s), f"{self.path} appeared")

    def ack(self, notice: Notice) -> None:
        pass


class CommandWatcher:
    name = "command"

    def __init__(self, argv: Sequence[str], default_deadline_s: float, timeout_s: float = 10.0):
        self.argv = list(argv)
        self.default_deadline_s = default_deadline_s
        self.timeout_s = timeout_s

    def poll(self, now_unix: float) -> Notice | None:
        try:
            out = subprocess.run(self.argv, capture_output=True, text=True, timeout=self.timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise WatchError(f"{self.argv[0]}: {e}") from None
        if out.returncode != 0:
            raise WatchError(f"{self.argv[0]} exited {out.returncode}: {out.stderr.strip()[:200]}")
        if not out.stdout.strip():
            return None
        return Notice("command", _deadline(out.stdout, now_unix, self.default_deadline_s), out.stdout.strip()[:200])

    def ack(self, notice: Notice) -> None:
        pass
