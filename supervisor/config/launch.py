"""`launch:` how torchrun is started on this node and which world sizes are acceptable: the section and its rules.

`parse_launch` reads the section into a `LaunchConfig` or raises one `ConfigError` naming the key
(docs/design/config.md, Sections and the rules between keys).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Literal

from ftsup.supervisor.config import values as config_values
from ftsup.supervisor.config.values import Section, Where

MAX_WORLD_SIZE = 1_000_000
DEFAULT_QUARANTINE_FAILURES = 3  # `quarantine_failures` null on a multi-node job


@dataclass(frozen=True)
class LaunchConfig:
    """`launch:` how torchrun is started on this node and which world sizes are acceptable."""

    node_id: str
    """This node's name in logs, metrics and `job.state_dir`. Default: the hostname."""
    rdzv_id: str
    """torchrun's rendezvous id; equal on every node of the job. Default: `job.run_id`."""
    nproc_per_node: int | Literal["auto"] = "auto"
    """Ranks per node, or "auto": the daemon counts GPUs with `nvidia-smi` when present, else CPU slots."""
    nnodes: str = "1"
    """Node count in torchrun's form: "N", or "MIN:MAX" for an elastic job. YAML may give an int; stored as a string."""
    min_world_size: int = 1
    """The fewest ranks worth running with; below it the job waits or stops instead of launching."""
    max_world_size: int | None = None
    """The most ranks to use; null means `max_nodes * nproc_per_node` (see `max_world_size_for`)."""
    rdzv_endpoint: str | None = None
    """"host:port" of the c10d rendezvous. Required when `nnodes` allows more than one node; null = single node."""
    health_command: tuple[str, ...] | None = None
    """Optional argv printing the healthy local slot ids; null = every slot is taken as healthy (or `nvidia-smi`
    decides)."""
    torchrun_args: tuple[str, ...] = ()
    """Extra torchrun flags (for example `--local-addr=...`). Flags that ftsup derives from this config are refused."""
    global_batch: int | None = None
    """Samples per optimizer step, kept constant across world sizes: the world size is chosen to divide it. Null = read
    it from the checkpoint's metadata."""
    micro_batch: int | None = None
    """Samples per rank per forward pass; when set with `global_batch`, world_size x micro_batch must divide
    global_batch."""
    warm_agent: bool = True
    """Keep a spare torchrun agent parked, its imports done, once an attempt trains, and start the next attempt in it
    (a relaunch without the second or more of torchrun's imports; one idle interpreter's memory meanwhile)."""
    instrument: bool = True
    """Auto-instrument the ranks (`--no-instrument`: false): a start-up hook that, without a line of the script
    changed, beats at each optimizer step (so hangs are detected), bounds collectives without a timeout, and gives a
    Hugging Face or Lightning Trainer ftsup's callback and its resume (docs/supervising.md)."""
    standby: bool = False
    """A hot spare of a multi-node job: its torchrun waits in the rendezvous (never hosting its store) while the job
    has `nnodes` MAX nodes, and takes a free slot at the next round; its waits end without counting as failures, and
    it exits 0 once the newest checkpoint is the job's final one (docs/supervising.md, Hot spares)."""
    health_timeout_s: float = 30.0
    """How long each node check before an attempt may take (`health_command`, `nvidia-smi`); one that takes longer
    has failed, and is stopped."""
    min_free_disk_bytes: int = 16 << 20
    """Free space required in `checkpoint.dir` and `job.state_dir` (each one's filesystem) before an attempt; 0: not
    checked. A node below it does not join, and checks again with the restart backoff. The default refuses only a
    disk that is full: a small store (a tmpfs, a quota) still runs."""
    min_free_memory_bytes: int = 256 << 20
    """Memory available (`MemAvailable` of /proc/meminfo) required before an attempt; 0: not checked."""
    quarantine_failures: int | None = None
    """Failures put on this node (a rank of it that crashed, not for a lost peer; a rank of it stopped or stuck in a
    hang) within `quarantine_window_s` that keep it out of later attempts for `quarantine_s`. Null: 3 when `nnodes`
    allows more than one node, else never (a single node has no other to run on); 0: never."""
    quarantine_window_s: float = 3600.0
    """The sliding window over which `quarantine_failures` are counted."""
    quarantine_s: float = 3600.0
    """How long a quarantined node stays out (journaled: a restarted supervisor keeps it out); `ftsup nodes clear`
    lets it in sooner."""

    @property
    def min_nodes(self) -> int:
        """The MIN of `nnodes` (N when it is a single number)."""
        return int(self.nnodes.partition(":")[0])

    @property
    def max_nodes(self) -> int:
        """The MAX of `nnodes` (N when it is a single number)."""
        low, _, high = self.nnodes.partition(":")
        return int(high or low)

    @property
    def quarantine_after(self) -> int:
        """`quarantine_failures` in force: its null resolved (3 on several nodes, else 0: never)."""
        if self.quarantine_failures is not None:
            return self.quarantine_failures
        return DEFAULT_QUARANTINE_FAILURES if self.max_nodes > 1 else 0

    def max_world_size_for(self, nproc_per_node: int) -> int:
        """The largest world size allowed once "auto" is resolved to `nproc_per_node` ranks per node."""
        cap = self.max_nodes * nproc_per_node
        return cap if self.max_world_size is None else min(cap, self.max_world_size)


