"""Run a command and report its peak resident memory: `peak_rss.py -- CMD ARGS...`. The command's output passes
through; then one line `peak_rss_kib N`, from getrusage of the reaped child (exact, however brief its peak), and the
command's exit status is this script's."""

from __future__ import annotations

import resource
import subprocess
import sys

if __name__ == "__main__":
    argv = sys.argv[sys.argv.index("--") + 1 :]
    status = subprocess.call(argv)
    sys.stdout.flush()
    print(f"peak_rss_kib {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}", flush=True)
    sys.exit(status)
