"""Deletes RocksDB refused are kept pending, never lost (``SpillStore.delete(defer=True)``).

An expiry pass removes its expired rows from RAM before it deletes their RocksDB copies. When that write
failed, the copies stayed on disk and the next pull read the deleted rows back. Each test makes the
real RocksDB's writes fail (``tests.faults.FailingWrites``) during such a pass and checks that the rows
stay deleted on every read path, and that the first write that succeeds really deletes them. The rows
a pass's failed write-back of decayed rows did write are in the next delta.

Rows: sgd, learning rate 1, zero initializer, so a row pushed once with gradient g reads -g; a stale
copy read back (then pushed again) would read the sum.
"""
from __future__ import annotations

import numpy as np
import pytest

from sparse_tables import SparseTable, TableConfig, spill
from sparse_tables.errors import SpillError
from tests.faults import FailingWrites

DIM = 4
DISK_FULL = "IO error: No space left on device (injected)"


class Clock:
    """The table clock (seconds), set by the test."""

    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _keys(lo: int, n: int) -> np.ndarray:
    return np.arange(lo, lo + n, dtype=np.uint64)


def _table(tmp_path, clock: Clock) -> SparseTable:
    cfg = TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros", memory_rows=1_000,
                      spill_path=str(tmp_path / "spill"), expire_after=50.0, num_threads=1)
    return SparseTable(cfg, clock=clock)


def _push(t: SparseTable, keys: np.ndarray, g: float = 1.0) -> None:
    t.push(keys, np.full((len(keys), DIM), g, np.float32))


def _on_raw_disk(db, keys: np.ndarray) -> np.ndarray:
    """bool[n]: the raw RocksDB database holds a record under the key (pending deletes or not)."""
    vals = db.get([int(k).to_bytes(8, "big") for k in keys])
    return np.array([v is not None for v in vals], np.bool_)


def _raw_values(db, keys: np.ndarray, layout) -> np.ndarray:
    """float32[n, dim]: the values of the raw records of keys (all present)."""
    vals = db.get([int(k).to_bytes(8, "big") for k in keys])
    recs = np.frombuffer(b"".join(vals), "<u4").reshape(len(keys), layout.stride)
    return recs[:, layout.values:layout.values + layout.dim].view(np.float32)


def _dump_keys(t: SparseTable) -> np.ndarray:
    """Keys of a base dump (``rows``), sorted; each must appear once."""
    keys = np.concatenate([b.column("key").to_numpy() for b in t.rows()] or [np.empty(0, np.uint64)])
    assert len(np.unique(keys)) == len(keys), "a base dump holds a row twice"
    return np.sort(keys.astype(np.uint64))


def _on_disk_and_in_ram(t: SparseTable, keys: np.ndarray) -> None:
    """Promote keys (written out before) into RAM, where they carry the 'also on disk' flag."""
    assert t._spill.get(keys)[0].size == len(keys), "setup: the rows were not evicted"
    t.pull(keys)
    assert t.stats()["promotions"] >= len(keys)


def _expired_pass_fails(t: SparseTable, real, now: float, expect: np.ndarray) -> SpillError:
    with pytest.raises(SpillError, match=r"expiry pass: .*pending deletes.*No space left") as info:
        t.shrink(now=now)
    err = info.value
    assert np.array_equal(np.sort(err.pending), np.sort(expect))
    assert _on_raw_disk(real, expect).all(), "setup: the refused deletes reached RocksDB"
    return err


