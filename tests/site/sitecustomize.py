"""The suite's start-up hook in the Python processes its tests start (on their `PYTHONPATH`: `tests/procs.py`).

Full collections come ten times less often, and at exit, once every `atexit` handler has run, the collector's last
pass skips the objects alive then: for an interpreter holding torch those passes are much of its start's and exit's
CPU. With `FTSUP_TEST_PROC_LOG` set, each process that exits by itself appends its command line and CPU seconds to
that file (docs/testing.md, Where the time goes)."""

import atexit
import gc
import os
import sys
from typing import NoReturn

atexit.register(gc.freeze)  # registered first, so run last
# Full collections walk every object alive, and an interpreter importing torch makes about a million of them: at
# the default thresholds it walks them several times on the way. The suite's processes live minutes; a full
# collection every hundred of the middle generation's still runs in any that churns (docs/testing.md).
gc.set_threshold(700, 10, 100)


_logged: list[bool] = []


def _log_cpu(path: str) -> None:
    """Once per process: `ftsup.warmrun.finish` runs the `atexit` handlers itself, then calls `os._exit`."""
    import json

    if _logged:
        return
    _logged.append(True)
    times = os.times()
    line = {"argv": sys.orig_argv[1:8], "cpu_s": round(times.user + times.system, 3), "pid": os.getpid()}
    try:
        with open(path, "a") as f:  # one write per line, appended: every process of the suite shares the file
            f.write(json.dumps(line) + "\n")
    except OSError:
        pass  # a measurement, never a reason for the process to fail


if os.environ.get("FTSUP_TEST_PROC_LOG"):
    _path, _os_exit = os.environ["FTSUP_TEST_PROC_LOG"], os._exit
    atexit.register(_log_cpu, _path)

    def _logged_exit(status: int) -> NoReturn:  # the examples end in os._exit, which skips atexit
        _log_cpu(_path)
        _os_exit(status)

    os._exit = _logged_exit
