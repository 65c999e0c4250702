"""A checkpoint store on a filesystem of its own that can be filled up, for the disk-full fault of
`ftsup chaos`: a size-limited tmpfs mounted for the run (which needs root, or the right to mount),
and a filler file that takes every free byte of it until it is released.

Not here: when to fill it, or what the job must do meanwhile (`inject`).
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

CHUNK = 1 << 20


class Disk:
    """A tmpfs of `size_mb` mounted at `mount_point`; `store` is the checkpoint dir on it.

    A context manager: `__exit__` releases the filler and unmounts (lazily, so that a process
    still holding a file there never keeps the run from ending).
    """

    def __init__(self, mount_point: Path, size_mb: int) -> None:
        self.mount_point = mount_point
        self.size_mb = size_mb
        self.store = mount_point / "ckpt"
        self.filler = mount_point / "filler"
        self._mounted = False

    @staticmethod
    def unavailable() -> str | None:
        """Why no tmpfs can be mounted here, or None."""
        if os.geteuid() != 0:
            return "mounting a size-limited tmpfs needs root (mount -t tmpfs)"
        return None

    def __enter__(self) -> Disk:
        self.mount_point.mkdir(parents=True, exist_ok=True)
        argv = ["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m,mode=0700", "tmpfs", str(self.mount_point)]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise OSError(f"cannot mount a tmpfs at {self.mount_point}: {e}") from e
        if done.returncode != 0:
            raise OSError(f"cannot mount a tmpfs at {self.mount_point}: {done.stderr.strip() or done.returncode}")
        self._mounted = True
        self.store.mkdir()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.release()
        if self._mounted:
            subprocess.run(["umount", "-l", str(self.mount_point)], capture_output=True, timeout=30, check=False)
            self._mounted = False

    def fill(self) -> int:
        """Write the filler until the filesystem refuses a byte more (ENOSPC); the bytes it took."""
        written = 0
        block = b"\0" * CHUNK
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        try:
            size = CHUNK
            while size:
                try:
                    written += os.write(fd, block[:size])
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    size //= 2  # the last pages: down to a single byte
        finally:
            os.close(fd)
        return written

    def free_bytes(self) -> int:
        st = os.statvfs(self.mount_point)
        return st.f_bavail * st.f_frsize

    def release(self) -> None:
        try:
            os.unlink(self.filler)
        except FileNotFoundError:
            pass