def parse_launch(sec: Section, *, run_id: str, hostname: str | None) -> LaunchConfig:
    nproc = sec.optional("nproc_per_node", config_values.nproc)
    nnodes = sec.optional("nnodes", config_values.nnodes)
    min_world = sec.optional("min_world_size", config_values.integer(1, MAX_WORLD_SIZE))
    max_world = sec.nullable("max_world_size", config_values.integer(1, MAX_WORLD_SIZE))
    node_id = sec.optional("node_id", config_values.identifier, None)
    config = LaunchConfig(
        node_id=node_id if node_id is not None else _hostname(sec.where.child("node_id"), hostname),
        rdzv_id=sec.optional("rdzv_id", config_values.identifier, run_id),
        nproc_per_node=nproc,
        nnodes=nnodes,
        min_world_size=min_world,
        max_world_size=max_world,
        rdzv_endpoint=sec.nullable("rdzv_endpoint", config_values.host_port(min_port=1, example="node0:29400")),
        health_command=sec.nullable("health_command", config_values.argv),
        torchrun_args=sec.optional("torchrun_args", config_values.torchrun_args),
        global_batch=sec.nullable("global_batch", config_values.integer(1, 2**40)),
        micro_batch=sec.nullable("micro_batch", config_values.integer(1, 2**40)),
        warm_agent=sec.optional("warm_agent", config_values.boolean),
        instrument=sec.optional("instrument", config_values.boolean),
        standby=sec.optional("standby", config_values.boolean),
        health_timeout_s=sec.optional("health_timeout_s", config_values.seconds()),
        min_free_disk_bytes=sec.optional("min_free_disk_bytes", config_values.integer(0, 2**62)),
        min_free_memory_bytes=sec.optional("min_free_memory_bytes", config_values.integer(0, 2**62)),
        quarantine_failures=sec.nullable("quarantine_failures", config_values.integer(0, 1_000_000)),
        quarantine_window_s=sec.optional("quarantine_window_s", config_values.seconds()),
        quarantine_s=sec.optional("quarantine_s", config_values.seconds()),
    )

    if max_world is not None and min_world > max_world:
        sec.fail("min_world_size", f"{min_world} is above launch.max_world_size {max_world}; lower min_world_size")
    if isinstance(nproc, int) and min_world > (cap := config.max_nodes * nproc):
        sec.fail(
            "min_world_size",
            f"{min_world} is above the maximum world size {cap} (nnodes max {config.max_nodes} x nproc_per_node "
            f"{nproc}); lower min_world_size",
        )
    if config.max_nodes > 1 and config.rdzv_endpoint is None:
        sec.fail(
            "rdzv_endpoint",
            f"required when nnodes ({nnodes}) allows more than one node; set it to the rendezvous host:port, "
            "e.g. node0:29400",
        )
    if config.standby and config.max_nodes == 1:
        sec.fail("standby", f"a hot spare needs a job of several nodes; nnodes is {nnodes}: set it to MIN:MAX")
    _check_batches(sec, config)
    return config


def _check_batches(sec: Section, config: LaunchConfig) -> None:
    """Refuse a global batch that no allowed world size can split evenly (the world size must divide it)."""
    g, micro = config.global_batch, config.micro_batch
    if g is None:
        return
    if micro is not None and g % micro:
        sec.fail("global_batch", f"{g} is not a multiple of launch.micro_batch {micro}; change one of them")
    per = micro or 1
    if isinstance(config.nproc_per_node, int):
        high = config.max_world_size_for(config.nproc_per_node)
    elif config.max_world_size is not None:
        high = config.max_world_size
    else:
        return  # the upper bound is known only once "auto" is resolved; the daemon clamps then
    low = config.min_world_size
    if g % per or not any(low <= w <= high for w in _divisors(g // per)):
        split = f"world_size x micro_batch {per}" if micro is not None else "world_size"
        sec.fail(
            "global_batch",
            f"{g} cannot be split evenly at any world size from {low} to {high} ({split} must divide it); "
            "choose a global_batch with such a divisor or widen the world size range",
        )


def _divisors(n: int) -> list[int]:
    """Every divisor of `n` >= 1 (about 2 sqrt(n) steps: world size ranges can span a million)."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return small + [n // d for d in small]


def _hostname(where: Where, given: str | None) -> str:
    """The default `launch.node_id`: `given`, else the hostname (this module's one I/O besides reading the file)."""
    name = given if given is not None else socket.gethostname()
    if len(name) > config_values.MAX_ID_CHARS or not config_values.ID.match(name):
        where.fail(f"the hostname {name!r} is not a valid id; set launch.node_id explicitly")
    return name
