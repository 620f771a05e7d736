"""The examples a gang restart loses, from the workers' progress reports (engine.launch.supervisor)."""
from __future__ import annotations

from engine.launch.ray import ACTOR_DIED
from engine.launch.supervisor import lost_examples


def test_lost_examples_counts_past_the_checkpoint_mark_and_skips_workers_without_a_report():
    reports = [{"examples": 900, "marks": {"0:64": 500}},      # 400 trained after the checkpoint
               {"examples": 300},                               # no mark for it: all 300 are lost
               None,                                            # never reported
               ACTOR_DIED]                                      # a Ray actor that died while being read
    assert lost_examples(reports, "0:64") == 700
    assert lost_examples(reports, None) == 1200


def test_in_lockstep_the_furthest_worker_counts_for_every_worker():
    """Sync and hybrid workers run the same steps: a peer killed with the world may have reported fewer."""
    from engine.modes import LOCKSTEP_MODES, AsyncMode, GeoMode, SyncMode
    reports = [{"examples": 768, "marks": {"0:20": 640}}, {"examples": 640, "marks": {"0:20": 640}}]
    assert lost_examples(reports, "0:20") == 128
    assert lost_examples(reports, "0:20", lockstep=True) == 256
    assert lost_examples([None, None], "0:20", lockstep=True) == 0
    assert {"sync", "hybrid"} == LOCKSTEP_MODES
    assert SyncMode.lockstep and not AsyncMode.lockstep and not GeoMode.lockstep
