"""The launcher's live view of the metrics file (``ctr_report.Follower``) shows what this launch's
processes write, not the lines an earlier run left in the same file (a pinned ``model.metrics_file``
resumed), and logs each train event with its step (the job's step, continued across attempts)."""
from __future__ import annotations

import logging

from engine.programs.ctr_report import Follower, MetricsFile


def test_a_resumed_run_into_the_same_file_shows_only_its_own_events(tmp_path, caplog):
    path = tmp_path / "run.jsonl"
    old = MetricsFile(path)
    old.write({"event": "start"})
    old.write({"event": "train", "rank": 0, "epoch": 1, "step": 30, "examples_total": 3840, "logloss": 0.5})
    old.write({"event": "start"})                                  # the resumed launch's own start line
    caplog.set_level(logging.INFO, logger="engine.programs.ctr_report")
    with Follower(path, 10_000, tty=False, poll_s=0.01):
        old.write({"event": "train", "rank": 0, "epoch": 1, "step": 28, "examples_total": 128, "logloss": 0.4})
    shown = [r.getMessage() for r in caplog.records if r.getMessage().startswith("train")]
    assert len(shown) == 1 and "epoch 1 step 28:" in shown[0], shown


def test_the_bar_counts_the_jobs_examples_after_a_resume(tmp_path):
    """Each rank's ``examples_job`` (its count from the restored position on) fills the bar; before, the
    bar counted this launch's examples against the whole job's total and never filled after a resume."""
    path = tmp_path / "run.jsonl"
    f = MetricsFile(path)
    with Follower(path, 10_000, tty=True, poll_s=0.01) as follower:
        f.write({"event": "train", "rank": 0, "step": 40, "examples_total": 1000, "examples_job": 5000})
        f.write({"event": "train", "rank": 1, "step": 40, "examples_total": 1000, "examples_job": 5000})
    assert follower._bar.n == 10_000