def test_rows_an_expiry_pass_could_not_delete_on_disk_never_come_back(tmp_path):
    clock = Clock(1000.0)
    t = _table(tmp_path, clock)
    real = t._spill._db
    old, cold, fresh = _keys(1, 100), _keys(201, 100), _keys(10_001, 2_000)
    try:
        _push(t, old)
        _push(t, cold)
        t.clear_dirty()                      # a checkpoint's instant: a delta's tombstones are its rows'
        clock.now = 1100.0
        _push(t, fresh)                      # the oldest rows go to RocksDB
        _on_disk_and_in_ram(t, old)          # back in RAM, their copies stay on disk
        t._spill._db = FailingWrites(real, 0, DISK_FULL)
        err = _expired_pass_fails(t, real, 1120.0, old)
        assert err.deleted == 100

        # writes still fail: every read path sees the rows as deleted
        assert t.stats()["pending_deletes"] == 100
        assert np.all(t.pull(old) == 0.0), "an expired row came back on pull"
        assert not t.contains(old).any()
        batches, tombstones = t.dirty_rows()
        assert np.isin(old, tombstones).all()
        dirty = np.concatenate([b.column("key").to_numpy() for b in batches]).astype(np.uint64)
        assert not np.isin(old, dirty).any(), "a delta holds a deleted row"
        dump = _dump_keys(t)
        assert np.array_equal(dump, np.sort(np.concatenate([cold, fresh])))
        assert len(t) == t.stats()["rows"] == len(dump)
        assert t.pull(cold)[:, 0].tolist() == [-1.0] * 100     # rows only on disk are untouched (pass stopped)

        # the next write that succeeds (an eviction) deletes them in RocksDB
        t._spill._db = real
        clock.now = 1120.0
        _push(t, _keys(20_001, 500))
        assert not _on_raw_disk(real, old).any(), "the pending deletes were not written"
        assert t.stats()["pending_deletes"] == 0
        assert len(t) == len(_dump_keys(t)) == 2_600
        assert t.shrink(now=1120.0) == 100   # the rows only on disk expire on the next pass
        assert not _on_raw_disk(real, cold).any() and not t.contains(old).any()
        assert len(t) == 2_500
    finally:
        t._spill._db = real
        t.close()


def test_a_key_deleted_pending_then_pushed_anew_and_evicted_again_keeps_its_new_value(tmp_path, monkeypatch):
    # small batches: the 100 pending deletes, more than a batch, are written first in batches of their own
    # (each forgotten once written), then the eviction's batches put the re-pushed keys back
    monkeypatch.setattr(spill, "WRITE_BATCH_ROWS", 16)
    clock = Clock(1000.0)
    t = _table(tmp_path, clock)
    real = t._spill._db
    old = _keys(1, 100)
    again, gone = old[:50], old[50:]
    try:
        _push(t, old)
        clock.now = 1100.0
        _push(t, _keys(10_001, 2_000))
        _on_disk_and_in_ram(t, old)
        t._spill._db = FailingWrites(real, 0, DISK_FULL)
        _expired_pass_fails(t, real, 1120.0, old)

        clock.now = 1130.0
        _push(t, again, 2.0)                 # new rows (no pull here: a row a pull finds is kept longer)
        with pytest.raises(SpillError, match="No space left"):
            _push(t, _keys(30_001, 300))     # an eviction, refused: the new rows stay in RAM
        assert t.stats()["pending_deletes"] == 100

        t._spill._db = real
        _push(t, _keys(40_001, 1_000))       # evicts the re-pushed rows first (the oldest)
        assert t.stats()["pending_deletes"] == 0
        assert _on_raw_disk(real, again).all(), "the retried deletes undid the new rows"
        assert np.all(_raw_values(real, again, t.layout) == -2.0), "a stale copy was read back"
        assert not _on_raw_disk(real, gone).any()
        assert t.contains(again).all() and not t.contains(gone).any()
        assert np.all(t.pull(again) == -2.0) and np.all(t.pull(gone) == 0.0)
        assert len(t) == len(_dump_keys(t)) == 2_000 + 50 + 300 + 1_000
    finally:
        t._spill._db = real
        t.close()


def test_pending_deletes_survive_failed_writes_and_the_first_write_that_succeeds_applies_them_all(tmp_path):
    clock = Clock(1000.0)
    t = _table(tmp_path, clock)
    real = t._spill._db
    a, b, fill = _keys(1, 100), _keys(101, 100), _keys(10_001, 2_000)
    try:
        _push(t, a)
        clock.now = 1050.0
        _push(t, b)
        clock.now = 1100.0
        _push(t, fill)
        _on_disk_and_in_ram(t, np.concatenate([a, b]))
        victim = fill[:1]
        assert t._spill.get(victim)[0].size == 1, "setup: the row was not evicted"
        failing = FailingWrites(real, 0, DISK_FULL)
        t._spill._db = failing

        _expired_pass_fails(t, real, 1080.0, a)                 # a expires, b not yet
        clock.now = 1130.0
        with pytest.raises(SpillError, match="and 100 pending deletes failed"):
            _push(t, _keys(30_001, 300))                         # an eviction refused
        _expired_pass_fails(t, real, 1140.0, b)                  # b expires: both pending
        with pytest.raises(SpillError, match="1 deletes and 200 pending deletes failed"):
            t.delete(victim)                                     # refused: nothing deleted
        assert t.contains(victim).all()
        assert failing.calls >= 4
        assert t.stats()["pending_deletes"] == 200
        both = np.concatenate([a, b])
        assert _on_raw_disk(real, both).all()
        assert not t.contains(both).any() and np.all(t.pull(both) == 0.0)
        assert len(t) == len(_dump_keys(t)) == 2_000 + 300

        t._spill._db = real
        assert t.delete(victim) == 1                             # the first write that succeeds
        assert not _on_raw_disk(real, np.concatenate([both, victim])).any()
        assert t.stats()["pending_deletes"] == 0
        assert len(t) == len(_dump_keys(t)) == 2_000 + 300 - 1
        assert not t.contains(both).any()
    finally:
        t._spill._db = real
        t.close()


