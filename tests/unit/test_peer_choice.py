"""The choice of a load from the nodes' memories (`peerload.choose`): the newest step whose every part some live node
holds, at most every rank's bound, each part read from memory before a peer's and a disk's, from the node's own
copies where it holds them; none where a shared store holds a newer checkpoint or a manifest does not parse."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ftsup.store import layout
from ftsup.trainer.checkpoint.peerload import choose, narrow


def manifest(step: int, created: float = 0.0) -> str:
    files = {"shard-00000.safetensors": layout.FileEntry(1, "crc32cx64k:00000000")}
    files |= {"shard-00001.safetensors": layout.FileEntry(1, "crc32cx64k:00000000")}
    m = layout.Manifest(step, 2, "periodic", created, files, 2, nodes={"a": (0,), "b": (1,)})
    return json.dumps(m.to_json())


def held(step: int, part: str, tier: str, text: str) -> dict[str, Any]:
    digest = hashlib.sha256(text.encode()).hexdigest()
    return {"step": step, "part": part, "tier": tier, "path": f"/{tier}/{part}/{step}", "digest": digest}


def report(node: str, copies: list[tuple[int, str, str, str]], at_most: int | None = None) -> dict[str, Any]:
    held_ = [held(s, p, t, text) for s, p, t, text in copies]
    texts = {h["digest"]: text for h, (_, _, _, text) in zip(held_, copies, strict=True)}
    return {"node": node, "leader": True, "at_most": at_most, "held": held_, "texts": texts}


M8, M12 = manifest(8), manifest(12)


def test_a_node_that_came_back_empty_receives_both_parts_from_the_node_holding_them() -> None:
    a = report("a", [(8, "a", "memory", M8), (8, "b", "peers", M8)])
    plan = choose([a, report("b", [])], None)
    assert plan is not None and plan["step"] == 8
    assert plan["links"] == {0: [["a", "/memory/a/8", "memory"], ["b", "/peers/b/8", "peers"]], 1: []}
    assert [(m["from"], m["to"], m["part"]) for m in plan["moves"]] == [(0, 1, "a"), (0, 1, "b")]
    assert plan["meta"] == [0, "/memory/a/8"]  # the preferred copy's holder reads the metadata


def test_the_newest_step_every_part_of_which_is_held_is_chosen() -> None:
    a = report("a", [(12, "a", "memory", M12), (8, "a", "memory", M8), (8, "b", "peers", M8)])
    plan = choose([a, report("b", [])], None)  # b's part of step 12 is nowhere
    assert plan is not None and plan["step"] == 8


def test_every_ranks_bound_holds_and_a_newer_shared_store_wins() -> None:
    a = report("a", [(12, "a", "memory", M12), (12, "b", "peers", M12), (8, "a", "memory", M8), (8, "b", "peers", M8)])
    bounded = choose([a, report("b", [], at_most=8)], None)
    assert bounded is not None and bounded["step"] == 8
    assert choose([a, report("b", [])], 13) is None


def test_a_part_comes_from_memory_before_a_disk_and_from_the_nodes_own_copy() -> None:
    a = report("a", [(8, "a", "disk", M8), (8, "a", "memory", M8), (8, "b", "peers", M8)])
    b = report("b", [(8, "b", "memory", M8)])
    plan = choose([a, b], None)
    assert plan is not None and plan["links"][0] == [["a", "/memory/a/8", "memory"], ["b", "/peers/b/8", "peers"]]
    assert [(m["from"], m["part"]) for m in plan["moves"]] == [(0, "a")]


def test_a_copy_found_damaged_is_never_chosen_and_the_part_comes_from_the_next_copy() -> None:
    a = report("a", [(8, "a", "memory", M8), (8, "b", "peers", M8)])
    b = report("b", [(8, "b", "disk", M8)])
    plan = choose([a, b], None, skip=[(0, "/peers/b/8")])
    assert plan is not None and plan["links"][0] == [["a", "/memory/a/8", "memory"]]
    assert [(m["from"], m["to"], m["part"], m["tier"]) for m in plan["moves"]] == [
        (1, 0, "b", "disk"),
        (0, 1, "a", "memory"),
    ]


def test_with_the_only_copy_of_a_part_damaged_the_older_step_all_hold_is_chosen() -> None:
    a = report("a", [(12, "a", "memory", M12), (12, "b", "peers", M12), (8, "a", "memory", M8), (8, "b", "peers", M8)])
    plan = choose([a, report("b", [])], None, skip=[(0, "/peers/b/12")])
    assert plan is not None and plan["step"] == 8


def test_a_manifest_that_does_not_parse_or_lies_about_its_step_is_never_chosen() -> None:
    bad = "{not json"
    a = report("a", [(8, "a", "memory", bad), (8, "b", "peers", bad)])
    assert choose([a, report("b", [])], None) is None
    lying = report("a", [(9, "a", "memory", M8), (9, "b", "peers", M8)])
    assert choose([lying, report("b", [])], None) is None


# --------------------------------------------------------------------------- what each node fetches (`narrow`)

FILES = ["dcp_metadata.json", "rank-00000.json", "rank-00001.json"]
FILES += [f"shard-0000{r}.{ext}" for r in (0, 1) for ext in ("crc32", "safetensors")]


def whole(step: int) -> layout.Manifest:
    files = {rel: layout.FileEntry(1, "crc32cx64k:00000000") for rel in FILES}
    return layout.Manifest(step, 2, "periodic", 0.0, files, 2, nodes={"a": (0,), "b": (1,)})


def lost_b() -> tuple[dict[str, Any], layout.Manifest]:
    """Node b came back empty: a holds its own part and its replica of b's."""
    text = json.dumps(whole(8).to_json())
    plan = choose([report("a", [(8, "a", "memory", text), (8, "b", "peers", text)]), report("b", [])], None)
    assert plan is not None
    return plan, whole(8)


