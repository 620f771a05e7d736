"""Hourly partitions on every backend, what the source must not get wrong silently: partition contents
checked against the publisher's manifest, foreign writers' files (Hive ``000000_0``, Parquet), a
republish while the source has a backlog, stray directory names, hours that are missing or arrive late."""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

import hdfs_io
from streaming.hourly import HourlySource

SCHEMA = pa.schema([pa.field("label", pa.float32()), pa.field("x", pa.uint64())])
LOG = "streaming.hourly"


def _table(rows, start=0):
    return pa.table({"label": np.zeros(rows, np.float32), "x": np.arange(start, start + rows, dtype=np.uint64)},
                    schema=SCHEMA)


def _publish(storage, name, rows=10, files=("part-0.arrow",)):
    with hdfs_io.Publisher(storage, name, overwrite=True) as pub:
        for i, f in enumerate(files):
            pub.write_table(f, _table(rows, i * rows).to_batches(max_chunksize=max(1, rows // 2)))


def _stream_bytes(rows, batches):
    """An IPC stream of ``batches`` batches and the byte offset where its first batch ends."""
    sink = pa.BufferOutputStream()
    w = ipc.new_stream(sink, SCHEMA)
    cut = None
    for b in _table(rows).to_batches(max_chunksize=rows // batches):
        w.write_batch(b)
        cut = cut or sink.tell()
    w.close()
    return sink.getvalue().to_pybytes(), cut


def _parquet_bytes(rows):
    sink = pa.BufferOutputStream()
    pq.write_table(_table(rows), sink, row_group_size=rows // 2)
    return sink.getvalue().to_pybytes()


def _src(storage, request, **kw):
    opts = request.getfixturevalue("s3_storage_options") if storage.fs.type_name == "s3" else None
    return HourlySource(storage.uri, storage_options=opts, poll_interval_s=0.05, **kw)


def _rows(part):
    return sum(rb.num_rows for *_, rb in part.record_batches(schema=SCHEMA))


def _warnings(caplog, text):
    return [r.getMessage() for r in caplog.records
            if r.name == LOG and r.levelno == logging.WARNING and text in r.getMessage()]


# ---------------------------------------------------------------- item 1: manifest and file formats

def test_a_file_listed_in_the_manifest_but_missing_raises_naming_partition_and_file(storage, request):
    _publish(storage, "20240101/00", 300, files=("part-0.arrow", "part-1.arrow"))
    src = _src(storage, request)
    assert _rows(src.open("20240101/00")) == 600
    storage.delete("20240101/00/part-1.arrow")
    with pytest.raises(hdfs_io.CheckpointCorruptError, match=r"20240101/00.*part-1\.arrow.*missing"):
        src.open("20240101/00")
    with pytest.raises(hdfs_io.CheckpointCorruptError, match=r"20240101/00.*part-1\.arrow"):
        list(src.partitions(wait=False))


def test_a_stream_file_cut_at_a_batch_boundary_raises_with_or_without_manifest(storage, request):
    data, cut = _stream_bytes(300, batches=2)
    with hdfs_io.Publisher(storage, "20240101/00") as pub:
        pub.write_bytes("part-0.arrows", data)
    src = _src(storage, request)
    assert _rows(src.open("20240101/00")) == 300
    storage.write_bytes("20240101/00/part-0.arrows", data[:cut])             # 150 of 300 rows left
    with pytest.raises(hdfs_io.CheckpointCorruptError, match=r"20240101/00.*part-0\.arrows.*size is"):
        src.open("20240101/00")
    # another writer (no manifest): the stream's missing end-of-stream marker gives the cut away
    storage.write_bytes("20240101/01/part-0.arrows", data[:cut])
    storage.write_bytes("20240101/01/_SUCCESS", b"")
    with pytest.raises(hdfs_io.CheckpointCorruptError, match=r"20240101/01.*part-0\.arrows.*end-of-stream"):
        _rows(src.open("20240101/01"))


def test_a_file_changed_after_open_is_caught_by_its_size(storage, request):
    _publish(storage, "20240101/00", 40)
    part = _src(storage, request).open("20240101/00")
    storage.write_bytes("20240101/00/part-0.arrow", storage.read_bytes("20240101/00/part-0.arrow") + b"\0" * 8)
    with pytest.raises(hdfs_io.CheckpointCorruptError, match=r"20240101/00.*part-0\.arrow.*size is"):
        _rows(part)


def test_a_corrupt_file_of_the_listed_size_is_caught_by_its_checksum_before_any_batch_is_used(storage, request):
    """A flipped byte inside a record batch's data keeps the file's size and often still reads as Arrow:
    without the manifest's CRC-32 the hour would train on wrong values."""
    _publish(storage, "20240101/00", 300)
    part = _src(storage, request).open("20240101/00")
    data = bytearray(storage.read_bytes("20240101/00/part-0.arrow"))
    data[len(data) // 2] ^= 0xFF
    storage.write_bytes("20240101/00/part-0.arrow", bytes(data))
    seen = []
    with pytest.raises(hdfs_io.CheckpointCorruptError, match=r"20240101/00.*part-0\.arrow.*crc32 is .* manifest says"):
        for *_, rb in part.record_batches(schema=SCHEMA):
            seen.append(rb)
    assert seen == []


def test_foreign_writers_files_parquet_is_read_others_are_warned_about_once(storage, request, caplog):
    caplog.set_level(logging.WARNING, logger=LOG)
    pq_data = _parquet_bytes(100)
    storage.write_bytes("20240101/00/part-00000-c000.snappy.parquet", pq_data)   # Spark, no manifest
    storage.write_bytes("20240101/00/_SUCCESS", b"")
    ipc_data, _ = _stream_bytes(100, batches=2)
    storage.write_bytes("20240101/01/000000_0", ipc_data)                        # Hive name, no manifest
    storage.write_bytes("20240101/01/_SUCCESS", b"")
    with hdfs_io.Publisher(storage, "20240101/02") as pub:                       # ours, Parquet + notes
        pub.write_bytes("part-0.parquet", pq_data)
        pub.write_bytes("notes.txt", b"hello")
    src = _src(storage, request)
    parts = list(src.partitions(wait=False))
    assert [p.name for p in parts] == ["20240101/00", "20240101/01", "20240101/02"]
    assert [_rows(p) for p in parts] == [100, 0, 100]
    assert sorted(rb.column("x")[0].as_py() for *_, rb in parts[0].record_batches()) == [0, 50]
    list(src.partitions(wait=False))                                             # the same hours again
    hive = _warnings(caplog, "000000_0")
    assert len(hive) == 1 and "20240101/01" in hive[0] and "EMPTY" in hive[0]
    assert len(_warnings(caplog, "notes.txt")) == 1


def test_a_manifest_listing_no_readable_file_raises(storage, request):
    ipc_data, _ = _stream_bytes(100, batches=2)
    with hdfs_io.Publisher(storage, "20240101/00") as pub:
        pub.write_bytes("000000_0", ipc_data)
    with pytest.raises(hdfs_io.CheckpointCorruptError, match=r"20240101/00.*none of a supported format.*000000_0"):
        _src(storage, request).open("20240101/00")


# ---------------------------------------------------------------- item 2: republish during a backlog

def test_a_partition_republished_during_a_backlog_is_waited_for(storage, request):
    for name in ("20240101/00", "20240101/01", "20240101/02"):
        _publish(storage, name, 10)
    src = _src(storage, request)
    parts = src.partitions()                       # lists 00, 01, 02 as complete
    assert next(parts).name == "20240101/00"
    storage.delete("20240101/01")                  # Publisher(overwrite=True) removes the old one first

    def republish():
        _publish(storage, "20240101/01", 20)

    # many polls (0.05 s) see the hour gone while 02 is complete: it was complete, so it is waited for,
    # never skipped as an hour that did not come (that raced with a republish on S3 in CI)
    timer = threading.Timer(1.0, republish)
    timer.start()
    try:
        p1 = next(parts)
    finally:
        timer.join()
    assert p1.name == "20240101/01" and _rows(p1) == 20
    assert next(parts).name == "20240101/02"
    src.stop.set()
    assert next(parts, None) is None


# ---------------------------------------------------------------- item 3: stray directory names

def test_stray_day_and_hour_directories_are_ignored_with_one_warning_each(storage, request, caplog):
    caplog.set_level(logging.WARNING, logger=LOG)
    _publish(storage, "20240101/23", 10)
    storage.write_bytes("20240101/24/_SUCCESS", b"")
    storage.write_bytes("20241350/00/_SUCCESS", b"")
    src = _src(storage, request)
    assert [p.name for p in src.partitions(wait=False)] == ["20240101/23"]
    assert [p.name for p in src.partitions(after="20240101/23", wait=False)] == []
    assert len(_warnings(caplog, "20240101/24")) == 1
    assert len(_warnings(caplog, "20241350")) == 1


# ---------------------------------------------------------------- item 4: missing and late hours

def test_a_missing_hour_is_skipped_with_a_warning_and_its_late_arrival_is_reported(storage, request, caplog):
    caplog.set_level(logging.WARNING, logger=LOG)
    for name in ("20240101/00", "20240101/02", "20240101/23", "20240102/01"):
        _publish(storage, name, 10)
    src = _src(storage, request)
    got = [p.name for p in src.partitions(wait=False)]
    assert got == ["20240101/00", "20240101/02", "20240101/23", "20240102/01"]
    assert len(_warnings(caplog, "20240101/01 missing")) == 1
    assert "skipped, 20240101/02 is next" in _warnings(caplog, "20240101/01 missing")[0]
    assert len(_warnings(caplog, "20240101/03..20240101/22 (20 hours) missing")) == 1
    assert len(_warnings(caplog, "20240102/00 missing")) == 1
    _publish(storage, "20240101/01", 10)            # late: the stream is past it (and past its day)
    _publish(storage, "20240102/00", 10)
    assert [p.name for p in src.partitions(after=got[-1], wait=False)] == []
    assert list(src.partitions(after=got[-1], wait=False)) == []
    late = _warnings(caplog, "arrived too late")
    assert len(late) == 2 and "20240101/01" in late[0] and "20240102/00" in late[1]


def test_wait_for_missing_s_waits_for_a_late_hour_then_skips_it(storage, request):
    with pytest.raises(ValueError, match="wait_for_missing_s"):
        _src(storage, request, wait_for_missing_s=-1)
    _publish(storage, "20240101/00", 10)
    _publish(storage, "20240101/02", 10)
    src = _src(storage, request, wait_for_missing_s=0.8)
    assert [p.name for p in src.partitions(wait=False)] == ["20240101/00"]     # 02 is inside the bound

    def late():
        _publish(storage, "20240101/01", 10)

    timer = threading.Timer(0.3, late)
    timer.start()
    seen = []
    for p in src.partitions(after="20240101/00"):
        seen.append(p.name)
        if len(seen) == 2:
            src.stop.set()
    timer.join()
    assert seen == ["20240101/01", "20240101/02"]

    _publish(storage, "20240101/05", 10)               # 03, 04 never come
    src2 = _src(storage, request, wait_for_missing_s=0.5)
    t0 = time.monotonic()
    assert [p.name for p in src2.partitions(after="20240101/02", wait=False)] == []
    seen = [p.name for p in src2.partitions(after="20240101/02", until=src2.open("20240101/05").end)]
    assert seen == ["20240101/05"] and time.monotonic() - t0 >= 0.45
