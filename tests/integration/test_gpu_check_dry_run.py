"""The GPU check's dry run (`tests/gpu/run.sh --dry-run`, docs/gpu.md): the script the GPU machine runs, run here on
the CPU, passes every stage and leaves the table and the JSON with every row at every size, marked cpu; nothing it
started is left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
SIZES = ("1GB", "12GB", "24GB")
ROWS = ("raw_write", "ftsup_async", "dcp_async", "torch_save", "ftsup_resume", "dcp_resume")


def test_the_dry_run_leaves_a_table_and_json_of_every_row_at_every_size(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["bash", "tests/gpu/run.sh", "--dry-run", str(out)]
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]
    assert (done.returncode, left) == (0, []), done.stdout[-4000:] + done.stderr[-2000:]
    result = json.loads((out / "results.json").read_text())
    stages = {s["stage"]: s["status"] for s in result["stages"]}
    assert stages == {"install": "ok", "cuda-tests": "ok", **{f"rows-{size}": "ok" for size in SIZES}}
    rows = {(r["size"], r["name"]): r["device"] for r in result["rows"]}
    assert rows == {(size, name): "cpu" for size in SIZES for name in ROWS}
    resumed = [r["exact"] for r in result["rows"] if r["name"].endswith("_resume") and r["n"]]
    assert (len(resumed) > 0, set(resumed)) == (True, {True})
    table = (out / "table.md").read_text()
    assert [f"| {size} | {name} | cpu |" in table for size in SIZES for name in ROWS] == [True] * len(SIZES) * len(ROWS)
