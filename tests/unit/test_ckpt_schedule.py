"""Checkpoint schedule and names: durations and step counts, when deltas and bases are due, name order
and parsing."""
from __future__ import annotations

import datetime as dt
import logging

import pytest

from engine.checkpoint import CheckpointConfig, Schedule, parse_duration, parse_name
from engine.checkpoint.manifest import checkpoint_name, kind_of_uri
from engine.checkpoint.schedule import Every, parse_every
from engine.errors import ConfigError


def test_durations():
    assert parse_duration("1h", "k") == 3600.0
    assert parse_duration("30m", "k") == 1800.0
    assert parse_duration("90", "k") == 90.0
    assert parse_duration("2d", "k") == 172800.0
    with pytest.raises(ConfigError, match="checkpoint.delta_every"):
        CheckpointConfig(delta_every="soon")
    with pytest.raises(ConfigError, match="base_every must be > 0"):
        CheckpointConfig(base_every="0")


def test_schedule_hourly_deltas_daily_bases():
    s = Schedule(CheckpointConfig(delta_every="1h", base_every="24h"), start_s=0.0)
    assert s.due(1800.0) is None
    assert s.due(3600.0) == "delta"
    s.done("delta", 3600.0)
    assert s.due(5400.0) is None
    assert s.due(86400.0) == "base"
    s.done("base", 86400.0)
    assert s.due(86400.0 + 3599) is None


