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
