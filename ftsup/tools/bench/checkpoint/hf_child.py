"""The export `hf_export` measures, in a process of its own so that the process's peak RSS is the export's.

    python -m ftsup.tools.bench.checkpoint.hf_child CKPT_ROOT OUT MAX_SHARD_BYTES RESULT.json

Calls `ftsup.trainer.hf.export.export_hf` (what `ftsup ckpt export-hf` runs) on the newest checkpoint of
CKPT_ROOT and writes RESULT.json: the export's own duration (from the call to the renamed, fsynced OUT, without
the interpreter's start and imports), the bytes of the files it wrote, the largest of them, their number, the RSS
before the call (what the imports took) and, after it, the process's peak RSS (VmHWM: the high-water mark of this
program's memory since its exec, imports included; the kernel's rusage of a child would also count the memory of
the rank it was forked from, which it held until the exec).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    ckpt, out, max_shard, result = argv
    from ftsup.tools.bench.checkpoint import probes
    from ftsup.trainer.hf.export import export_hf

    base = probes.current_rss()
    start = time.perf_counter()
    index = export_hf(ckpt, None, out, max_shard_bytes=int(max_shard))
    seconds = time.perf_counter() - start
    sizes = [os.path.getsize(Path(out) / f) for f in sorted(set(index["weight_map"].values()))]
    Path(result).write_text(json.dumps({"export_s": seconds, "bytes": sum(sizes), "largest_shard_bytes": max(sizes),
                                        "shards": len(sizes), "export_base_rss_bytes": base,
                                        "peak_rss_bytes": probes.peak_rss()}))  # fmt: skip
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # the export is fsynced and renamed: skip torch's teardown
