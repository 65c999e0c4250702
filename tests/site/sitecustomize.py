"""The suite's start-up hook in the Python processes its tests start (on their `PYTHONPATH`: `tests/procs.py`): no
full collection while torch imports, and what is alive then frozen; at exit, after the `atexit` handlers, the objects
alive frozen too, so the collector's last pass skips them. With `FTSUP_TEST_PROC_LOG` set, each process that exits by
itself appends its command line and CPU seconds to that file (docs/testing.md, Where the time goes).
"""

import atexit
import gc
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NoReturn

atexit.register(gc.freeze)  # registered first, so run last


class _FreezeAfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `torch` is first imported, the loader the finders after it found (ftsup's
    post-import hooks among them, in a rank under `ftsup run`) runs without full passes and freezes what is alive at
    its end."""

    def find_spec(self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None) -> Any:
        if name != "torch" or self not in sys.meta_path:
            return None
        sys.meta_path.remove(self)  # once: the finders after it are asked as the import system would ask them
        spec = next((s for f in sys.meta_path if (s := f.find_spec(name, path, target)) is not None), None)
        loader = getattr(spec, "loader", None)
        if loader is None or isinstance(loader, type) or not hasattr(loader, "__dict__"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            thresholds = gc.get_threshold()
            gc.set_threshold(thresholds[0], thresholds[1], 1 << 30)
            try:
                run(module)
            finally:
                if loader.__dict__.get("exec_module") is exec_module:
                    del loader.exec_module  # back to the class's method
                gc.set_threshold(*thresholds)
                gc.freeze()

        loader.exec_module = exec_module
        return spec


if "torch" not in sys.modules:
    sys.meta_path.insert(0, _FreezeAfterTorch())


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
