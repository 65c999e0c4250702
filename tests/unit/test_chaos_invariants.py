"""The invariants of `ftsup chaos` (`ftsup.tools.faults.invariants`), over records and logs written here."""

from __future__ import annotations

import json
from pathlib import Path

from ftsup.tools.faults.invariants import (
    by_kind,
    fault_violations,
    loss_log_check,
    sample_ids,
    samples_check,
)

KILL = {
    "index": 1,
    "kind": "kill-rank",
    "variant": "",
    "detected_by": "worker_exited",
    "detect_s": 0.1,
    "recover_s": 6.0,
    "newest_before": 20,
    "loaded_step": 20,
    "loaded_consistent": True,
    "stale_processes": [],
    "lost_steps": 3,
}
EVICTION = {
    "index": 2,
    "kind": "evict-metadata",
    "variant": "azure",
    "detected_by": "eviction_noticed",
    "recover_s": 9.0,
    "newest_before": 20,
    "loaded_step": 23,
    "loaded_consistent": True,
    "stale_processes": [],
    "exit_code": 5,
    "lost_steps": 0,
    "orphans": [],
    "acknowledged": 1,
}


def test_a_fault_detected_and_recovered_from_a_sound_checkpoint_violates_nothing():
    assert fault_violations(KILL) == []


def test_an_eviction_that_saved_its_step_exited_5_and_was_acknowledged_violates_nothing():
    assert fault_violations(EVICTION) == []


def test_an_undetected_fault_is_a_violation():
    assert fault_violations({**KILL, "detected_by": None}) == ["not detected"]


def test_resuming_from_older_than_the_newest_committed_checkpoint_is_a_lost_checkpoint():
    assert [v for v in fault_violations({**KILL, "loaded_step": 15}) if "lost" in v] != []


def test_resuming_from_a_checkpoint_that_does_not_verify_is_a_violation():
    assert [v for v in fault_violations({**KILL, "loaded_consistent": False}) if "corrupt or torn" in v] != []


def test_a_process_of_an_earlier_attempt_alive_after_the_relaunch_is_a_violation():
    assert [v for v in fault_violations({**KILL, "stale_processes": ["pid 7"]}) if "earlier attempt" in v] != []


def test_a_fault_whose_observation_failed_is_one_violation_naming_why():
    assert fault_violations({**KILL, "error": "step 40: not within 180 s"}) == [
        "not observed to the end: step 40: not within 180 s"
    ]


def test_an_eviction_that_lost_steps_or_exited_otherwise_is_a_violation():
    got = fault_violations({**EVICTION, "exit_code": 1, "lost_steps": 2})
    assert [("not 5" in v, "trained again" in v) for v in got] == [(True, False), (False, True)]


def test_resuming_from_the_flipped_checkpoint_is_a_violation():
    flip = {**KILL, "kind": "flip-byte", "landed": True, "flipped_step": 20, "quarantined": []}
    assert fault_violations(flip) == ["resumed from the flipped checkpoint 20"]


def test_a_flipped_checkpoint_skipped_and_quarantined_violates_nothing():
    flip = {
        **KILL,
        "kind": "flip-byte",
        "landed": True,
        "flipped_step": 25,
        "newest_before": 20,
        "quarantined": ["step-000000025.corrupt"],
    }
    assert fault_violations(flip) == []


STOP = {
    **KILL,
    "kind": "stop-rank",
    "detected_by": "heartbeat_timed_out",
    "stopped_rank": 1,
    "incident": "20270101T000000000Z-0001-hang-abcd",
    "incident_rank": 1,
    "incident_why": "stopped (SIGSTOP/state T)",
}


def test_a_hang_whose_incident_names_the_stopped_rank_violates_nothing():
    assert fault_violations(STOP) == []


def test_a_hang_without_an_incident_record_is_a_violation():
    assert fault_violations({**STOP, "incident": None}) == ["no incident record of the hang of rank 1"]


def test_a_hang_whose_incident_names_another_rank_is_a_violation():
    assert fault_violations({**STOP, "incident_rank": 0, "incident_why": "silent first"}) == [
        "incident 20270101T000000000Z-0001-hang-abcd names rank 0 (silent first), not rank 1 that was stopped"
    ]


def test_a_straggler_that_restarted_the_job_is_a_violation():
    got = fault_violations({"index": 3, "kind": "straggler", "restarted": True, "failure": "heartbeat_timed_out"})
    assert len(got) == 1 and "heartbeat_timed_out" in got[0]


def test_a_full_disk_during_which_no_save_failed_did_not_land():
    got = fault_violations({"index": 4, "kind": "disk-full", "restarted": False, "landed": False})
    assert got == ["no save failed while the store was full: the fault did not land"]


