"""The spill filter follows the keys on disk, not every key ever spilled (``SpillStore.begin_filter_rebuild``).

``ScalableBloom`` never forgets a key, and expiry passes delete keys from RocksDB. Before, a job whose keys
churn grew the filter with every key it ever spilled (a soak of 40 passes: 4.5 -> 46 bytes per key on disk,
false positives 1.0% -> 3.8%), and the delta after a pass read every key the pass deleted back from RocksDB
under the table's exclusive lock, since the filter still said "maybe" (1.6 s for 1M expired keys). An
expiry pass now rebuilds the filter from the keys it leaves on disk.

Rows: sgd, learning rate 1, zero initializer: a row pushed once with gradient g reads -g.
"""
from __future__ import annotations

import numpy as np
import pytest

from sparse_tables import SparseTable, TableConfig, spill
from tests.faults import FailingWrites

DIM = 4
ROUND_KEYS = 6_000


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def small_filters(monkeypatch):
    """Filters that start at 4,096 keys, so a few rounds of a few thousand keys show their growth."""
    monkeypatch.setattr(spill, "FILTER_MIN_KEYS", 1 << 12)


def _table(tmp_path, clock) -> SparseTable:
    cfg = TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros", memory_rows=500,
                      spill_path=str(tmp_path / "spill"), expire_after=50.0, num_threads=1)
    return SparseTable(cfg, clock=clock)


def _round(t: SparseTable, clock: Clock, r: int) -> np.ndarray:
    """60 s later, push round r's new keys (gradient r + 1) and run an expiry pass: the round before's keys,
    last pushed 60 s ago, expire (``expire_after`` 50 s). Returns round r's keys."""
    clock.now += 60.0
    keys = np.arange(1 + r * ROUND_KEYS, 1 + (r + 1) * ROUND_KEYS, dtype=np.uint64)
    t.push(keys, np.full((len(keys), DIM), r + 1.0, np.float32))
    t.shrink()
    return keys


def test_filter_stays_with_the_keys_on_disk_through_churn(tmp_path, small_filters):
    clock = Clock(1_000.0)
    t = _table(tmp_path, clock)
    try:
        sizes = []
        for r in range(12):
            live = _round(t, clock, r)
            sizes.append(t.stats()["memory"]["filters"])
        # before: 12 rounds x 6,000 keys in a chain 4k, 8k, ..., 64k (~125 KB) for the 6,000 keys on disk
        assert sizes[-1] <= sizes[2], sizes
        assert t._spill._bloom.added <= ROUND_KEYS
        gone = np.arange(1, 1 + 11 * ROUND_KEYS, dtype=np.uint64)
        assert t._spill.may_contain(gone).mean() < 0.05            # before: every one of them "maybe"
        # nothing the filter dropped was on disk: every live row reads back, the expired ones are absent
        t.clear_dirty()
        assert t.contains(live).all() and not t.contains(gone).any()
        np.testing.assert_array_equal(t.pull(live), np.full((len(live), DIM), -12.0, np.float32))
        assert len(t) == ROUND_KEYS
    finally:
        t.close()


def test_delta_after_an_expiry_pass_reads_few_expired_keys_back(tmp_path):
    clock = Clock(1_000.0)
    t = _table(tmp_path, clock)
    try:
        old = np.arange(1, 20_001, dtype=np.uint64)
        t.push(old, np.ones((len(old), DIM), np.float32))
        t.clear_dirty()                      # the parent checkpoint holds them
        clock.now += 100.0
        assert t.shrink() == len(old)
        reads = t.stats()["rocksdb"]["point_reads"]
        batches, deleted = t.dirty_rows(clear=True)
        np.testing.assert_array_equal(deleted, old)
        # is each expired key there again? The rebuilt filter answers for ~99% of them (before: 20,000 reads)
        assert t.stats()["rocksdb"]["point_reads"] - reads < 0.05 * len(old)
    finally:
        t.close()


def test_a_pass_stopped_by_a_write_error_keeps_the_old_filter(tmp_path, small_filters):
    clock = Clock(1_000.0)
    t = _table(tmp_path, clock)
    try:
        keys = np.arange(1, 20_001, dtype=np.uint64)
        t.push(keys, np.ones((len(keys), DIM), np.float32))
        before = t._spill._bloom
        clock.now += 100.0
        real = t._spill._db
        t._spill._db = FailingWrites(real, 1, "IO error: injected")     # the scan's first delete
        with pytest.raises(spill.SpillError):
            t.shrink()
        t._spill._db = real
        assert t._spill._bloom is before and t._spill._rebuild is None
        on_disk = keys[t.contains(keys)]
        assert len(on_disk) == len(t) > 0 and t._spill.may_contain(on_disk).all()
        assert t.shrink() == len(on_disk) and len(t) == 0
        assert t._spill._bloom is not before and t._spill._bloom.added == 0
    finally:
        t.close()


def test_budget_counts_an_expiry_pass_tombstone_keys_and_rebuilt_filter(tmp_path):
    """The keys an expiry pass deletes wait in RAM for the next delta's tombstones (8 bytes each). The
    budget did not count them (a daily pass over 10^8 keys deleting 30%: 240 MB for up to an hour), and
    it went on counting the filter the pass replaced until the next push reported."""
    clock = Clock(1_000.0)
    cfg = TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros", memory_bytes=96 << 20,
                      spill_path=str(tmp_path / "spill"), expire_after=50.0, num_threads=1)
    t = SparseTable(cfg, clock=clock)
    try:
        old = np.arange(1, 300_001, dtype=np.uint64)
        for s in range(0, len(old), 50_000):
            t.push(old[s:s + 50_000], np.ones((50_000, DIM), np.float32))
        t.clear_dirty()
        clock.now += 100.0
        assert t.shrink() == len(old)
        st = t.stats()
        assert st["memory"]["dirty_keys"] >= 8 * len(old)
        assert st["memory_budget"]["growing"] == st["memory"]["filters"] + st["memory"]["dirty_keys"]
        t.dirty_rows(clear=True)            # the tombstones' keys are freed, and the budget knows it at once
        st = t.stats()
        assert st["memory"]["dirty_keys"] == 0
        assert st["memory_budget"]["growing"] == st["memory"]["filters"]
    finally:
        t.close()