def test_a_shard_whose_expiry_pass_fails_does_not_stop_the_other_shards_passes(tmp_path):
    """A server's expiry pass over a table (``SparseHost.shrink``, what the Shrink RPC runs) goes on past
    a shard whose RocksDB refuses its writes, then raises one error naming that shard."""
    from concurrent.futures import ThreadPoolExecutor

    from engine.ps.hosts import SparseHost
    cfg = TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros", memory_rows=300,
                      spill_path=str(tmp_path / "spill"), delete_threshold=0.5, num_threads=1)
    host = SparseHost("emb", cfg, server=0, num_servers=1, num_vshards=8, num_local=2, pool=ThreadPoolExecutor(2))
    try:
        keys = _keys(1, 2_000)
        host.shards[0].push(keys[:1_000], np.ones((1_000, DIM), np.float32))   # show 0: every row expires
        host.shards[1].push(keys[1_000:], np.ones((1_000, DIM), np.float32))
        host.shards[0].pull(keys[:100])             # evicted rows back in RAM: their expiry deletes on disk
        assert all(s.stats()["rows_spilled"] > 0 for s in host.shards), "setup: nothing went to RocksDB"
        ram0 = host.shards[0].stats()["rows_in_ram"]
        real = host.shards[0]._spill._db
        host.shards[0]._spill._db = FailingWrites(real, 0, DISK_FULL)
        with pytest.raises(SpillError, match=r"shard\(s\) \[0\] of 2 \(the others ran.*No space left") as info:
            host.shrink()
        assert len(host.shards[1]) == 0, "the healthy shard's pass did not run"
        assert info.value.deleted == 1_000 + ram0     # shard 1's rows and shard 0's RAM rows
        host.shards[0]._spill._db = real
        host.shrink()                                 # the failed shard's next pass finishes the job
        assert len(host.shards[0]) == 0 and host.stats()["pending_deletes"] == 0
    finally:
        for s in host.shards:
            s.close()


def test_an_expiry_pass_whose_write_back_of_decayed_rows_fails_half_way_leaves_them_in_the_next_delta(tmp_path):
    # show/click decay rewrites every spilled row; RocksDB refuses the second of its write batches: the
    # rows of the first are decayed on disk, and the next delta must carry them (base + delta = the table)
    t = SparseTable(TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros",
                                memory_rows=1_000, spill_path=str(tmp_path / "spill"), show_click_decay=0.5,
                                num_threads=1))
    keys = _keys(1, 30_000)
    t.push(keys, np.ones((len(keys), DIM), np.float32), shows=np.full(len(keys), 8, np.float32),
           clicks=np.zeros(len(keys), np.float32))

    def shows(batches) -> dict:
        return {int(k): float(s) for b in batches
                for k, s in zip(b.column("key").to_numpy(), b.column("show").to_numpy())}

    base = shows(t.rows(clear=True))                      # a base checkpoint's rows, its instant
    real = t._spill._db
    t._spill._db = failing = FailingWrites(real, 2, DISK_FULL)
    try:
        with pytest.raises(SpillError, match="No space left on device"):
            t.shrink()
    finally:
        t._spill._db = real
    assert failing.calls == 2
    live = shows(t.rows())
    decayed = [k for k, v in live.items() if v == 4.0]
    assert spill.WRITE_BATCH_ROWS <= len(decayed) < len(keys) - 1_000       # a batch made it, not all
    batches, deleted = t.dirty_rows(clear=True)           # the next delta
    assert {**base, **shows(batches)} == live and len(deleted) == 0
    t.close()
