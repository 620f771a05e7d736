"""The order in which a spilling table's eviction passes write RAM rows to RocksDB
(``TableConfig.eviction``, ``sparse_tables._evict``): segmented LRU (rows never reused go first while
they are over a quarter of the tier) and plain LRU."""
from __future__ import annotations

import numpy as np
import pytest

from sparse_tables import SparseTable, TableConfig, TableConfigError
from sparse_tables import _kernels as K
from sparse_tables._evict import exact_victims, sample_lru

DIM = 4


def _in_ram(t, keys):
    rows = np.empty(len(keys), np.int64)
    K.find_rows(t._index, t._arena_u, keys, rows)
    return rows >= 0


def _flags(t, keys):
    rows = np.empty(len(keys), np.int64)
    K.find_rows(t._index, t._arena_u, keys, rows)
    assert (rows >= 0).all()
    return t._arena_u[rows, t.layout.meta + K.M_FLAGS]


@pytest.mark.parametrize("eviction", ["slru", "lru"])
def test_reused_rows_outlive_newer_rows_seen_once_under_slru_and_not_under_lru(tmp_path, eviction):
    t = SparseTable(TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros", memory_rows=1000,
                                spill_path=str(tmp_path / "spill"), eviction=eviction))
    a, b, c = (np.arange(lo, lo + n, dtype=np.uint64) for lo, n in ((1, 600), (10_001, 400), (20_001, 300)))
    t.push(a, np.ones((len(a), DIM), np.float32))
    t.pull(a)                                  # found in RAM: reused
    assert (_flags(t, a) & K.F_REUSED).all()
    t.push(b, np.ones((len(b), DIM), np.float32))
    assert not (_flags(t, b) & K.F_REUSED).any()    # a push is not a reuse: training pushes what it pulled
    t.push(c, np.ones((len(c), DIM), np.float32))   # 1300 rows: a pass writes 400 back (to 0.9 x 1000)
    in_a, in_b, in_c = _in_ram(t, a).sum(), _in_ram(t, b).sum(), _in_ram(t, c).sum()
    assert in_a + in_b + in_c == 900 and in_c == 300
    if eviction == "slru":
        # 700 rows never reused, 375 over a quarter of the 1300: the 375 oldest of them (b's) go, then
        # the oldest of the rest: a's 25 (their pull is older than b's push)
        assert (in_a, in_b) == (575, 25)
    else:
        assert (in_a, in_b) == (200, 400)       # the oldest 400 rows: a's
    # a row read back from RocksDB came again: reused
    ab = np.concatenate([a, b])
    gone = ab[~_in_ram(t, ab)][:10]
    np.testing.assert_array_equal(t.pull(gone), np.full((10, DIM), -1.0, np.float32))
    assert (_flags(t, gone) & K.F_REUSED).all() and t.stats()["promotions"] == 10
    assert len(t) == 1300
    t.close()


@pytest.mark.nojit
def test_exact_victims_takes_rows_never_reused_only_while_they_are_over_the_quarter():
    t = SparseTable(TableConfig(dim=DIM, optimizer="sgd", initializer="zeros"), initial_rows=2048)
    keys = np.arange(1, 1001, dtype=np.uint64)
    for i in range(0, 1000, 50):              # twenty pushes: later rows have later ticks
        t.push(keys[i:i + 50], np.ones((50, DIM), np.float32))
    fw, tw = t.layout.meta + K.M_FLAGS, t.layout.meta + K.M_TICK
    rows = np.empty(1000, np.int64)
    K.find_rows(t._index, t._arena_u, keys, rows)
    out = np.empty(300, np.int64)

    def victims(k, segmented):
        n = exact_victims(t._arena_u, t._state, t._lay, k, 4, segmented, out)
        return np.sort(t._arena_u[out[:n], 0].astype(np.uint64))

    # all never reused: over the quarter by 750, so plain LRU either way
    np.testing.assert_array_equal(victims(300, True), keys[:300])
    np.testing.assert_array_equal(victims(300, False), keys[:300])
    # the 400 oldest reused: the 600 never reused are 350 over the quarter; 300 of them go (the oldest)
    t._arena_u[rows[:400], fw] |= K.F_REUSED
    np.testing.assert_array_equal(victims(300, True), keys[400:700])
    np.testing.assert_array_equal(victims(300, False), keys[:300])
    # 900 reused: the 100 never reused are under the quarter, so the oldest of all go
    t._arena_u[rows[:900], fw] |= K.F_REUSED
    np.testing.assert_array_equal(victims(300, True), keys[:300])
    # 700 reused, 300 never reused (50 over the quarter): those 50 oldest (keys 701-750), then the
    # oldest 250 of the rest
    t._arena_u[rows[700:900], fw] &= ~K.F_REUSED
    got = victims(300, True)
    np.testing.assert_array_equal(got, np.concatenate([keys[:250], keys[700:750]]))
    assert (t._arena_u[rows, tw] > 0).all()
    t.close()


