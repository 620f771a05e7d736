"""A spilling table's dump (``SparseTable.rows``, what a base checkpoint writes) is the table at one
instant, however long it takes to read while pushes go on: no row twice, no row made later, every
value as it was."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from sparse_tables import SparseTable, TableConfig
from sparse_tables.errors import SpillError
from sparse_tables.spill import SpillStore
from tests.faults import FailingWrites

DIM = 4


def _rows(batches) -> dict:
    tab = pa.Table.from_batches(batches)
    keys = tab.column("key").to_numpy()
    values = np.asarray(tab.column("values").combine_chunks().flatten()).reshape(len(keys), DIM)
    assert len(np.unique(keys)) == len(keys), f"{len(keys) - len(np.unique(keys))} key(s) dumped twice"
    return {int(k): v.tolist() for k, v in zip(keys, values)}


def _spilling_table(tmp_path, rows: int) -> tuple[SparseTable, np.ndarray]:
    """An SGD table of 2,000 RAM rows holding keys 1..rows, each pushed once with gradient 1."""
    t = SparseTable(TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros",
                                memory_rows=2_000, spill_path=str(tmp_path / "spill"), num_threads=1))
    old = np.arange(1, rows + 1, dtype=np.uint64)
    for i in range(0, len(old), 1_000):
        t.push(old[i:i + 1_000], np.ones((1_000, DIM), np.float32))
    return t, old


def test_a_dump_read_while_pushes_evict_and_create_rows_is_the_table_at_its_instant(tmp_path):
    t, old = _spilling_table(tmp_path, 6_000)
    t.push(old[:500], np.ones((500, DIM), np.float32))         # some rows in RAM and on disk differ
    assert t.stats()["rows_spilled"] > 3_000 and t.stats()["rows_in_ram"] > 1_000
    before = _rows(list(t.rows()))
    dump = t.rows(chunk_rows=256)
    first = [next(dump)]                     # the dump's instant: RAM rows copied, RocksDB's view made
    # then, before the rest is read: new rows, updates, and evictions of rows the RAM copy holds
    t.push(np.arange(100_001, 104_001, dtype=np.uint64), np.full((4_000, DIM), 2.0, np.float32))
    t.push(old[::2], np.full((3_000, DIM), 5.0, np.float32))
    assert t.stats()["evictions"] > 6_000
    got = _rows(first + list(dump))
    assert got == before and len(got) == 6_000
    after = _rows(list(t.rows()))
    assert len(after) == 10_000 and after[int(old[0])] == [-7.0] * DIM
    t.close()


def _corrupt_middle_of_largest_sst(db_path) -> None:
    """Overwrite 8 KiB in the middle of the database's largest SST file (its data blocks' checksums)."""
    ssts = sorted(Path(db_path).glob("*.sst"), key=lambda p: p.stat().st_size)
    assert ssts, f"no SST file under {db_path}"
    size = ssts[-1].stat().st_size
    with open(ssts[-1], "r+b") as f:
        f.seek(size // 2)
        f.write(bytes(range(256)) * 32)


def _records_of(keys: np.ndarray, stride: int = 24) -> np.ndarray:
    """Records of random words that hold their keys (the first two words), as a table's do."""
    recs = np.random.default_rng(0).integers(0, 1 << 32, (len(keys), stride), dtype=np.uint64).astype(np.uint32)
    recs[:, :2] = keys.astype(np.uint64).view(np.uint32).reshape(-1, 2)
    return recs


def test_a_scan_of_records_that_do_not_hold_their_keys_fails_naming_the_store(tmp_path):
    st = SpillStore(str(tmp_path / "spill"), stride=24)
    keys = np.arange(1, 1_001, dtype=np.uint64)
    recs = _records_of(keys)
    recs[500:, :2] = recs[:500, :2]                     # garbage: rows 500.. hold the keys of rows 0..
    st.put(keys, recs, np.ones(len(keys), bool))
    try:
        with pytest.raises(SpillError, match=r"spill store .*rocksdb: records after row 0 of a scan are out of "
                                             r"key order"):
            list(st.scan(st.snapshot()))
    finally:
        st.close()


