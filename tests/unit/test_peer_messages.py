"""The peer memories' messages read as hostile input: an offer of the wrong size, schema, step, node, files or sizes
is refused naming what is wrong, a file with a flipped byte or torn is never kept; the ring never puts a replica in
its node's own failure domain; `checkpoint.memory`'s replicas and domain reach the ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftsup import memtier
from ftsup.protocol import MEMORY_TIER_ENV, RuntimeEnv
from ftsup.store import checksums, layout
from ftsup.supervisor.config.job import parse_config
from ftsup.supervisor.errors import ConfigError
from ftsup.supervisor.run import launcher
from ftsup.trainer.checkpoint.peermsg import HEADER_BYTES, PeerError, assign, check_file, check_offer, offer, rank_files

SHARD = b"\x01" * 1000
STATE = b'{"rank": 1}'


def manifest() -> layout.Manifest:
    files = {
        "shard-00001.safetensors": SHARD,
        "rank-00001.json": STATE,
        "shard-00000.safetensors": b"\x02" * 10,
        "dcp_metadata.json": b"{}",
    }
    entries = {k: layout.FileEntry(len(v), checksums.checksum_bytes(v)) for k, v in files.items()}
    return layout.Manifest(7, 2, "periodic", 0.0, entries, 1010, nodes={"a": (0,), "b": (1,)})


def raw_offer(body: object) -> bytes:
    raw = json.dumps(body).encode()
    return raw + b" " * (HEADER_BYTES - len(raw))


def test_a_ranks_own_offer_is_accepted_naming_its_files() -> None:
    m = manifest()
    expected = rank_files(m, [1])
    assert check_offer(offer(7, "b", expected, m), m, 7, "b", expected) == [
        "rank-00001.json",
        "shard-00001.safetensors",
    ]


GOOD = {"v": 1, "step": 7, "node": "b", "files": {"rank-00001.json": len(STATE), "shard-00001.safetensors": 1000}}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (raw_offer(GOOD)[:-1], "bytes, not"),
        (raw_offer(GOOD) + b" ", "bytes, not"),
        (b"[" * HEADER_BYTES, "a peer's offer"),
        (raw_offer([1, 2]), "not an object"),
        (raw_offer(GOOD | {"extra": 1}), "not an object"),
        (raw_offer(GOOD | {"v": 2}), "not version"),
        (raw_offer(GOOD | {"step": 8}), "not version"),
        (raw_offer(GOOD | {"step": True}), "not version"),
        (raw_offer(GOOD | {"node": "a"}), "not version"),
        (raw_offer(GOOD | {"files": {"../x": 1}}), "'..'"),
        (raw_offer(GOOD | {"files": {"/etc/passwd": 1}}), "absolute"),
        (raw_offer(GOOD | {"files": {"shard-00001.safetensors": 10**12}}), "manifest records 1000 bytes"),
        (raw_offer(GOOD | {"files": {"planted.bin": 1}}), "manifest records none"),
        (raw_offer(GOOD | {"files": {"shard-00001.safetensors": 1000}}), "not the part's files"),
        (raw_offer(GOOD | {"files": {f"f{i}": 1 for i in range(300)}}), "at most"),
    ],
)
def test_a_hostile_offer_is_refused_naming_what_is_wrong(raw: bytes, message: str) -> None:
    m = manifest()
    with pytest.raises(PeerError) as e:
        check_offer(raw, m, 7, "b", rank_files(m, [1]))
    assert message in str(e.value)


def test_an_offer_too_big_for_the_wire_is_never_made() -> None:
    m = manifest()
    many = {f"shard-{i:05d}.safetensors": layout.FileEntry(1, "x") for i in range(9000)}
    big = layout.Manifest(7, 1, "periodic", 0.0, many, 9000)
    with pytest.raises(PeerError, match="more than"):
        offer(7, "b", sorted(many), big)
    assert len(offer(7, "b", rank_files(m, [1]), m)) == HEADER_BYTES


@pytest.mark.parametrize("data", [b"\x01" * 999 + b"\x00", b"\x01" * 999, b""], ids=["flipped", "torn", "empty"])
def test_a_file_with_a_flipped_byte_or_torn_is_refused(data: bytes) -> None:
    with pytest.raises(PeerError, match="torn or corrupt"):
        check_file("shard-00001.safetensors", data, manifest(), "group rank 1")
    check_file("shard-00001.safetensors", SHARD, manifest(), "group rank 1")


def test_the_ring_skips_nodes_of_the_same_failure_domain() -> None:
    domains = {"a": "rack-1", "b": "rack-1", "c": "rack-2", "d": "rack-2"}
    assert assign(domains, 1) == {"a": ("c",), "b": ("c",), "c": ("a",), "d": ("a",)}
    assert assign({"a": "a", "b": "b", "c": "c"}, 2) == {"a": ("b", "c"), "b": ("c", "a"), "c": ("a", "b")}


def test_a_domain_of_its_own_leaves_no_peer_and_says_so_by_an_empty_ring() -> None:
    assert assign({"a": "z", "b": "z"}, 1) == {"a": (), "b": ()}


def two_nodes(memory: object, **checkpoint: object) -> dict:
    return {
        "job": {"command": ["true"], "run_id": "gpt-7"},
        "launch": {"nnodes": "2:2", "rdzv_endpoint": "127.0.0.1:29500", "node_id": "a"},
        "checkpoint": {"dir": "/ckpt", "dir_shared": False, "memory": memory, **checkpoint},
    }


def test_a_node_local_store_of_several_nodes_needs_no_durable_tier_with_peer_memories() -> None:
    cfg = parse_config(two_nodes({"replicas": 1, "domain": "rack-1"}), source="j", base_dir=Path("/"), hostname="n")
    env = launcher.rank_env(cfg, Path("/run"), None, {})
    tier = RuntimeEnv.from_environ(env).memory_tier
    want = memtier.MemoryTier("/dev/shm/ftsup-gpt-7", 1, 1, "rack-1")
    assert (env[MEMORY_TIER_ENV], tier) == ("1/1/rack-1:/dev/shm/ftsup-gpt-7", want)
    assert RuntimeEnv.from_environ(env).node_local


def test_a_node_local_store_of_several_nodes_without_peers_or_durable_tier_is_refused() -> None:
    with pytest.raises(ConfigError, match="replicas of 1 or more"):
        parse_config(two_nodes({"replicas": 0}), source="j", base_dir=Path("/"), hostname="n")


@pytest.mark.parametrize(("memory", "message"), [({"replicas": 4}, "replicas"), ({"domain": "a b"}, "domain name")])
def test_bad_replicas_or_domain_are_refused_naming_the_key(memory: object, message: str) -> None:
    with pytest.raises(ConfigError, match="checkpoint.memory") as e:
        parse_config(two_nodes(memory), source="j", base_dir=Path("/"), hostname="n")
    assert message in str(e.value)


@pytest.mark.parametrize("head", ["1/4", "1/x", "1/1/", "1/1/a b", "1/1/" + "a" * 65])
def test_bad_replicas_in_the_variable_are_an_error_naming_it(head: str) -> None:
    with pytest.raises(ValueError, match=MEMORY_TIER_ENV):
        RuntimeEnv.from_environ({MEMORY_TIER_ENV: f"{head}:/dev/shm/x"})


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("2:/m", memtier.MemoryTier("/m", 2)),
        ("2/0:/m", memtier.MemoryTier("/m", 2, 0)),
        ("1/3/r.1:/m", memtier.MemoryTier("/m", 1, 3, "r.1")),
    ],
)
def test_the_variable_round_trips_and_reads_as_before_without_replicas(raw: str, want: memtier.MemoryTier) -> None:
    assert (memtier.parse(raw, "v"), want.encode()) == (want, raw)
