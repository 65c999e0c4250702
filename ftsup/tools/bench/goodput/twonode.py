"""The contenders of `ftsup bench node-loss`: the reference trainer as one job of two nodes on 127.0.0.1 (c10d,
`--nnodes 1:2` or `2:2`, one rank each), each node with its own disk and memory directories, started by `ftsup run`
with the peer-memory tier (`ftsup-peers`) or the durable tier instead (`ftsup-durable`), or by plain elastic
`torchrun` or `ft_launcher` (tuned timeouts), the trainer resuming by itself from its node-local directories.
Config and argv only: `nodedrive` runs them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ftsup.protocol import NODE_ID_ENV, NODE_LOCAL_ENV
from ftsup.tools.bench.goodput.contenders import (
    NVRX_LAUNCHER,
    NVRX_RANK,
    TORCH_WORKAROUND,
    TRAINER,
    Contender,
    NvrxTimeouts,
)
from ftsup.tools.faults.nodes import RDZV_CONF
from ftsup.tools.faults.refjob import TrainerJob, child_env

NAMES = ("ftsup-peers", "ftsup-durable", "torchrun", "nvrx-tuned")
KEEP_LAST = 2  # the memory tier's and the durable tier's retention (the memory tier allows at most 2)


@dataclass(frozen=True)
class Node:
    """One node of the job: `key` (`a` or `b`), its node id, and its directories under `root / id`."""

    key: str
    node_id: str
    root: Path

    @property
    def home(self) -> Path:
        """Everything of the node the bench wipes when it loses it (its disk, its state; not its output)."""
        return self.root / self.node_id

    @property
    def disk(self) -> Path:
        return self.home / "disk"

    @property
    def state(self) -> Path:
        return self.home / "state"

    @property
    def config_path(self) -> Path:
        return self.root / f"{self.node_id}.yaml"

    def marker(self) -> str:
        """What every process of this node carries in its environment: its node id."""
        return f"{NODE_ID_ENV}={self.node_id}"


@dataclass(frozen=True)
class TwoNodeJob:
    """The job in `base.root` (its loss log, its trainer flags): nodes `a` and `b`, the rendezvous on
    127.0.0.1:`port`, each node's memory directory under `memory_root` (a tmpfs where there is one)."""

    base: TrainerJob
    port: int
    memory_root: Path
    max_restarts: int
    nnodes: str = "1:2"  # "2:2": the survivor waits for the replacement instead of training alone

    def nodes(self) -> tuple[Node, Node]:
        prefix = self.base.run_id
        return Node("a", f"{prefix}-a", self.base.root), Node("b", f"{prefix}-b", self.base.root)

    def memory(self, node: Node) -> Path:
        return self.memory_root / node.node_id

    def trainer_args(self, ckpt_dir: Path | None) -> list[str]:
        """The trainer's flags, with `--ckpt-dir` the node's own (None: from the supervisor's environment)."""
        args = self.base.trainer_args()
        i = args.index("--ckpt-dir")
        del args[i : i + 2]
        return args if ckpt_dir is None else [*args, "--ckpt-dir", str(ckpt_dir)]


@dataclass(frozen=True)
class NodeContender:
    name: str
    durable_url: str | None = None  # ftsup-durable's s3://BUCKET/PREFIX

    @property
    def command(self) -> str:
        if self.name == "torchrun":
            return "torchrun --rdzv-backend c10d --max-restarts N (node-local checkpoint dirs)"
        if self.name == "nvrx-tuned":
            return f"ft_launcher --rdzv-backend c10d {' '.join(NvrxTimeouts().flags())} (as torchrun)"
        tier = "checkpoint.memory replicas 1" if self.name == "ftsup-peers" else "checkpoint.durable on SeaweedFS"
        return f"ftsup run (checkpoint.dir_shared false, {tier})"

    def missing(self) -> str | None:
        """Why this contender cannot run here (the one-node bench's answer: ft_launcher not installed), or None."""
        return Contender(self.name, 0, 0.0).missing()

    def checkpoint(self, job: TwoNodeJob, node: Node) -> dict[str, Any]:
        """The `checkpoint` section of a node's ftsup config."""
        section: dict[str, Any] = {"dir": str(node.disk), "dir_shared": False}
        if self.name == "ftsup-peers":
            section["memory"] = {"dir": str(job.memory(node)), "replicas": 1, "keep_last": KEEP_LAST}
        else:
            if self.durable_url is None:
                raise ValueError("ftsup-durable needs the durable tier's s3:// URL")
            section["durable"] = {"url": self.durable_url, "keep_last": KEEP_LAST, "periodic_every": 1}
        return section

    def config(self, job: TwoNodeJob, node: Node) -> dict[str, Any]:
        """A node's ftsup config as a mapping."""
        cfg = job.base.config()
        cfg["job"]["command"] = [sys.executable, "-m", TRAINER, *job.trainer_args(None)]
        cfg["job"]["state_dir"] = str(node.state)
        cfg["job"]["env"].update(TORCH_WORKAROUND)
        cfg["launch"] = {
            "nproc_per_node": job.base.nproc,
            "nnodes": job.nnodes,
            "rdzv_endpoint": f"127.0.0.1:{job.port}",
            "node_id": node.node_id,
            "torchrun_args": [RDZV_CONF],
        }
        cfg["checkpoint"] = self.checkpoint(job, node)
        cfg["restart"] = {"backoff_initial_s": 0.5, "max_restarts": job.max_restarts}
        return cfg

    def argv(self, job: TwoNodeJob, node: Node) -> list[str]:
        """The command that starts `node` (its config written first, for ftsup)."""
        if not self.name.startswith("ftsup"):
            launcher, rank = (
                ("torch.distributed.run", TRAINER) if self.name == "torchrun" else (NVRX_LAUNCHER, NVRX_RANK)
            )
            return [
                sys.executable,
                "-m",
                launcher,
                f"--nnodes={job.nnodes}",
                f"--nproc-per-node={job.base.nproc}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{job.port}",
                f"--rdzv-id={job.base.run_id}",
                RDZV_CONF,
                f"--max-restarts={job.max_restarts}",
                *(NvrxTimeouts().flags() if self.name == "nvrx-tuned" else []),
                "-m",
                rank,
                *job.trainer_args(node.disk),
            ]
        node.config_path.write_text(yaml.safe_dump(self.config(job, node), sort_keys=False))
        return [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(node.config_path)]

    def env(self, node: Node, extra: dict[str, str]) -> dict[str, str]:
        """The launcher's environment: its node id (every process of the node inherits it: the bench finds them
        by it), and for torchrun the trainer's node-local store (what ftsup's config says for the others)."""
        env = {**extra, **TORCH_WORKAROUND, NODE_ID_ENV: node.node_id}
        if not self.name.startswith("ftsup"):
            env[NODE_LOCAL_ENV] = "1"
        return child_env(**env)


def contenders(names: list[str], durable_url: str | None) -> list[NodeContender]:
    """The contenders named, in the table's order."""
    unknown = sorted(set(names) - set(NAMES))
    if unknown:
        raise ValueError(f"unknown contender(s) {', '.join(unknown)}: the contenders are {', '.join(NAMES)}")
    return [NodeContender(n, durable_url if n == "ftsup-durable" else None) for n in NAMES if n in names]