def test_a_scan_that_hits_a_corrupt_block_fails_naming_the_store_instead_of_ending_short(tmp_path):
    # rocksdict's item iterator ends quietly on a read error: a base dump would miss every row after the
    # corrupt block and still look complete
    st = SpillStore(str(tmp_path / "spill"), stride=24)
    keys = np.arange(1, 200_001, dtype=np.uint64)
    recs = _records_of(keys)
    st.put(keys, recs, np.ones(len(keys), bool))
    st._db.flush()                      # into an SST file: the memtable cannot be corrupted on disk
    try:
        whole = list(st.scan(st.snapshot()))
        assert np.array_equal(np.concatenate([k for k, _ in whole]), keys)
        assert np.array_equal(np.concatenate([r for _, r in whole]), recs)
        _corrupt_middle_of_largest_sst(st._dir.db_path)
        got = []
        with pytest.raises(SpillError, match=r"spill store .*rocksdb: a scan stopped after \d+ rows "
                                             r"\(last key \d+\) on a read error: Corruption") as e:
            for k, _ in st.scan(st.snapshot()):
                got.append(k)
        n = sum(len(k) for k in got)
        assert 0 < n < len(keys) and f"after {n} rows" in str(e.value)
    finally:
        st.close()


def test_a_multi_get_that_hits_a_corrupt_block_fails_naming_the_store(tmp_path):
    # rocksdict's multi-get raises a plain Exception ("Corruption: block checksum mismatch"): a promotion
    # or a delete must get the SpillError the table's docstrings promise
    st = SpillStore(str(tmp_path / "spill"), stride=24)
    keys = np.arange(1, 200_001, dtype=np.uint64)
    st.put(keys, _records_of(keys), np.ones(len(keys), bool))
    st._db.flush()
    try:
        _corrupt_middle_of_largest_sst(st._dir.db_path)
        with pytest.raises(SpillError, match=r"spill store .*rocksdb: reading 200000 keys failed: Corruption"):
            st.get(keys)
    finally:
        st.close()


def test_a_delta_reads_its_spilled_rows_outside_the_lock_as_of_its_instant_and_twice_alike(tmp_path):
    t, old = _spilling_table(tmp_path, 8_000)
    t.clear_dirty()                                              # a base was taken here
    touched = old[::3]                                           # then an hour's pushes: mostly spilled rows
    t.push(touched, np.full((len(touched), DIM), 2.0, np.float32))
    t.delete(old[1:40:3])                                        # and deletions: the delta's tombstones
    assert t.stats()["rows_spilled"] > 3_000
    want, want_deleted = _rows(t.dirty_rows()[0]), np.sort(old[1:40:3])
    assert len(want) == len(touched) and want[int(touched[0])] == [-3.0] * DIM

    dump = t.dirty_dump(clear=True, chunk_rows=256)
    batches = iter(dump)
    first = [next(batches)]                  # the delta's instant is past: its dirty marks are cleared
    # pushes while it is read (the table's lock is free): updates of rows it holds, RAM and spilled,
    # new rows and the evictions they cause
    t.push(touched, np.full((len(touched), DIM), 5.0, np.float32))
    t.push(np.arange(100_001, 103_001, dtype=np.uint64), np.ones((3_000, DIM), np.float32))
    assert _rows(first + list(batches)) == want
    assert _rows(list(dump)) == want                            # read again (a retried file): the same rows
    assert np.array_equal(dump.deleted, want_deleted)
    dump.close()
    later = _rows(t.dirty_rows()[0])                            # what changed since is in the next delta
    assert len(later) == len(touched) + 3_000 and later[int(touched[0])] == [-8.0] * DIM
    t.close()