@pytest.mark.nojit
def test_sampled_slru_spares_reused_rows_while_the_draws_find_enough_never_reused_ones():
    t = SparseTable(TableConfig(dim=DIM, optimizer="sgd", initializer="zeros"), initial_rows=4096)
    keys = np.arange(1, 3001, dtype=np.uint64)
    for i in range(0, 3000, 100):
        t.push(keys[i:i + 100], np.ones((100, DIM), np.float32))
    rows = np.empty(3000, np.int64)
    K.find_rows(t._index, t._arena_u, keys, rows)
    fw = t.layout.meta + K.M_FLAGS
    t._arena_u[rows[:1500], fw] |= K.F_REUSED       # the older half reused
    out = np.empty(200, np.int64)
    n = sample_lru(t._arena_u, t._state, t._lay, 200, 8, np.uint64(5), out, True)
    picked = t._arena_u[out[:n], 0]
    assert n == 200 and len(np.unique(out[:n])) == 200
    assert not (t._arena_u[out[:n], fw] & K.F_REUSED).any()
    assert picked.min() > 1500 and np.median(picked) < 2000      # the oldest of the never-reused half
    n = sample_lru(t._arena_u, t._state, t._lay, 200, 8, np.uint64(5), out, False)
    assert (t._arena_u[out[:n], 0] <= 1500).all()                 # plain LRU: the oldest, reused or not
    t.close()


def test_an_unknown_eviction_is_refused_with_the_field_named():
    with pytest.raises(TableConfigError, match="eviction"):
        TableConfig(eviction="lfu")


def test_an_excess_far_over_the_cap_is_evicted_in_bounded_passes(tmp_path, monkeypatch):
    """When a call leaves RAM far above its cap (a memory budget whose cap the governor shrank, or one
    call's many new rows), the rows go out in passes of at most EVICT_PASS_ROWS: one pass of the whole
    excess held its records, sorted copies and write batches at once (~250 MB at 1M rows). Every row
    stays readable with its value, and the table counts each once."""
    from sparse_tables import _spill_tier
    monkeypatch.setattr(_spill_tier, "EVICT_PASS_ROWS", 500)
    t = SparseTable(TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros", memory_rows=1000,
                                spill_path=str(tmp_path / "spill")))
    passes = []
    real = t._evict

    def counted(k):
        passes.append(k)
        return real(k)
    monkeypatch.setattr(t, "_evict", counted)
    keys = np.arange(1, 6001, dtype=np.uint64)
    grads = -np.repeat(np.arange(1, 6001, dtype=np.float32)[:, None], DIM, axis=1)
    t.push(keys, grads)                        # 6000 rows into a tier of 1000: the 5000 over the cap go
    assert len(passes) == 10 and max(passes) == 500 and sum(passes) == 5000
    assert int(_in_ram(t, keys).sum()) == 1000 and len(t) == 6000
    np.testing.assert_array_equal(t.pull(keys), -grads)
    t.close()
