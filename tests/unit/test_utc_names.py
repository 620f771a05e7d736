"""Names that carry a time are in UTC whatever ``TZ`` says: run directories, metrics files and run ids
(``engine.launch.local.new_run_dir``, ``engine.programs.ctr_report.now_stamp``), as checkpoints and hourly
partitions are (``tests/unit/test_clock_steps.py``). Before, run directories and metrics files were named
in the host's local time: a run under ``TZ=Asia/Kolkata`` resumed under ``TZ=America/New_York`` (or two
runs an hour apart across a DST change) were named out of the order they ran in."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from engine.config import load_config
from engine.launch.local import new_run_dir
from engine.programs.ctr_report import now_stamp

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["Asia/Kolkata", "America/New_York"])
def local_zone(request, monkeypatch):
    """This process's local time zone set to one far from UTC (restored after)."""
    monkeypatch.setenv("TZ", request.param)
    time.tzset()
    assert time.timezone != 0
    yield request.param
    monkeypatch.undo()
    time.tzset()


def _utc_stamps() -> set[str]:
    now = time.time()
    return {time.strftime("%Y%m%d-%H%M%S", time.gmtime(now + d)) for d in (-1.0, 0.0, 1.0)}


def test_metrics_stamps_are_utc(local_zone):
    before = _utc_stamps()
    assert now_stamp() in before | _utc_stamps()


def test_run_directories_are_named_in_utc(local_zone, tmp_path):
    cfg = load_config(REPO / "configs" / "ctr.yaml", [f"cluster.run_root={tmp_path}"])
    before = _utc_stamps()
    run = new_run_dir(cfg)
    stamp = "-".join(run.name.split("-")[-3:-1])          # {job}-{YYYYmmdd}-{HHMMSS}-{pid}
    assert stamp in before | _utc_stamps(), (run.name, os.environ["TZ"])
