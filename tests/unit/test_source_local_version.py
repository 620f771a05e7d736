"""A local input written in place while it is read (``streaming.source.read_batches``): the batch read after
the write is refused (``InputChangedError`` naming the file, its row and batch), never delivered with bytes
of the new version. Before, a rewrite of the same size (fixed-width columns) was read on silently, rows of
both versions in one epoch."""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pytest

from streaming.inputs import InputChangedError
from streaming.source import ArrowSource, read_batches


def _table(n: int, label: float) -> pa.Table:
    return pa.table({"label": pa.array(np.full(n, label, np.float32)),
                     "C1": pa.array(np.arange(n, dtype=np.uint64))})


def _write(path, table: pa.Table, fmt: str) -> None:
    if fmt == "parquet":
        import pyarrow.parquet as pq
        pq.write_table(table, str(path), row_group_size=100)
        return
    with pa.OSFile(str(path), "wb") as f, (pa.ipc.new_stream if fmt == "stream" else pa.ipc.new_file)(
            f, table.schema) as w:
        w.write_table(table, max_chunksize=100)


def _in_place(path, table: pa.Table, fmt: str, tmp) -> None:
    """Write ``table`` over ``path``'s bytes in place: the same inode, the same size."""
    _write(tmp / f"new.{fmt}", table, fmt)
    data = (tmp / f"new.{fmt}").read_bytes()
    assert len(data) == os.path.getsize(path)
    with open(path, "r+b") as f:
        f.write(data)


@pytest.mark.parametrize("fmt", ["stream", "file", "parquet"])
def test_a_file_written_in_place_mid_read_is_refused_at_the_next_batch(tmp_path, fmt):
    path = tmp_path / f"part-0.{'parquet' if fmt == 'parquet' else 'arrow'}"
    n = 200_000 if fmt == "parquet" else 1000        # Parquet is read 65536 rows a batch
    _write(path, _table(n, 0.0), fmt)
    it = read_batches(str(path))
    first = next(it)
    assert first.num_rows < n and first.column(0).to_numpy().max() == 0.0
    _in_place(path, _table(n, 1.0), fmt, tmp_path)
    with pytest.raises(InputChangedError, match=rf"part-0\.\w+: row {first.num_rows + 1}: field <record batch 1>: "
                                                r"expected the file the read began on"):
        for rb in it:       # every batch delivered is of the old version
            assert rb.column(0).to_numpy().max() == 0.0


def test_an_unchanged_file_is_read_whole_and_a_touched_one_is_refused(tmp_path):
    path = tmp_path / "part-0.arrow"
    _write(path, _table(1000, 0.0), "stream")
    assert sum(rb.num_rows for rb in read_batches(str(path))) == 1000
    it = read_batches(str(path))
    next(it)
    os.utime(path, ns=(1, 1))
    with pytest.raises(InputChangedError, match="row 101"):
        list(it)


def test_a_source_reading_through_its_prefetch_thread_raises_it_too(tmp_path):
    path = tmp_path / "part-0.arrow"
    _write(path, _table(5000, 0.0), "stream")
    src = ArrowSource([str(path)], batch_size=100, prefetch=1)
    it = src.batches(0)
    next(it)
    _in_place(path, _table(5000, 1.0), "stream", tmp_path)
    with pytest.raises(InputChangedError, match="expected the file the read began on"):
        for rb in it:
            assert rb.column(0).to_numpy().max() == 0.0


def test_a_file_written_after_its_listing_is_refused_even_before_its_read_began(tmp_path):
    """Two workers' shards of one file (``make_source`` with the listing's row counts and versions): a rewrite
    of the same size after worker 0 read its rows and before worker 1 opened the file was read whole by
    worker 1, as the new version, with the listed counts: rows of two versions in one epoch, no error (the
    stat of each batch compared with the version the read began on, not the one listed)."""
    from engine.programs.ctr_data import local_versions, make_source
    path = tmp_path / "part-0.arrow"
    _write(path, _table(1000, 0.0), "stream")
    os.utime(path, ns=(10**9, 10**9))           # the rewrite below gets another mtime, however coarse the clock
    files = [str(path)]
    versions = local_versions(files)            # the trainer's listing (check_unchanged at the epoch's start)
    schema = _table(1, 0.0).schema

    def shard(rank):
        return make_source(files, batch_size=100, schema=schema, rank=rank, num_workers=2, prefetch=0,
                           file_rows=[1000], versions=versions).batches(0)

    first = [rb.column(0).to_numpy().max() for rb in shard(0)]
    assert first == [0.0] * 5
    _in_place(path, _table(1000, 1.0), "stream", tmp_path)
    with pytest.raises(InputChangedError, match=r"part-0\.arrow: row 1: field <record batch 0>: expected the file "
                                                r"as the job listed it"):
        for rb in shard(1):
            assert rb.column(0).to_numpy().max() == 0.0
    # a file copied again with the same bytes passes the epoch's check (check_unchanged: its fingerprint),
    # which gives the versions the next epoch's source pins
    _in_place(path, _table(1000, 0.0), "stream", tmp_path)
    versions[:] = local_versions(files)
    assert sum(rb.num_rows for r in (0, 1) for rb in shard(r)) == 1000
