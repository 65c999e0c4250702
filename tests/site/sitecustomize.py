"""The suite's start-up hook in the Python processes its tests start (on their `PYTHONPATH`: `tests/procs.py`).

At exit, once every `atexit` handler has run, the collector's last pass skips the objects alive then: for an
interpreter holding torch that pass is most of its exit's CPU (docs/testing.md, Where the time goes).
"""

import atexit
import gc

atexit.register(gc.freeze)  # registered first, so run last
