"""The exit an eviction ends with follows what outlives the node (`policy.saves`), with a fake clock: an emergency
checkpoint in the peers' memories is exit 5 though the disk never had it, one in this node's memory only is exit 8;
and a node whose ranks stopped for another node's eviction rejoins the job instead of ending it."""

from __future__ import annotations

from ftsup.protocol import Phase
from ftsup.supervisor.policy import machine as P
from ftsup.supervisor.policy import saves
from tests.settings import settings
from tests.unit.test_emergency_saves import evicting, exits, logged
from tests.unit.test_policy import Driver


def beat(step: int, **figures: float) -> P.Heartbeat:
    return P.Heartbeat(1, 0, step, Phase.TRAIN, figures=tuple(sorted((k, float(v)) for k, v in figures.items())))


def final_exit(d: Driver) -> tuple[list[P.Action], P.Exit]:
    acts = d.feed(P.WorkersExited(1, 0))
    (final,) = [a for a in acts if isinstance(a, P.Exit)]
    return acts, final


def test_a_checkpoint_in_the_peers_memories_but_not_on_disk_is_exit_5_naming_the_peers() -> None:
    d = evicting(resume=4, reached=10)
    d.feed(beat(11, memory_step=11))
    d.feed(beat(11, peers_step=11))  # then the workers end before the disk commits
    acts, final = final_exit(d)
    assert (final.code, logged(acts, "emergency_save_failed")) == (P.EXIT_EVICTED, [])
    assert final.reason.endswith(
        "did not commit on disk; the peers' memories hold it, which outlive this node's loss: no step is lost"
    )


def test_a_checkpoint_in_this_nodes_memory_only_is_exit_8_saying_it_dies_with_the_node() -> None:
    d = evicting(resume=4, reached=10)
    d.feed(beat(11, memory_step=11))
    acts, final = final_exit(d)
    (failed,) = logged(acts, "emergency_save_failed")
    assert (final.code, failed["lost_steps"]) == (saves.EXIT_SAVE_LOST, [5, 11])
    assert "reached this node's memory only, which does not outlive the node" in str(failed["reason"])
    assert final.reason.endswith(
        "the emergency checkpoint reached this node's memory only, which does not outlive the node: steps 5-11, "
        "after the newest checkpoint, step 4, are lost"
    )


def test_an_older_step_in_the_peers_memories_saves_the_steps_up_to_it_only() -> None:
    d = evicting(resume=4, reached=10)
    d.feed(beat(11, peers_step=8))  # a periodic save's replicas, verified after the notice
    acts, final = final_exit(d)
    (failed,) = logged(acts, "emergency_save_failed")
    assert (final.code, failed["lost_steps"], failed["checkpoint_step"]) == (saves.EXIT_SAVE_LOST, [9, 11], 8)


def test_a_disk_save_that_failed_after_the_peers_verified_it_loses_no_step() -> None:
    d = evicting(resume=4, reached=10)
    d.feed(beat(11, memory_step=11, peers_step=11))
    (failed,) = logged(d.feed(beat(11, save_failed_step=11)), "emergency_save_failed")
    assert (failed["lost_steps"], failed["checkpoint_step"]) == ([], 11)
    assert "the peers' memories hold it" in str(failed["reason"])
    assert exits(d.feed(P.WorkersExited(1, 1))) == [P.EXIT_EVICTED]


def test_a_failed_disk_save_with_an_older_step_in_the_peers_memories_names_the_steps_after_it() -> None:
    d = evicting(resume=4, reached=10)
    d.feed(beat(11, peers_step=8))
    (failed,) = logged(d.feed(beat(11, save_failed_step=11)), "emergency_save_failed")
    assert (failed["lost_steps"], "hold it" in str(failed["reason"])) == ([9, 11], False)


def test_a_fallback_checkpoint_not_durable_in_time_but_in_the_peers_memories_is_exit_5() -> None:
    d = evicting(resume=4, reached=10)
    d.feed(beat(11, peers_step=11))
    d.feed(beat(11, fallback_step=11))
    _, final = final_exit(d)
    assert d.st.eviction is not None
    said, code = saves.not_durable(d.st.eviction, final, 1, d.st.newest_checkpoint, d.st.best_step)
    assert (said, code.code) == ([], P.EXIT_EVICTED)
    assert "the peers' memories hold it" in code.reason


def test_the_tiers_report_says_what_the_checkpoint_outlives() -> None:
    ej = saves.Eviction("aws", 30.0, 0.0, 1, landed=(("memory", 11, 29.0), ("peers", 11, 28.0)))
    said = saves.tiers_reached(ej, 1, 11, None)
    assert said is not None and str(said.as_dict()["reason"]).endswith(
        "; it outlives this node's loss (not the loss of the peers that hold it)"
    )
    alone = saves.tiers_reached(saves.Eviction("aws", 30.0, 0.0, 1, landed=(("memory", 11, 29.0),)), 1, 11, None)
    assert alone is not None and "a new node does not" in str(alone.as_dict()["reason"])


def test_ranks_stopped_for_another_nodes_eviction_rejoin_the_job_instead_of_ending_it() -> None:
    d = Driver(settings(nproc_max=2))
    d.launch(resume=4)
    d.train(range(5, 11), dt=0.2)
    d.feed(P.Heartbeat(1, 0, 10, Phase.TRAIN, figures=(("stopped_elsewhere_step", 10.0),)))
    d.feed(P.Heartbeat(1, 0, 11, Phase.TRAIN, figures=(("saved_step", 11.0),)))  # the emergency save it served
    acts = d.feed(P.WorkersExited(1, 0))
    (said,) = logged(acts, "peer_eviction_followed")
    assert (exits(acts), said["step"], said["level"]) == ([], 10, "warning")
    assert [a.attempt for a in acts if isinstance(a, P.PrepareLaunch)] == [2]
    assert (d.st.phase, d.st.restarts) == ("preparing", ())  # no restart counted against the budget


def test_ranks_that_end_without_stopping_for_another_node_still_finish_the_job() -> None:
    d = Driver(settings(nproc_max=2))
    d.launch(resume=4)
    d.train(range(5, 11), dt=0.2)
    assert exits(d.feed(P.WorkersExited(1, 0))) == [P.EXIT_OK]
