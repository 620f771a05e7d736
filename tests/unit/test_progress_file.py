"""The progress file a supervising launcher and ``engine status`` read (``engine.progress``)."""
from __future__ import annotations

from engine import progress


def test_a_mark_is_in_the_file_when_mark_returns_even_with_the_beat_thread_writing(tmp_path):
    """A checkpoint mark is written at once, because the process may be killed before the next beat;
    the beat thread writes the same file. Both used to serialize and rename without ordering, so a
    beat that serialized before the mark could publish after it and hide the mark (the launcher then
    counted the examples since the previous mark as lost)."""
    path = tmp_path / "worker-0.progress.json"
    p = progress.Progress(str(path), interval_s=0.0005)
    try:
        for i in range(300):
            p.step(10)
            p.mark(f"ckpt-{i}")
            got = progress.read(path)
            assert got is not None and got["last_mark"] == f"ckpt-{i}", i
            assert got["marks"][f"ckpt-{i}"] == 10 * (i + 1)
    finally:
        p.close()


def test_ages_are_measured_on_the_monotonic_clock_so_a_wall_clock_step_is_no_hang(tmp_path, monkeypatch):
    """A wall-clock step of an hour (NTP, an operator) between the report and its reading: the report
    reads alive on the monotonic clock, and a real stall still reads as one. Before, ages were
    differences of wall-clock times, so a forward step declared every worker hung."""
    import time

    path = tmp_path / "worker-0.progress.json"
    p = progress.Progress(str(path), interval_s=60)
    try:
        p.step(1)
        report = progress.read(path)
        wall = time.time
        monkeypatch.setattr(time, "time", lambda: wall() + 3600.0)
        assert progress.stalled(report, time.monotonic(), 30.0, 0.0) is None
        assert "no heartbeat for 31s" in progress.stalled(report, report["mono"] + 31.0, 30.0, 0.0)
        p._state["mono"] = p._state["step_mono"] = time.monotonic() - 40.0     # a step 40 s ago, a fresh beat
        fresh = p.report()
        assert "no training step for 40s at step 1" in progress.stalled(fresh, time.monotonic(), 30.0, 0.0)
    finally:
        p.close()


def test_a_report_read_on_another_host_is_rebased_into_the_readers_clock():
    """A Ray actor reads the report on the role's node; the driver moves its monotonic times by the
    difference of the two clocks at the read (``rebase``), phases included; the wall times stay."""
    report = {"beat": 1e9, "mono": 500.0, "step_mono": 490.0, "step_time": 1e9 - 10,
              "phase": {"name": "checkpoint", "started": 1e9 - 50, "started_mono": 450.0, "deadline_s": 60.0}}
    moved = progress.rebase(report, 10_000.0)
    assert (moved["mono"], moved["step_mono"], moved["phase"]["started_mono"]) == (10_500.0, 10_490.0, 10_450.0)
    assert moved["beat"] == 1e9 and moved["phase"]["started"] == 1e9 - 50 and report["mono"] == 500.0
    assert progress.stalled(moved, 10_505.0, 30.0, 0.0) is None          # in its checkpoint phase, 55 s in
    assert "'checkpoint' has run 65s" in progress.stalled(moved, 10_515.0, 30.0, 0.0)
    assert progress.rebase(None, 1.0) is None


def test_the_file_keeps_the_newest_marks_only_so_a_worker_of_a_year_writes_a_small_one(tmp_path):
    """An online job marks every hourly partition: a worker running for a year rewrote 8,760 marks every
    half second. The newest ``MAX_MARKS`` stay (a roll-back goes to a retained checkpoint, among them);
    a mark marked again counts as the newest."""
    from engine.launch.supervisor import lost_examples
    cap = getattr(progress, "MAX_MARKS", 1024)
    path = tmp_path / "worker-0.progress.json"
    p = progress.Progress(str(path), interval_s=60)
    try:
        for h in range(3 * cap):
            p.step(10)
            p.mark(f"partition:{h}")
            if h == 5:
                p.mark("partition:0")            # again: no longer the oldest
        got = progress.read(path)
    finally:
        p.close()
    marks = got["marks"]
    assert len(marks) == cap and got["last_mark"] == f"partition:{3 * cap - 1}"
    assert list(marks)[-1] == got["last_mark"] and "partition:1" not in marks
    assert len(path.read_text()) < 64 << 10
    newest = f"partition:{3 * cap - 2}"
    assert lost_examples([{**got, "examples": got["examples"] + 30}], newest) == 40
