"""Checkpoint schedule and names: durations, when deltas and bases are due, name order and parsing."""
from __future__ import annotations

import datetime as dt

import pytest

from engine.checkpoint import CheckpointConfig, Schedule, parse_duration, parse_name
from engine.checkpoint.manifest import checkpoint_name, kind_of_uri
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


def test_schedule_per_partition():
    s = Schedule(CheckpointConfig(delta_every="partition"), start_s=0.0)
    assert s.due(10.0) is None
    assert s.due(10.0, partition_done=True) == "delta"


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
