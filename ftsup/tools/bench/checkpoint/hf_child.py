"""The export `hf_export` measures, in a process of its own so that its peak RSS is the export's:
`python -m ftsup.tools.bench.checkpoint.hf_child CKPT_ROOT OUT MAX_SHARD_BYTES RESULT.json` writes the export's own
seconds (the call to the renamed, fsynced OUT), the files' bytes, the largest, their number, the RSS before the
call and the peak after it (VmHWM since exec: a child's rusage would also count the rank it was forked from).
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
    figures = {
        "export_s": seconds,
        "bytes": sum(sizes),
        "largest_shard_bytes": max(sizes),
        "shards": len(sizes),
        "export_base_rss_bytes": base,
        "peak_rss_bytes": probes.peak_rss(),
    }
    Path(result).write_text(json.dumps(figures))
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # the export is fsynced and renamed: skip torch's teardown
