"""Two ranks over gloo exchange one part as the peer memories do (`peers.exchange`), rank 0 sending, rank 1
receiving: `honest`, an offer of other sizes (`lying`), a file that cannot be read once offered (`vanished`), one
whose bytes differ from the manifest's (`flipped`), or a check or read raising what no check expects (`check-bug`,
`read-bug`). Rank 1 writes what each side saw to --out.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch.distributed as dist

from ftsup.store import checksums, layout
from ftsup.trainer.checkpoint.comm import GroupComm
from ftsup.trainer.checkpoint.peermsg import HEADER_BYTES, check_offer, offer
from ftsup.trainer.checkpoint.peers import Transfer, exchange

FILES = {"shard-00000.safetensors": b"\x07" * 300_000, "rank-00000.json": b'{"rank": 0}'}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=["honest", "lying", "vanished", "flipped", "check-bug", "read-bug"])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    comm = GroupComm(dist.new_group(backend="gloo"))
    entries = {k: layout.FileEntry(len(v), checksums.checksum_bytes(v)) for k, v in FILES.items()}
    manifest = layout.Manifest(3, 2, "periodic", 0.0, entries, 300_000, nodes={"a": (0,), "b": (1,)})
    rels = sorted(FILES)
    if comm.rank == 0:
        header = offer(3, "a", rels, manifest)
        if args.case == "lying":
            raw = json.dumps({"v": 1, "step": 3, "node": "a", "files": {r: 10**9 for r in rels}}).encode()
            header = raw + b" " * (HEADER_BYTES - len(raw))

        def read(rel: str) -> bytes:
            if args.case == "vanished" and rel.startswith("shard"):
                raise OSError(2, "No such file or directory")
            if args.case == "read-bug" and rel.startswith("shard"):
                raise KeyError(rel)
            data = FILES[rel]
            return data[:-1] + b"\x00" if args.case == "flipped" and rel.startswith("shard") else data

        send = Transfer(1, "a", header, rels, read, manifest=manifest)
        exchange(comm, [send], [])
        box = [send.error]
        dist.broadcast_object_list(box, src=0)
    else:

        def check(raw: bytes) -> list[str]:
            if args.case == "check-bug":
                raise ValueError("a check that fails as no check should")
            return check_offer(raw, manifest, 3, "a", rels)

        recv = Transfer(0, "a", check=check, manifest=manifest)
        exchange(comm, [], [recv])
        box = [None]
        dist.broadcast_object_list(box, src=0)
        got = {rel: bytes(data) == FILES[rel] for rel, data in recv.got.items()}
        with open(args.out, "w") as f:
            json.dump({"sender_error": box[0], "receiver_error": recv.error, "kept": got}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
