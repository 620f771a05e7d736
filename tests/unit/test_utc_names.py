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


# ----------------------------------------------------------------------------------- zones and DST
def test_checkpoint_and_partition_names_of_zoned_times_are_utc():
    """A ``when`` that carries a zone is named in UTC: 01:30 EDT and 01:30 EST (the hour New York lives
    twice on 2024-11-03) are 05:30 and 06:30 UTC; before, both were named 0130 / hour 01."""
    import datetime as dt
    from zoneinfo import ZoneInfo

    from engine.checkpoint.manifest import checkpoint_name
    from streaming.hourly import partition_name
    ny = ZoneInfo("America/New_York")
    edt, est = dt.datetime(2024, 11, 3, 1, 30, tzinfo=ny), dt.datetime(2024, 11, 3, 1, 30, fold=1, tzinfo=ny)
    assert [checkpoint_name(w, "delta").name for w in (edt, est)] == ["20241103/0530-delta", "20241103/0630-delta"]
    assert [partition_name(w) for w in (edt, est)] == ["20241103/05", "20241103/06"]
    kolkata = dt.datetime(2024, 1, 1, 5, 30, tzinfo=ZoneInfo("Asia/Kolkata"))   # a half-hour offset
    assert checkpoint_name(kolkata, "base").name == "20240101/0000-base" and partition_name(kolkata) == "20240101/00"


def test_partitions_and_checkpoint_names_across_a_dst_change_ignore_the_local_zone(local_zone, tmp_path):
    """The hours of 2024-11-03 04..08 UTC (New York leaves DST at 06:00 UTC), read by ``HourlySource``
    and named as the online job names its checkpoints (the partition's end, seconds since the epoch),
    under a local zone far from UTC: every hour once, in order, named in UTC. (The online job itself,
    run under TZ=America/New_York, killed and resumed under TZ=Asia/Kolkata over these hours, consumed
    each once and named its checkpoints 0500..0900: checked by hand, 40 s.)"""
    import datetime as dt

    import hdfs_io
    from engine.checkpoint.manifest import checkpoint_name
    from engine.programs.online_runs import compact, expand
    from streaming.hourly import HourlySource
    start = dt.datetime(2024, 11, 3, 4, tzinfo=dt.timezone.utc)
    names = [(start + dt.timedelta(hours=h)).strftime("%Y%m%d/%H") for h in range(5)]
    st = hdfs_io.Storage.from_uri(str(tmp_path / "hours"))
    for n in names:
        st.write_bytes(f"{n}/_SUCCESS", b"")
    src = HourlySource(str(tmp_path / "hours"), poll_interval_s=0.01)
    got = [p.name for p, _ in zip(src.partitions(after=None, until=start + dt.timedelta(hours=5)), range(5))]
    assert got == names
    # CheckpointManager.save(when=seconds) names a checkpoint as fromtimestamp(when, UTC)
    ends = [checkpoint_name(dt.datetime.fromtimestamp(p.end.timestamp(), dt.timezone.utc), "delta").name
            for p in src.partitions(after=None, until=start + dt.timedelta(hours=5))]
    assert ends == [f"20241103/{h:02d}00-delta" for h in range(5, 10)]
    assert compact(names) == ["20241103/04..20241103/08"] and expand(compact(names)) == names
