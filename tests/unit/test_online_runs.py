"""An online run's partitions as its checkpoints record them (``engine.programs.online_runs``): ranges of
consecutive hours, so the manifest of a run of a year is as small as that of a run of a day; manifests
written before (one name each) read the same."""
from __future__ import annotations

import datetime as dt
import json

import pytest

from engine.programs.online_runs import compact, expand
from streaming.hourly import partition_name

START = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)


def _hours(first: int, n: int) -> list[str]:
    return [partition_name(START + dt.timedelta(hours=h)) for h in range(first, first + n)]


def test_a_year_of_consecutive_hours_is_one_range_and_reads_back_the_same():
    year = _hours(0, 8760)
    entries = compact(year)
    assert entries == ["20240101/00..20241230/23"]
    assert expand(entries, 8760) == year
    # a year listed one name each was ~130 KB in every manifest
    assert len(json.dumps(year)) > 100_000 and len(json.dumps(entries)) < 100


def test_gaps_repeats_and_single_hours_keep_their_order():
    names = _hours(0, 3) + _hours(5, 1) + _hours(7, 2) + _hours(8, 1) + _hours(23, 2)   # a gap, a repeat
    entries = compact(names)
    assert entries == ["20240101/00..20240101/02", "20240101/05", "20240101/07..20240101/08", "20240101/08",
                       "20240101/23..20240102/00"]
    assert expand(entries, len(names)) == names
    assert compact([]) == [] and expand([]) == [] and expand([], 0) == []


def test_a_manifest_written_before_the_ranges_reads_as_it_was():
    old = _hours(0, 3) + _hours(10, 1)          # one name each, no partitions_count
    assert expand(old) == old


@pytest.mark.parametrize("entries, count, message", [
    (["2024010100"], None, "expected a partition name YYYYMMDD/HH, got '2024010100'"),
    (["20240101/05..20240101/02"], None, "partition range '20240101/05..20240101/02' ends before it starts"),
    (["20240101/00..20240101/02"], 2, "partitions_count is 2 but the ranges stand for 3 partitions"),
    (["20241301/00"], None, "got '20241301/00'"),
    ([5], None, "got 5"),
    ("20240101/00", None, "expected a list of partition names and ranges, got str"),
])
def test_a_damaged_record_is_one_clear_error_naming_the_entry(entries, count, message):
    with pytest.raises(ValueError) as e:
        expand(entries, count)
    assert message in str(e.value)
    with pytest.raises(ValueError, match="expected a partition name"):
        compact(["20240101-05"])


def test_the_final_line_of_a_run_of_a_year_gives_ranges_and_a_count(tmp_path):
    """``engine train`` prints the online job's final JSON line with the run's partitions: listed one name
    each, a run of a year made it a 131 KB line (found by an audit). Now ranges, as the manifests hold
    them, and how many partitions they stand for."""
    from engine.config import load_config
    from engine.programs import ctr_online
    from pathlib import Path
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "ctr_online.yaml",
                      ["observability.tensorboard=false"])
    year = _hours(0, 8760)
    names = year[:100] + year[101:]                     # one hour skipped
    line = json.dumps(ctr_online.final(cfg, [{"rank": 1, "partitions": names}, {"rank": 0, "partitions": names,
                                                                                 "last_partition": names[-1]}]))
    event = json.loads(line)
    assert len(line) < 1000, len(line)
    assert event["partitions"] == ["20240101/00..20240105/03", "20240105/05..20241230/23"]
    assert event["partitions_count"] == 8759 and expand(event["partitions"], event["partitions_count"]) == names
    assert event["last_partition"] == "20241230/23"
    nothing = ctr_online.final(cfg, [{"rank": 0, "partitions": [], "last_partition": None}])
    assert nothing["partitions"] == [] and nothing["partitions_count"] == 0
