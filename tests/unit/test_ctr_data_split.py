"""How the train rows are split among the CTR workers: every row in exactly one shard, the shards within
one row of each other whatever the files' sizes and record batches, and a lockstep epoch (sync, hybrid)
that trains every row.

Before, a worker got whole files (``w::W`` of the list) when there were as many files as workers, so the
shards were as unequal as the files, and the lockstep modes, which run the smallest shard's step count,
left the rest of every longer shard out of every epoch, silently: 3 files of 800 rows for 2 workers
trained 1,536 of 2,400 rows an epoch in sync mode (1,696 in hybrid), 10 files of unequal size for 4
workers 1,024 of 4,600 (real jobs, 2026-11-30). Real Arrow IPC streams, IPC files and Parquet files."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.modes.base import Mode
from engine.programs.ctr_data import (check_train_split, expected_schema, file_rows, make_source, shard_sizes,
                                      untrained_rows)

SCHEMA = expected_schema(["C1"], 0)


def _table(start: int, n: int) -> pa.Table:
    """Rows ``start..start+n-1``, the row id as the C1 key (labels 0/1)."""
    ids = np.arange(start, start + n, dtype=np.uint64)
    return pa.table({"label": pa.array((ids % 2).astype(np.float32)), "C1": pa.array(ids)}, schema=SCHEMA)


def _write(path: Path, start: int, n: int, batch_rows: int, fmt: str) -> None:
    t = _table(start, n)
    if fmt == "parquet":
        pq.write_table(t, str(path), row_group_size=max(1, batch_rows))
        return
    with pa.OSFile(str(path), "wb") as f:
        w = pa.ipc.new_stream(f, SCHEMA) if fmt == "stream" else pa.ipc.new_file(f, SCHEMA)
        if n == 0:
            w.write_batch(pa.RecordBatch.from_pylist([], schema=SCHEMA))     # a zero-row record batch
        for rb in t.to_batches(max_chunksize=batch_rows):
            w.write_batch(rb)
        w.close()


def _layout(d: Path, sizes, batch_rows: int, fmt: str = "stream") -> int:
    d.mkdir()
    start = 0
    for i, n in enumerate(sizes):
        _write(d / f"part-{i:05d}{'.parquet' if fmt == 'parquet' else '.arrow'}", start, n, batch_rows, fmt)
        start += n
    return start


def _ids(path: Path, rank: int, workers: int, rows=None, **kw) -> np.ndarray:
    src = make_source(str(path), batch_size=7, schema=SCHEMA, rank=rank, num_workers=workers, prefetch=0,
                      file_rows=rows if rows is not None else file_rows(str(path)), **kw)
    got = [rb.column("C1").to_numpy() for rb in src.batches(1)]
    return np.concatenate(got) if got else np.zeros(0, np.uint64)


LAYOUTS = {                      # files' rows, record batch rows, format, workers
    "3 files for 2 workers": ([800, 800, 800], 512, "stream", 2),
    "10 files of unequal size for 4 workers": ([100, 900, 250, 400, 50, 1200, 300, 700, 150, 550], 256, "stream", 4),
    "one file of many record batches": ([2400], 100, "stream", 2),
    "Parquet files for 3 workers": ([1000, 700, 500, 200], 256, "parquet", 3),
    "IPC files with an empty one": ([300, 0, 41, 9], 64, "file", 4),
    "fewer rows than workers": ([2, 1], 1, "stream", 5),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_row_is_in_one_shard_and_the_shards_are_within_one_row(name, tmp_path):
    sizes, batch_rows, fmt, workers = LAYOUTS[name]
    total = _layout(tmp_path / "train", sizes, batch_rows, fmt)
    rows = file_rows(str(tmp_path / "train"))
    assert rows == sizes
    want = shard_sizes(rows, workers)
    assert sum(want) == total and max(want) - min(want) <= 1
    assert check_train_split(str(tmp_path / "train"), SCHEMA) == total    # the launcher's count agrees
    shards = [_ids(tmp_path / "train", w, workers) for w in range(workers)]
    assert [len(s) for s in shards] == want
    assert np.array_equal(np.sort(np.concatenate(shards)), np.arange(total, dtype=np.uint64))
    shuffled = [_ids(tmp_path / "train", w, workers, shuffle_buffer=64, seed=3) for w in range(workers)]
    assert [np.array_equal(np.sort(a), np.sort(b)) for a, b in zip(shuffled, shards)] == [True] * workers


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_lockstep_epoch_trains_every_row(name, tmp_path):
    """Every worker runs the smallest shard's batches, its last partial (sync used to drop it): with the
    balanced shards a row is left out only when the smallest shard ends on a full batch and a longer one
    has one row more (at most workers - 1 rows an epoch, counted and warned about by the trainer)."""
    sizes, _, _, workers = LAYOUTS[name]
    shards = shard_sizes(sizes, workers)
    for batch in (7, 128, 512):
        steps = Mode.steps_per_epoch(None, min(shards), batch)
        left = untrained_rows(shards, steps, batch)
        assert left == (sum(s > min(shards) for s in shards) if min(shards) % batch == 0 else 0), (batch, shards)
        assert left < workers


def test_a_worker_opens_only_the_files_of_its_rows(tmp_path):
    """Worker 0 of 2 holds the first half of the rows: the last file is never opened (bytes no Arrow reader
    takes there after counting pass unseen), and the file its range ends in is read up to that end only."""
    train = tmp_path / "train"
    _layout(train, [500, 500, 500, 500], 100)
    rows = file_rows(str(train))
    (train / "part-00003.arrow").write_bytes(b"not arrow")
    assert np.array_equal(_ids(train, 0, 2, rows), np.arange(1000, dtype=np.uint64))
    with pytest.raises(Exception, match="part-00003.arrow"):
        _ids(train, 1, 2, rows)


def test_a_resumed_epoch_skips_exactly_the_batches_trained(tmp_path):
    """The trainer resumes by skipping the epoch's first ``batch`` batches of its shard: the same shard,
    read again, continues where the checkpoint left off (a range starting inside a record batch too)."""
    train = tmp_path / "train"
    _layout(train, [333, 101, 566], 50)
    rows = file_rows(str(train))
    for w in range(3):
        src = make_source(str(train), batch_size=16, schema=SCHEMA, rank=w, num_workers=3, prefetch=0,
                          file_rows=rows, shuffle_buffer=40, seed=5)
        whole = [rb.column("C1").to_numpy() for rb in src.batches(2)]
        again = src.batches(2)
        for _ in range(5):
            next(again)
        assert np.array_equal(np.concatenate([rb.column("C1").to_numpy() for rb in again]),
                              np.concatenate(whole[5:]))


@pytest.mark.parametrize("kind", ["plain", "zstd", "lz4", "legacy framing", "tiny batches"])
def test_a_streams_rows_are_counted_from_its_message_headers(kind, tmp_path):
    """Every worker counts the rows of every train file when it starts: an IPC stream (``engine convert``'s
    output) was read through for it, every byte of every file by every worker; its messages' headers
    give the same count (``ipc_stream.stream_rows``), whatever the compression, framing, dictionaries or
    zero-row batches. A stream cut short, or with bytes after its end-of-stream marker, is read through
    instead, and refused there, named."""
    from streaming.errors import DataFormatError
    from streaming.ipc_stream import stream_rows
    from streaming.source import count_rows
    t = pa.table({"label": pa.array(np.ones(1000, np.float32)),
                  "s": pa.array([f"v{i % 7}" for i in range(1000)]).dictionary_encode(),
                  "l": pa.array([[1, 2]] * 1000, pa.list_(pa.uint64()))})
    opts = pa.ipc.IpcWriteOptions(compression={"zstd": "zstd", "lz4": "lz4"}.get(kind),
                                  use_legacy_format=kind == "legacy framing")
    path = tmp_path / "part-0.arrow"
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, t.schema, options=opts) as w:
        w.write_table(t, max_chunksize=3 if kind == "tiny batches" else 256)
        w.write_batch(pa.RecordBatch.from_pylist([], schema=t.schema))
    assert stream_rows(str(path)) == count_rows(str(path)) == 1000
    with pa.OSFile(str(path)) as f:                 # an open file (an object store's) gives the same count
        assert stream_rows(f) == 1000
    whole = path.read_bytes()
    for bad in (whole[:-8], whole + whole[-8:]):
        path.write_bytes(bad)
        assert stream_rows(str(path)) is None
        with pytest.raises(DataFormatError, match="part-0.arrow"):
            count_rows(str(path))


def test_a_stream_whose_schema_is_longer_than_the_first_header_read_is_counted(tmp_path):
    """The header walk reads ``HEADER_READ`` bytes at each message's start (one ranged GET on a store);
    a schema message longer than that (3,000 columns) is completed by a second read, not misparsed."""
    from streaming.ipc_stream import HEADER_READ, stream_rows
    t = pa.table({f"column_with_a_long_name_{i:05d}": pa.array(np.arange(10, dtype=np.int8)) for i in range(3000)})
    path = tmp_path / "wide.arrows"
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, t.schema) as w:
        w.write_table(t, max_chunksize=4)
    assert len(t.schema.serialize()) > HEADER_READ
    assert stream_rows(str(path)) == 10
