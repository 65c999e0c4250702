"""`ftsup bench scale`, reduced (256 simulated ranks): every operation is measured and reported in its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ftsup.tools.bench.scale import report as scale_report

OPS = [name for op, peer, _ in scale_report.OPS for name in (op, peer) if name]


def test_the_reduced_scale_run_measures_every_operation(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    argv = [sys.executable, "-m", "ftsup.supervisor.cli", "bench", "scale", "--ranks", "256", "--repeats", "1"]
    argv += ["--checkpoints", "2", "--timeout", "600", "--dir", str(tmp_path), "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert result["ranks"] == 256 and result["load_ranks"] == 128 and result["chunks"] > 256
    assert result["files_per_checkpoint"] == 3 * 256 + 2  # every rank's three files, the DCP metadata, the manifest
    assert result["manifest_bytes"] > 0 and result["dcp_metadata_bytes"] > 0 and result["dcp_pickle_bytes"] > 0
    for op in OPS:
        m = result["ops"][op]
        assert m["median_s"] > 0 and len(m["runs_s"]) >= 1 and m["peak_rss_bytes"] > 0, (op, m)
    assert set(report["targets"]) >= {
        "cached_save_plan_and_commit_metadata_s",
        "resume_choice_with_fast_verify_s",
        "refresh_no_new_checkpoint_s",
        "linear_growth",
        "memory_per_op",
        "versus_dcp",
    }
    assert "resume choice" in done.stdout
    assert not list(tmp_path.glob("ftsup-bench-scale-*"))  # removed without --keep
