"""The supervisor's restart rule (``engine.launch.supervisor.Supervisor._failed``) on its own: more than
``cluster.max_restarts`` failures within ``cluster.restart_window_s`` end the job with every failure
listed, failures older than the window no longer count (a job that runs for days survives one failure a
day forever), and an exit code 2 (a config or usage error) is never restarted. The cluster is a real
``LocalCluster`` that started nothing (no worker reports); the supervision tests run whole jobs."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from engine.config import load_config
from engine.errors import LaunchError
from engine.launch.local import LocalCluster
from engine.launch.supervisor import Supervisor

DEMO = Path(__file__).resolve().parents[2] / "configs" / "logreg_demo.yaml"


def _supervisor(tmp_path: Path, window_s: float, max_restarts: int) -> tuple[Supervisor, LocalCluster]:
    cfg = load_config(DEMO, [f"checkpoint.root={tmp_path / 'ckpt'}", f"cluster.restart_window_s={window_s}",
                             f"cluster.max_restarts={max_restarts}", "cluster.warm_up=false"])
    return Supervisor(cfg, None, tmp_path / "run"), LocalCluster(cfg, tmp_path / "run")


def _dead(rank: int, code: int = -9) -> LaunchError:
    return LaunchError(f"worker {rank} died", role="worker", rank=rank, exit_code=code, reason=f"exit {code}")


def test_failures_within_the_window_end_the_job_and_older_ones_no_longer_count(tmp_path):
    sup, cluster = _supervisor(tmp_path, window_s=1.5, max_restarts=1)
    sup._failed(0, _dead(0), cluster)
    assert sup.restarts == 1 and sup.resume is None          # no checkpoint yet: from the beginning
    time.sleep(2.0)                                          # the first failure leaves the window
    sup._failed(1, _dead(1), cluster)
    assert sup.restarts == 2
    with pytest.raises(LaunchError) as e:                     # two within the window: max_restarts=1
        sup._failed(2, _dead(0), cluster)
    msg = str(e.value)
    assert "giving up after 3 failure(s)" in msg and "cluster.restart_window_s=1.5s" in msg, msg
    assert msg.count("worker") >= 3, msg                      # every failure listed


def test_a_config_or_usage_error_is_never_restarted(tmp_path):
    sup, cluster = _supervisor(tmp_path, window_s=3600, max_restarts=5)
    with pytest.raises(LaunchError, match="exited with code 2 \\(a config or usage error\\)"):
        sup._failed(0, _dead(1, code=2), cluster)
    assert sup.restarts == 0


def test_a_job_restarted_for_months_keeps_the_failures_that_count_and_the_newest_older_ones(tmp_path, monkeypatch):
    """Every failure was kept with its log's last lines and listed when the job gave up: a job that
    runs for months with a failure now and then held (and printed) all of them. Now the failures within
    the window and the newest ``MAX_OLDER_FAILURES`` older ones; the count covers all."""
    from engine.launch import supervisor
    monkeypatch.setattr(supervisor, "MAX_OLDER_FAILURES", 3, raising=False)
    sup, cluster = _supervisor(tmp_path, window_s=0.05, max_restarts=1)
    for attempt in range(12):       # one failure per window: the job survives every one
        sup._failed(attempt, _dead(attempt), cluster)
        time.sleep(0.06)
    assert sup.restarts == 12 and len(sup.failures) <= 4, len(sup.failures)
    sup._failed(12, _dead(12), cluster)
    with pytest.raises(LaunchError) as e:       # two within the window (back to back): it gives up
        sup._failed(13, _dead(13), cluster)
    msg = str(e.value)
    assert "giving up after 14 failure(s)" in msg and "older failure(s) not listed" in msg, msg
    assert "worker 13" in msg and "worker 0:" not in msg, msg
