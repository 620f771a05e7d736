"""Values a CTR model cannot train on are refused where they enter (``ctr_data.check_values`` through
``ArrowSource``'s ``check``): the error names the file, the row of the file (counted over all its record
batches, whichever worker's shard the batch is) and the column. Before, a null label or key ended in a
pyarrow traceback, a NaN dense value in a ``ProtocolError`` at the push, a label of 7 in the loss."""
from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa
import pytest

from engine.errors import ConfigError
from engine.programs.ctr_data import check_values, expected_schema, make_source
from streaming.errors import DataFormatError

SLOTS = ["C1", "C2"]
SCHEMA = expected_schema(SLOTS, 13)


def rows(n, *, labels=None, dense=None, c2=None):
    labels = pa.array(np.arange(n) % 2, pa.float32()) if labels is None else labels
    if dense is None:
        dense = pa.FixedSizeListArray.from_arrays(pa.array(np.ones(n * 13, np.float32)), 13)
    keys = pa.array(np.arange(1, n + 1, dtype=np.uint64))
    return pa.RecordBatch.from_arrays([labels, dense, keys, keys if c2 is None else c2], schema=SCHEMA)


def test_a_clean_batch_passes():
    assert check_values(rows(8)) is None


@pytest.mark.parametrize("batch, want", [
    (rows(4, labels=pa.array([0, 1, None, 1], pa.float32())), ("label", 2, "got null")),
    (rows(4, labels=pa.array([0, 1, 7, 1], pa.float32())), ("label", 2, "in [0, 1], got 7.0")),
    (rows(4, labels=pa.array([0, np.nan, 1, 1], pa.float32())), ("label", 1, "in [0, 1], got nan")),
    (rows(3, dense=pa.FixedSizeListArray.from_arrays(
        pa.array([1.0] * 14 + [np.inf] + [1.0] * 24, pa.float32()), 13)), ("dense", 1, "position 1, got inf")),
    (rows(3, dense=pa.FixedSizeListArray.from_arrays(
        pa.array([1.0] * 30 + [None] + [1.0] * 8, pa.float32()), 13)), ("dense", 2, "position 4, got null")),
    (rows(3, dense=pa.array([[1.0] * 13, None, [1.0] * 13], pa.list_(pa.float32(), 13))), ("dense", 1, "got null")),
    (rows(3, c2=pa.array([1, 2, None], pa.uint64())), ("C2", 2, "missing_key")),
], ids=["null-label", "label-7", "nan-label", "inf-dense", "null-in-dense", "null-dense-list", "null-key"])
def test_each_unusable_value_is_named_with_its_column_and_row(batch, want):
    column, row, reason = check_values(batch)
    assert (column, row) == want[:2] and want[2] in reason, (column, row, reason)


def test_the_source_names_the_file_and_its_row_in_every_workers_shard(tmp_path):
    """One file of three record batches (5 rows each), sharded by batches over 2 workers: the NaN in the
    third batch's second row is row 12 of the file, and worker 0 (who reads that batch) names it."""
    path = tmp_path / "part-0.arrow"
    batches = [rows(5), rows(5), rows(5, dense=pa.FixedSizeListArray.from_arrays(
        pa.array([1.0] * 13 + [np.nan] + [1.0] * 51, pa.float32()), 13))]
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, SCHEMA) as w:
        for b in batches:
            w.write_batch(b)
    ok = make_source(str(path), batch_size=4, schema=SCHEMA, rank=1, num_workers=2, prefetch=0)
    assert sum(b.num_rows for b in ok.batches(0)) == 5          # worker 1's batch is clean
    src = make_source(str(path), batch_size=4, schema=SCHEMA, rank=0, num_workers=2, prefetch=2)
    with pytest.raises(DataFormatError) as e:
        list(src.batches(0))
    assert str(e.value) == (f"{path}: row 12: field dense: expected a finite number at position 0, got nan")
    again = pickle.loads(pickle.dumps(e.value))                    # crosses processes (Ray) intact
    assert str(again) == str(e.value) and again.unit == "row" and again.line == 12


def test_a_slot_listed_twice_is_a_config_error():
    with pytest.raises(ConfigError, match=r"model.slots: \['C1'\] listed more than once"):
        expected_schema(["C1", "C2", "C1"], 13)


@pytest.mark.parametrize("fmt", ["stream", "parquet"])
def test_the_launchers_look_finds_every_value_a_worker_would_refuse(fmt, tmp_path):
    """``check_train_split`` (before any process starts) reads every train row: a NaN dense value deep in
    the second file, or a null key, is named with its file and row there, not by the worker whose shard
    it is in the middle of an epoch. A raw string slot's null is its missing key, not an error."""
    import pyarrow.parquet as pq
    from engine.programs.ctr_data import check_train_split

    def write(path, rb):
        rb = pa.RecordBatch.from_arrays(rb.columns, names=rb.schema.names)      # nullable, as users write
        if fmt == "parquet":
            pq.write_table(pa.Table.from_batches([rb]), str(path), row_group_size=7)
        else:
            with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, rb.schema) as w:
                w.write_batch(rb)

    suffix = ".parquet" if fmt == "parquet" else ".arrow"
    train = tmp_path / "train"
    train.mkdir()
    write(train / f"part-0{suffix}", rows(40))
    nan = np.ones(40 * 13, np.float32)
    nan[33 * 13 + 4] = np.nan
    write(train / f"part-1{suffix}", rows(40, dense=pa.FixedSizeListArray.from_arrays(pa.array(nan), 13)))
    with pytest.raises(DataFormatError) as e:
        check_train_split(str(train), SCHEMA)
    assert str(e.value) == (f"{train / f'part-1{suffix}'}: row 34: field dense: expected a finite number at "
                            f"position 4, got nan")
    write(train / f"part-1{suffix}", rows(40, c2=pa.array([7] * 20 + [None] + [7] * 19, pa.uint64())))
    with pytest.raises(DataFormatError, match=r"part-1.*: row 21: field C2: expected a key, got null"):
        check_train_split(str(train), SCHEMA)
    strings = pa.array(["a"] * 20 + [None] + ["b"] * 19)
    rb = rows(40)
    write(train / f"part-1{suffix}", pa.RecordBatch.from_arrays([rb.column(0), rb.column(1), rb.column(2), strings],
                                                               names=SCHEMA.names))
    assert check_train_split(str(train), SCHEMA) == 80
