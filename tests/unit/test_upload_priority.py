"""The uploader's CPU priority (`durable_upload.Uploader(nice=...)`): where the kernel schedules by session
(autogroup), a process that leads its session sets its session's group nicer too, one that does not leaves it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_AUTOGROUP = Path("/proc/self/autogroup")

pytestmark = pytest.mark.skipif(
    not _AUTOGROUP.exists() or Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() != "1",
    reason="the kernel does not group processes by session here",
)

# An uploader with nothing to upload; the autogroup's nice once its thread has started (its housekeeping ran).
_CHILD = """
import threading, sys
from ftsup.store import durable
from ftsup.supervisor.durable.upload import Uploader
started = threading.Event()
with durable.open_tier(sys.argv[1]) as tier:
    with Uploader(tier, nice=10, housekeeping=lambda step: started.set()):
        assert started.wait(30)
        print(open("/proc/self/autogroup").read().strip())
"""


def _autogroup_after_start(tmp_path: Path, *, own_session: bool) -> str:
    """The child's /proc/self/autogroup once its uploader started: "/autogroup-123 nice 10", or empty where the
    process is scheduled by a cgroup's task group instead (a container's, a CI runner's)."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "tier")],
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=own_session,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_an_uploader_in_a_process_leading_its_session_makes_the_sessions_group_nicer(tmp_path: Path) -> None:
    after = _autogroup_after_start(tmp_path, own_session=True)
    if not after:
        pytest.skip("a new session gets no autogroup here (its processes are in a cgroup's task group)")
    assert after.rpartition(" nice ")[2] == "10", after


def test_an_uploader_in_a_session_it_does_not_lead_leaves_the_group_alone(tmp_path: Path) -> None:
    before = _AUTOGROUP.read_text().strip()  # the child shares this process's session, so its group
    assert _autogroup_after_start(tmp_path, own_session=False) == before