def test_resuming_from_a_step_whose_commit_was_torn_is_a_violation():
    torn = {**KILL, "kind": "kill-in-commit", "torn_steps": [25], "loaded_step": 25, "newest_before": 20}
    assert [v for v in fault_violations(torn) if "tore" in v] != []


def write_lines(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def loss(step: int, value: float, world: int = 2) -> dict:
    return {"step": step, "loss": value, "loss_hex": value.hex(), "world_size": world, "samples": 12 * step}


def test_a_merged_loss_log_whose_last_lines_are_the_references_bitwise_passes(tmp_path):
    ref = write_lines(tmp_path / "ref.jsonl", [loss(s, 5.0 - s / 10) for s in (1, 2, 3)])
    got = write_lines(tmp_path / "got.jsonl", [loss(1, 5.0 - 0.1), loss(2, 9.9), loss(2, 5.0 - 0.2), loss(3, 4.7)])
    assert loss_log_check(ref, got, 3)["violations"] == []


def test_a_loss_one_ulp_off_on_the_same_world_size_is_a_violation(tmp_path):
    ref = write_lines(tmp_path / "ref.jsonl", [loss(1, 5.0), loss(2, 4.0)])
    got = write_lines(tmp_path / "got.jsonl", [loss(1, 5.0), loss(2, float.fromhex((4.0).hex()) + 2**-50)])
    assert loss_log_check(ref, got, 2)["violations"] == ["loss log: 1 step(s) differ from the uninterrupted run: [2]"]


def test_from_the_first_step_on_another_world_size_losses_need_only_agree_within_1e_4(tmp_path):
    ref = write_lines(tmp_path / "ref.jsonl", [loss(s, 4.0) for s in (1, 2, 3)])
    got = write_lines(tmp_path / "got.jsonl", [loss(1, 4.0), loss(2, 4.0 * (1 + 5e-5), 1), loss(3, 4.0 * (1 + 5e-5))])
    checked = loss_log_check(ref, got, 3)
    assert (checked["violations"], checked["bitwise_steps"]) == ([], 1)


def test_on_another_world_size_a_loss_1e_3_off_is_a_violation(tmp_path):
    ref = write_lines(tmp_path / "ref.jsonl", [loss(s, 4.0) for s in (1, 2)])
    got = write_lines(tmp_path / "got.jsonl", [loss(1, 4.0), loss(2, 4.0 * (1 + 1e-3), 1)])
    assert loss_log_check(ref, got, 2)["violations"] == ["loss log: 1 step(s) differ from the uninterrupted run: [2]"]


def test_a_step_missing_from_the_merged_loss_log_is_a_violation(tmp_path):
    ref = write_lines(tmp_path / "ref.jsonl", [loss(s, 4.0) for s in (1, 2, 3)])
    got = write_lines(tmp_path / "got.jsonl", [loss(1, 4.0), loss(3, 4.0)])
    assert loss_log_check(ref, got, 3)["violations"] == ["loss log: 1 step(s) missing: [2]"]


def samples(step: int, rank: int, world: int, ids: list[int]) -> dict:
    return {"step": step, "rank": rank, "world_size": world, "ids": ids}


def test_a_steps_samples_are_those_of_the_attempt_that_trained_it_last_on_its_world_size(tmp_path):
    log = write_lines(tmp_path / "loss.jsonl", [loss(1, 4.0), loss(2, 4.0), loss(2, 4.0, world=1)])
    r0 = write_lines(tmp_path / "s0.jsonl", [samples(1, 0, 2, [1]), samples(2, 0, 2, [9]), samples(2, 0, 1, [3, 4])])
    r1 = write_lines(tmp_path / "s1.jsonl", [samples(1, 1, 2, [2]), samples(2, 1, 2, [8])])
    assert sample_ids(log, [r0, r1]) == {1: [1, 2], 2: [3, 4]}


def test_a_sample_repeated_within_a_step_is_a_violation():
    got = samples_check({1: [1, 2, 3]}, {1: [1, 2, 2]}, 1)["violations"]
    assert [("other samples" in v, "repeated" in v) for v in got] == [(True, False), (False, True)]


def test_a_step_trained_on_the_references_samples_passes():
    assert samples_check({1: [1, 2], 2: [3, 4]}, {1: [1, 2], 2: [3, 4]}, 2)["violations"] == []


def test_the_summary_counts_faults_and_violations_per_kind_with_medians():
    rows = by_kind([{**KILL, "violations": []}, {**KILL, "recover_s": 8.0, "violations": ["x"]}], ["kill-rank"])
    assert (rows[0]["count"], rows[0]["violations"], rows[0]["recover_s_median"]) == (2, 1, 7.0)