def test_an_expiry_pass_stopped_by_a_read_error_keeps_the_tombstones_of_what_it_deleted(tmp_path):
    t = SparseTable(TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros",
                                memory_rows=2_000, spill_path=str(tmp_path / "spill"), num_threads=1,
                                expire_after=100), clock=lambda: 1_000.0)
    keys = np.arange(1, 200_001, dtype=np.uint64)
    for i in range(0, len(keys), 20_000):
        t.push(keys[i:i + 20_000], np.ones((20_000, DIM), np.float32))
    t.clear_dirty()
    t._spill._db.flush()
    _corrupt_middle_of_largest_sst(t._spill._dir.db_path)
    with pytest.raises(SpillError, match="a scan stopped after"):
        t.shrink(now=5_000.0)                   # every row expired: RAM rows, then RocksDB's chunk by chunk
    batches, deleted = t.dirty_rows()
    gone = int(t.stats()["deleted"])
    assert 2_000 < gone < len(keys) and len(deleted) == gone     # each deleted row is a tombstone
    assert not t.contains(deleted).any() and len(batches) == 0
    dump = t.dirty_dump()
    dump.close()
    with pytest.raises(RuntimeError, match="after close"):
        list(dump)
    t.close()


def test_a_put_writes_batch_by_batch_and_a_failed_batch_leaves_the_earlier_ones_counted_and_found(tmp_path,
                                                                                                monkeypatch):
    from sparse_tables import spill
    monkeypatch.setattr(spill, "WRITE_BATCH_ROWS", 1_000)
    st = SpillStore(str(tmp_path / "spill"), stride=24)
    real = st._db
    keys = np.arange(1, 5_001, dtype=np.uint64)
    st._db = failing = FailingWrites(real, 3, "write refused (injected)")
    try:
        with pytest.raises(SpillError, match="writing 1000 rows failed: write refused .injected"):
            st.put(keys, _records_of(keys), np.ones(len(keys), bool))
        assert st.count == 2_000 and st.may_contain(keys[:2_000]).all()
        pos, recs = st.get(keys)
        assert np.array_equal(keys[pos], keys[:2_000]) and np.array_equal(recs, _records_of(keys)[:2_000])
        st.put(keys[2_000:], _records_of(keys)[2_000:], np.ones(3_000, bool))     # the rest, 3 batches
        assert failing.calls == 6 and st.count == 5_000
    finally:
        st._db = real
        st.close()


def test_a_delta_reads_its_spilled_dirty_keys_from_the_sets_runs_in_chunks(tmp_path, monkeypatch):
    """The spilled dirty keys of a delta come from the dirty-keys set's many runs, merged a chunk at a
    time (``keysets.merged_chunks``), never one sorted array: each changed row once, none missing, the
    ones back in RAM from RAM, all with their values of the dump's instant."""
    from sparse_tables.keysets import SortedKeySet
    monkeypatch.setattr(SortedKeySet, "TAIL", 50)
    monkeypatch.setattr(SortedKeySet, "MAX_RUN", 400)
    t, old = _spilling_table(tmp_path, 6_000)
    t.clear_dirty()
    touched = old[::2]
    for i in range(0, len(touched), 500):
        t.push(touched[i:i + 500], np.full((len(touched[i:i + 500]), DIM), 2.0, np.float32))
    t.pull(touched[:300])                               # some spilled dirty rows come back into RAM
    assert len(t._spilled_dirty.runs()) > 3, "setup: the dirty keys are not in several runs"
    want = dict(zip((int(k) for k in touched), t.pull(touched).tolist()))
    d = t.dirty_dump(chunk_rows=64)
    t.push(touched, np.ones((len(touched), DIM), np.float32))     # after the instant: not in the delta
    for _ in range(2):                                  # a retried delta file reads the same rows
        assert _rows(list(d)) == want
    d.close()
    t.close()