def test_schedule_per_partition(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.checkpoint.schedule"):
        s = Schedule(CheckpointConfig(delta_every="partition"), start_s=0.0, partitions=True)
    assert s.due(10.0) is None
    assert s.due(10.0, partition_done=True) == "delta"
    assert caplog.text == ""


def test_per_partition_deltas_in_a_program_without_partitions_are_told(caplog):
    """An offline program reads no partitions: ``delta_every: partition`` writes no periodic delta
    there, which was silent."""
    with caplog.at_level(logging.WARNING, logger="engine.checkpoint.schedule"):
        s = Schedule(CheckpointConfig(delta_every="partition"), start_s=0.0, start_step=0)
    assert "checkpoint.delta_every=partition" in caplog.text and "no periodic delta" in caplog.text
    assert s.due(10.0, step=10_000) is None


def test_the_online_jobs_step_bases_count_from_the_bases_step(caplog):
    """The online job reports its steps at each partition end: ``base_every: 5000steps`` after a resume
    at step 12000 (its base's) falls due 5000 steps later, not at the first partition (it counted from
    0, and the schedule warned that step counts never fall due there)."""
    from engine.programs.ctr_online import online_schedule
    cfg = CheckpointConfig(delta_every="partition", base_every="5000steps")
    with caplog.at_level(logging.WARNING, logger="engine.checkpoint.schedule"):
        s = online_schedule(cfg, 0.0, 12_000)
    assert caplog.text == ""
    assert s.due(3600.0, partition_done=True, step=12_100) == "delta"
    assert s.due(7200.0, partition_done=True, step=17_000) == "base"
    s.done("base", 7200.0, step=17_000)
    assert s.due(10800.0, partition_done=True, step=21_000) == "delta"


@pytest.mark.parametrize("text, every", [
    ("500steps", Every(500.0, "steps")), ("1step", Every(1.0, "steps")), (" 20 steps ", Every(20.0, "steps")),
    ("0steps", Every(0.0, "steps")), ("30m", Every(1800.0, "s")), ("0.001s", Every(0.001, "s")),
    ("0", Every(0.0, "s")), ("partition", Every(0.0, "partition")),
])
def test_every_parses_times_steps_and_partition(text, every):
    assert parse_every(text, "checkpoint.delta_every", partition=True) == every


@pytest.mark.parametrize("text", ["x", "1.5steps", "steps", "500 stepz", "-5steps", "500s steps", ""])
def test_bad_delta_every_names_the_key_and_every_form(text):
    msg = (f"checkpoint.delta_every must be a duration like 30m, 1h, 3600s, a step count like 500steps, "
           f"'partition' or 0, got {text!r}")
    with pytest.raises(ConfigError) as ei:
        CheckpointConfig(delta_every=text)
    assert str(ei.value) == msg


def test_base_every_takes_steps_but_not_partition_nor_zero():
    assert CheckpointConfig(base_every="5000steps").base_every == "5000steps"
    with pytest.raises(ConfigError, match="checkpoint.base_every must be a duration like 24h, 3600s or a step "
                                          "count like 5000steps, got 'partition'"):
        CheckpointConfig(base_every="partition")
    with pytest.raises(ConfigError, match="base_every must be > 0, got '0steps'"):
        CheckpointConfig(base_every="0steps")


def test_step_deltas_are_due_after_n_steps_since_the_last_checkpoint():
    s = Schedule(CheckpointConfig(delta_every="500steps"), start_s=0.0, start_step=0)
    assert s.due(86399.0, step=499) is None        # the wall clock does not matter, only steps
    assert s.due(0.0, step=500) == "delta"
    assert s.due(0.0, step=512) == "delta"         # the first aligned point at or after 500
    s.done("delta", 0.0, step=512)
    assert s.due(0.0, step=1011) is None
    assert s.due(0.0, step=1012) == "delta"
    assert s.due(0.0) is None                      # a caller that reports no step: never by steps


def test_step_bases_take_precedence_and_restart_the_delta_count():
    s = Schedule(CheckpointConfig(delta_every="100steps", base_every="250steps"), start_s=0.0, start_step=0)
    assert s.due(0.0, step=100) == "delta"
    s.done("delta", 0.0, step=100)
    s.done("delta", 0.0, step=200)
    assert s.due(0.0, step=250) == "base"          # both periods passed (50 since the delta, 250 since the base)
    assert s.due(0.0, step=300) == "base"
    s.done("base", 0.0, step=300)
    assert s.due(0.0, step=399) is None            # the base restarted the delta count
    assert s.due(0.0, step=400) == "delta"
    assert s.due(0.0, step=550) == "base"


def test_mixed_units_step_deltas_with_hourly_bases():
    s = Schedule(CheckpointConfig(delta_every="50steps", base_every="1h"), start_s=1000.0, start_step=0)
    assert s.due(1000.0 + 3599, step=49) is None
    assert s.due(1000.0 + 3599, step=50) == "delta"
    assert s.due(1000.0 + 3600, step=50) == "base"
    s.done("base", 1000.0 + 3600, step=50)
    assert s.due(1000.0 + 3601, step=99) is None and s.due(1000.0 + 3601, step=100) == "delta"


def test_time_deltas_with_step_bases():
    s = Schedule(CheckpointConfig(delta_every="30m", base_every="1000steps"), start_s=0.0, start_step=0)
    assert s.due(1800.0, step=10) == "delta"
    assert s.due(60.0, step=1000) == "base"


def test_step_count_runs_from_the_restored_step():
    s = Schedule(CheckpointConfig(delta_every="500steps"), start_s=0.0, start_step=4000)
    assert s.due(0.0, step=4100) is None
    assert s.due(0.0, step=4500) == "delta"


def test_callers_without_steps_never_fire_by_steps_and_are_told(caplog):
    """The launcher's wall-clock thread (job_checkpoints.Periodic) reports no steps."""
    cfg = CheckpointConfig(delta_every="500steps", base_every="24h")
    with caplog.at_level(logging.WARNING, logger="engine.checkpoint.schedule"):
        s = Schedule(cfg, start_s=0.0)
    assert "checkpoint.delta_every=500steps counts steps" in caplog.text
    assert s.due(3600.0) is None and s.due(3600.0, partition_done=True) is None
    assert s.due(86400.0) == "base"                # the time period still works
    s.done("delta", 10.0)                           # done without a step does not crash either
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="engine.checkpoint.schedule"):
        Schedule(CheckpointConfig(delta_every="1h"), start_s=0.0)
        Schedule(CheckpointConfig(delta_every="0steps"), start_s=0.0)
    assert caplog.text == ""


def test_zero_means_no_periodic_deltas():
    for off in ("0", "0s", "0steps"):
        s = Schedule(CheckpointConfig(delta_every=off), start_s=0.0, start_step=0)
        assert s.due(86399.0, step=10**9) is None


def test_names_sort_and_parse():
    when = dt.datetime(2024, 1, 2, 3, 4, tzinfo=dt.timezone.utc)
    ref = checkpoint_name(when, "delta", 2)
    assert ref.name == "20240102/0304-delta.2"
    assert parse_name(ref.name) == ref
    assert parse_name("20240102/0304-base") < parse_name("20240102/0304-delta.1") < ref
    assert parse_name("20240102/0305-delta") > ref
    assert parse_name("junk/0304-base") is None and parse_name("20240102/0304-full") is None
    assert kind_of_uri("s3://b/x/20240102/0304-delta.2/") == "delta"
    with pytest.raises(ValueError):
        kind_of_uri("/tmp/plain")
