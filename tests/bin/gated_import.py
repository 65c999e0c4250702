"""A module whose import waits behind a FIFO (`FTSUP_TEST_GATE`) until a test opens and closes it for writing; run as
`__main__`, it prints its argv and its session's scheduling group (`/proc/self/autogroup`). The spare agent's
import, held: `tests/integration/test_warmagent.py`."""

import os
import sys

if __name__ == "__main__":
    with open("/proc/self/autogroup") as f:
        print("ran", sys.argv[1:], f.read().strip(), flush=True)
else:
    with open(os.environ["FTSUP_TEST_GATE"]) as gate:
        gate.read()
