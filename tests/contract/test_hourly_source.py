"""The hourly partition source on every backend: time order, _SUCCESS gating (an incomplete hour holds
back later ones), waiting for the next hour, ``until``, worker shards, resume positions."""
from __future__ import annotations

import datetime as dt
import threading

import numpy as np
import pyarrow as pa
import pytest

import hdfs_io
from streaming.errors import SchemaError
from streaming.hourly import HourlySource, partition_time

SCHEMA = pa.schema([pa.field("label", pa.float32()), pa.field("x", pa.uint64())])


def _publish(storage, name, rows, complete=True, batches=3):
    tbl = pa.table({"label": np.zeros(rows, np.float32), "x": np.arange(rows, dtype=np.uint64)}, schema=SCHEMA)
    if complete:
        with hdfs_io.Publisher(storage, name, overwrite=True) as pub:
            pub.write_table("part-0.arrow", tbl.to_batches(max_chunksize=max(1, rows // batches)))
    else:
        hdfs_io.write_ipc_file(storage, f"{name}/part-0.arrow", tbl)


def _src(storage, request, **kw):
    opts = request.getfixturevalue("s3_storage_options") if storage.fs.type_name == "s3" else None
    return HourlySource(storage.uri, storage_options=opts, **kw)


def test_order_gating_and_until(storage, request):
    for name in ("20240102/00", "20240101/23", "20240101/05"):
        _publish(storage, name, 10)
    _publish(storage, "20240102/01", 10, complete=False)
    _publish(storage, "20240102/02", 10)
    src = _src(storage, request, poll_interval_s=0.05)
    got = [p.name for p in src.partitions(wait=False)]
    assert got == ["20240101/05", "20240101/23", "20240102/00"]       # 02 held back by incomplete 01
    assert [p.name for p in src.partitions("20240101/05", wait=False)] == ["20240101/23", "20240102/00"]
    until = partition_time("20240101/23")
    assert [p.name for p in src.partitions(until=until, wait=False)] == ["20240101/05"]
    with pytest.raises(hdfs_io.NotPublishedError):
        src.open("20240102/01")


def test_waits_for_next_partition(storage, request):
    _publish(storage, "20240101/00", 8)
    src = _src(storage, request, poll_interval_s=0.05)
    seen = []

    def late():
        _publish(storage, "20240101/01", 8)

    timer = threading.Timer(0.5, late)
    timer.start()
    for p in src.partitions():
        seen.append(p.name)
        if len(seen) == 2:
            src.stop.set()
    timer.join()
    assert seen == ["20240101/00", "20240101/01"]


def test_worker_shards_cover_each_row_once_and_resume(storage, request):
    _publish(storage, "20240101/00", 30, batches=6)
    part = _src(storage, request).open("20240101/00")
    rows = []
    for w in range(3):
        for _, _, rb in part.record_batches(shard=(w, 3), schema=SCHEMA):
            rows += rb.column("x").to_pylist()
    assert sorted(rows) == list(range(30))
    tail = [rb.num_rows for _, bi, rb in part.record_batches(start_file=0, start_batch=4)]
    assert sum(tail) == 10
    bad = pa.schema([pa.field("label", pa.float32()), pa.field("y", pa.uint64())])
    with pytest.raises(SchemaError, match="column 'y'.*missing"):
        next(part.record_batches(schema=bad))


def test_partition_time_roundtrip():
    assert partition_time("20240101/05") == dt.datetime(2024, 1, 1, 5, tzinfo=dt.timezone.utc)
    with pytest.raises(ValueError):
        partition_time("2024/05")


def test_a_check_names_the_partition_file_its_row_and_the_column(storage, request):
    """A worker's share of a partition is checked batch by batch (``Partition.record_batches(check=)``,
    as the online CTR job passes ``ctr_data.check_values``): the row is counted over the file's batches,
    whichever worker reads the bad one."""
    from streaming.errors import DataFormatError
    _publish(storage, "20240101/00", 12, batches=3)                  # batches of rows 0-3, 4-7, 8-11

    def no_x_above_9(rb):
        x = rb.column("x").to_numpy()
        return ("x", int(np.flatnonzero(x > 9)[0]), "expected x <= 9") if (x > 9).any() else None

    part = next(_src(storage, request, poll_interval_s=0.05).partitions(after=None))
    assert [rb.num_rows for _, _, rb in part.record_batches(shard=(1, 2), check=no_x_above_9)] == [4]
    with pytest.raises(DataFormatError) as e:
        list(part.record_batches(shard=(0, 2), check=no_x_above_9))    # batches 0 and 2: x = 10 is row 11
    assert str(e.value) == f"{part.storage.uri_of('part-0.arrow')}: row 11: field x: expected x <= 9"
