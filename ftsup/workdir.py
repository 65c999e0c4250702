"""The `.ftsup` directory of a job's working directory: the checkpoint store a job uses there when nothing names
one (under `ftsup run` without a config and under plain python or torchrun alike), and its `.gitignore`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

DIRNAME = ".ftsup"
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
GITIGNORE = "# Created by ftsup: a job's state and checkpoints, not to be committed.\n*\n"


def default_checkpoint_dir(workdir: str | os.PathLike[str]) -> Path:
    """`<workdir>/.ftsup/checkpoints`: the one store of a job run from `workdir` without a named store."""
    return Path(workdir) / DIRNAME / "checkpoints"


def ignore_for_git(ftsup_dir: Path) -> None:
    """Give a `.ftsup` directory of ours a `.gitignore` of `*` (as pytest does for its cache); a directory that is
    not ours, or a `.gitignore` already there, is left alone."""
    try:
        st = os.lstat(ftsup_dir)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or os.path.lexists(ftsup_dir / ".gitignore"):
        return
    try:
        fd = os.open(ftsup_dir / ".gitignore", os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(GITIGNORE)
