"""The supervisor side never imports torch (DESIGN.md, Processes and channels), checked in a new process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import default_files, make_fake_checkpoint

REPO = Path(__file__).resolve().parents[2]


def modules_loaded_after(code: str) -> set[str]:
    """Names in sys.modules after running `code` in a new interpreter from the repo root."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_importing_supervisor_and_the_checkpoint_store_does_not_import_torch() -> None:
    loaded = modules_loaded_after(
        "import supervisor, ftsup.supervisor.cli, ftsup.trainer.checkpoint, ftsup.store, ftsup.store.layout, "
        "ftsup.store.checksums, ftsup.store.blocksum, ftsup.store.retention, ftsup.store.safefile, "
        "ftsup.store.choice, ftsup.store.dcpmeta, ftsup.store.errors, ftsup.store.dtypes, ftsup.store.stheader, "
        "ftsup.store.hublayout, ftsup.supervisor.cli.show"
    )
    assert "torch" not in loaded


def test_ftsup_ckpt_verify_does_not_import_torch_or_the_benchmark(tmp_path: Path) -> None:
    make_fake_checkpoint(tmp_path, 100, default_files())
    loaded = modules_loaded_after(
        "from ftsup.supervisor.cli import main\n"
        f"assert main(['ckpt', 'verify', {str(tmp_path)!r}, '--deep', '--json']) == 0"
    )
    assert {"torch", "ftsup.tools.bench.checkpoint"} & loaded == set()


def test_ftsup_ckpt_show_of_a_hugging_face_model_does_not_import_torch(tmp_path: Path) -> None:
    from tests.unit.test_hublayout import sharded

    root = sharded(tmp_path / "m")
    loaded = modules_loaded_after(
        f"from ftsup.supervisor.cli import main\nassert main(['ckpt', 'show', {str(root)!r}, '--json']) == 0"
    )
    assert "torch" not in loaded