def test_a_node_whose_rank_reads_its_own_part_receives_that_part_and_the_files_of_every_node_only() -> None:
    plan, m = lost_b()
    b_reads = ["rank-00001.json", "shard-00001.crc32", "shard-00001.safetensors"]
    a_reads = ["rank-00000.json", "shard-00000.crc32", "shard-00000.safetensors", "shard-00001.safetensors"]
    narrowed = narrow(plan, m, [{"node": "a", "files": a_reads}, {"node": "b", "files": b_reads}])
    assert [(mv["from"], mv["to"], mv["part"], mv["files"]) for mv in narrowed["moves"]] == [
        (0, 1, "b", [*b_reads, "dcp_metadata.json"])
    ]
    assert narrowed["links"][0] == [
        ["a", "/memory/a/8", "memory", ["rank-00000.json", "shard-00000.crc32", "shard-00000.safetensors", *FILES[:1]]],
        ["b", "/peers/b/8", "peers", ["shard-00001.safetensors"]],
    ]


def test_a_rank_that_could_not_plan_its_reads_gets_its_node_every_file() -> None:
    plan, m = lost_b()
    narrowed = narrow(plan, m, [{"node": "a", "files": []}, {"node": "b", "files": None}])
    got = sorted(rel for mv in narrowed["moves"] for rel in mv["files"])
    assert got == sorted(FILES) and [mv["part"] for mv in narrowed["moves"]] == ["a", "b"]


def test_a_node_that_reads_no_part_still_receives_the_files_of_every_node() -> None:
    plan, m = lost_b()
    narrowed = narrow(plan, m, [{"node": "a", "files": []}, {"node": "b", "files": []}])
    assert [(mv["part"], mv["files"]) for mv in narrowed["moves"]] == [("a", ["dcp_metadata.json"])]
    assert narrowed["links"][0] == [["a", "/memory/a/8", "memory", ["dcp_metadata.json"]]]


def test_a_leader_keeps_as_received_only_the_files_no_other_rank_of_its_node_reads() -> None:
    def reads(*ranks: int) -> list[str]:
        return [f"shard-0000{r}.{ext}" for r in ranks for ext in ("crc32", "safetensors")]

    files = {rel: layout.FileEntry(1, "crc32cx64k:00000000") for rel in [*reads(0, 1, 2, 3), "dcp_metadata.json"]}
    m = layout.Manifest(8, 4, "periodic", 0.0, files, 4, nodes={"a": (0, 1), "b": (2, 3)})
    text = json.dumps(m.to_json())
    follower = {"leader": False, "at_most": None}
    reports = [report("a", [(8, "a", "memory", text), (8, "b", "peers", text)]), {"node": "a", **follower}]
    plan = choose([*reports, report("b", []), {"node": "b", **follower}], None)
    assert plan is not None and plan["leaders"] == {"a": 0, "b": 2}
    needs = [{"node": "a", "files": reads(0)}, {"node": "a", "files": reads(1)}, {"node": "b", "files": reads(2)}]
    # Rank 3 reads a shard of rank 2's too (a tensor saved once, by rank 2): rank 2 keeps nothing of its own.
    assert narrow(plan, m, [*needs, {"node": "b", "files": reads(2, 3)}])["alone"] == {0: reads(0), 2: []}
    assert narrow(plan, m, [*needs, {"node": "b", "files": reads(3)}])["alone"] == {0: reads(0), 2: reads(2)}
    # A rank that could not plan its reads reads every file: its leader keeps none.
    assert narrow(plan, m, [*needs, {"node": "b", "files": None}])["alone"] == {0: reads(0)}
