"""SparseTable behaviour through its public API: input errors, show scaling, admission, expiry
tombstones, dirty tracking, dump/load round trips and thread safety."""
from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pytest

from sparse_tables import SparseTable, TableConfig, TableConfigError, TableInputError
from tests import naive


def u64(*xs) -> np.ndarray:
    return np.array(xs, dtype=np.uint64)


def snapshot(table: SparseTable) -> dict:
    out = {}
    for b in table.rows():
        for row in b.to_pylist():
            out[row.pop("key")] = row
    return out


@pytest.fixture
def clock():
    now = [500.0]
    return now


def test_config_errors_name_the_field():
    with pytest.raises(TableConfigError, match="TableConfig.dim must be a positive int, got 0"):
        TableConfig(dim=0)
    with pytest.raises(TableConfigError, match="optimizer"):
        TableConfig(optimizer="adadelta")
    with pytest.raises(TableConfigError, match=r"tables.emb: unknown key\(s\) \['dimm'\]"):
        TableConfig.from_dict({"dimm": 3}, "tables.emb")


@pytest.mark.parametrize("call, match", [
    (lambda t: t.pull(np.array([1, 2], np.int64)), r"keys: expected a uint64\[n\] array, got int64\[2\]"),
    (lambda t: t.pull([1, 2]), "keys: expected a uint64"),
    (lambda t: t.push(u64(1, 2), np.zeros((2, 3), np.float32)), r"grads: expected float32\[2, 4\]"),
    (lambda t: t.push(u64(1, 2), np.zeros((3, 4), np.float32)), r"grads: expected float32\[2, 4\]"),
    (lambda t: t.push(u64(1, 2), np.zeros((2, 4), np.float64)), "grads: expected float32"),
    (lambda t: t.push(u64(1, 2), np.array([[0, 0, 0, 0], [0, np.nan, 0, 0]], np.float32)),
     r"grads\[1\] \(key 2\)"),
    (lambda t: t.push(u64(1, 2), np.full((2, 4), np.inf, np.float32)), r"grads\[0\]"),
    (lambda t: t.push(u64(1), np.zeros((1, 4), np.float32), shows=np.array([-1], np.float32)), "shows"),
    (lambda t: t.push(u64(1), np.zeros((1, 4), np.float32), shows=np.ones(2, np.float32)), "shows"),
    (lambda t: t.push(u64(1), np.zeros((1, 4), np.float32), clicks=np.ones(1, np.float32)), "clicks"),
    (lambda t: t.push_delta(u64(1), np.full((1, 4), np.nan, np.float32)), r"deltas\[0\]"),
])
def test_bad_input_raises_typed_error_and_changes_nothing(call, match, tmp_path):
    t = SparseTable(TableConfig(dim=4, optimizer="adagrad", memory_rows=2, spill_path=str(tmp_path / "s")))
    t.push(u64(1, 2, 3, 4), np.ones((4, 4), np.float32))
    before = snapshot(t)
    with pytest.raises(TableInputError, match=match):
        call(t)
    assert snapshot(t) == before
    t.close()


def test_pull_of_unknown_keys_reads_zeros_and_creates_nothing():
    t = SparseTable(TableConfig(dim=3, initializer="uniform", init_range=0.5, seed=4))
    assert not t.pull(u64(10, 11)).any()
    assert len(t) == 0
    init = t.pull(u64(10, 11), init_missing=True)
    assert len(t) == 0 and np.abs(init).max() > 0
    t.push_delta(u64(10), np.zeros((1, 3), np.float32))
    np.testing.assert_array_equal(t.pull(u64(10)), init[:1])  # created with exactly that value


def test_shows_scale_the_gradient_and_feed_show_click():
    cfg = TableConfig(dim=2, optimizer="sgd", learning_rate=1.0, initializer="zeros")
    t = SparseTable(cfg)
    # key 5 twice with shows 1 and 3: combined gradient (2+6)/(1+3) = 2 per dim
    t.push(u64(5, 5), np.array([[2, 2], [6, 6]], np.float32), shows=np.array([1, 3], np.float32),
           clicks=np.array([1, 0], np.float32))
    np.testing.assert_array_equal(t.pull(u64(5)), [[-2, -2]])
    row = snapshot(t)[5]
    assert (row["show"], row["click"]) == (4.0, 1.0)


def test_admission_keeps_unadmitted_keys_out(clock):
    t = SparseTable(TableConfig(dim=2, optimizer="sgd", learning_rate=1.0, initializer="zeros", min_count=3),
                    clock=lambda: clock[0])
    g = np.ones((1, 2), np.float32)
    t.push(u64(9), g)
    t.push(u64(9), g)
    assert len(t) == 0 and not t.pull(u64(9)).any() and t.stats()["rejected"] == 2
    t.push(u64(9), g)  # third push admits the key and applies its gradient
    np.testing.assert_array_equal(t.pull(u64(9)), [[-1, -1]])


def test_admission_counts_occurrences_whether_or_not_duplicates_were_merged(clock):
    """A worker and the PS client merge a key's duplicates into one copy whose show is their sum; the
    server counted copies per push, so a key in 2 examples of every batch was admitted one batch late
    in async (and per worker-batch in sync, per sync in GEO). Shows count now; without them, copies."""
    def table():
        return SparseTable(TableConfig(dim=2, optimizer="sgd", learning_rate=1.0, initializer="zeros",
                                       min_count=4), clock=lambda: clock[0])
    g = np.ones((1, 2), np.float32)
    merged, copies = table(), table()
    merged.push(u64(9), g, shows=np.array([2], np.float32))
    copies.push(u64(9, 9), np.ones((2, 2), np.float32) / 2, shows=np.ones(2, np.float32))
    assert len(merged) == len(copies) == 0                # 2 occurrences of 4
    merged.push(u64(9), g, shows=np.array([2], np.float32))
    copies.push(u64(9, 9), np.ones((2, 2), np.float32) / 2, shows=np.ones(2, np.float32))
    np.testing.assert_array_equal(merged.pull(u64(9)), copies.pull(u64(9)))
    np.testing.assert_array_equal(merged.pull(u64(9)), [[-0.5, -0.5]])   # admitted at the 4th occurrence
    plain = table()                                        # no shows: copies in each push count
    plain.push(u64(5, 5, 5), np.ones((3, 2), np.float32))
    assert len(plain) == 0
    plain.push(u64(5), g)
    assert len(plain) == 1


def test_a_geo_delta_is_held_to_the_weight_bounds(clock):
    """Only optimizer steps were clipped to [min_bound, max_bound]; a GEO delta added past them."""
    t = SparseTable(TableConfig(dim=2, optimizer="sgd", initializer="zeros", min_bound=-0.5, max_bound=0.25),
                    clock=lambda: clock[0])
    t.push_delta(u64(1, 2), np.array([[1.0, -1.0], [0.1, -0.1]], np.float32))
    np.testing.assert_array_equal(t.pull(u64(1, 2)), np.array([[0.25, -0.5], [0.1, -0.1]], np.float32))


@pytest.mark.parametrize("initializer", ["uniform", "normal"])
def test_a_new_row_starts_within_the_weight_bounds(clock, initializer):
    """Paddle's rules bound a row's initial values too; a pull of absent keys here showed the initializer's
    draw, outside [min_bound, max_bound] (uniform 0.5 against bounds of 0.1 and 0.05)."""
    cfg = TableConfig(dim=8, optimizer="sgd", initializer=initializer, init_range=0.5, min_bound=-0.1,
                      max_bound=0.05, seed=3)
    t = SparseTable(cfg, clock=lambda: clock[0])
    keys = np.arange(1, 201, dtype=np.uint64)
    unclipped = np.stack([naive.initial_values(TableConfig(dim=8, initializer=initializer, init_range=0.5,
                                                           seed=3), int(k)) for k in keys])
    assert unclipped.min() < -0.1 and unclipped.max() > 0.05               # the draw crosses both bounds
    expected = np.clip(unclipped, -0.1, 0.05)
    np.testing.assert_allclose(t.initial_values(keys), expected, rtol=1e-6)       # a pull of absent keys
    np.testing.assert_allclose(t.pull(keys, init_missing=True), expected, rtol=1e-6)
    t.push(keys, np.zeros((len(keys), 8), np.float32))                    # creates the rows
    assert len(t) == len(keys)
    np.testing.assert_allclose(t.pull(keys), expected, rtol=1e-6)


def test_expiry_deletes_and_reports_tombstones(clock, tmp_path):
    t = SparseTable(TableConfig(dim=2, expire_after=10, memory_rows=2, spill_path=str(tmp_path / "s")),
                    clock=lambda: clock[0])
    g = np.ones((4, 2), np.float32)
    t.push(u64(1, 2, 3, 4), g)      # some of these spill
    t.clear_dirty()
    clock[0] += 8
    t.push(u64(3), g[:1])
    clock[0] += 5                     # 1, 2, 4 unseen for 13 s > 10 s; 3 for 5 s
    assert t.shrink() == 3
    assert sorted(snapshot(t)) == [3]
    batches, deleted = t.dirty_rows()
    assert deleted.tolist() == [1, 2, 4]
    assert [r["key"] for b in batches for r in b.to_pylist()] == [3]
    t.push(u64(2), g[:1])            # re-created: no longer a tombstone
    _, deleted = t.dirty_rows(clear=True)
    assert deleted.tolist() == [1, 4]
    batches, deleted = t.dirty_rows()
    assert sum(b.num_rows for b in batches) == 0 and len(deleted) == 0
    t.close()


def test_dirty_rows_include_spilled_rows_once(tmp_path):
    t = SparseTable(TableConfig(dim=3, memory_rows=10, spill_path=str(tmp_path / "s")))
    keys = np.arange(100, dtype=np.uint64)
    t.push(keys, np.ones((100, 3), np.float32))
    t.clear_dirty()
    touched = keys[::7]
    t.push(touched, np.ones((len(touched), 3), np.float32))
    t.pull(keys)  # churn: touched rows move between tiers
    batches, _ = t.dirty_rows()
    got = sorted(r["key"] for b in batches for r in b.to_pylist())
    assert got == sorted(touched.tolist())
    assert t.stats()["rows_spilled"] > 0
    t.close()


@pytest.mark.parametrize("optimizer", ["adagrad", "adam", "ftrl", "sgd"])
@pytest.mark.parametrize("spill", [False, True])
def test_rows_load_rows_round_trip_is_bit_exact(optimizer, spill, tmp_path):
    def make(name):
        return SparseTable(TableConfig(dim=5, optimizer=optimizer, seed=1, memory_rows=50,
                                       spill_path=str(tmp_path / name) if spill else None))

    rng = np.random.default_rng(0)
    src = make("a")
    for _ in range(5):
        keys = rng.integers(0, 400, 300).astype(np.uint64)
        src.push(keys, rng.standard_normal((300, 5)).astype(np.float32),
                 shows=np.ones(300, np.float32), clicks=(rng.random(300) < 0.2).astype(np.float32))
    dump = list(src.rows(chunk_rows=64))
    assert all(b.schema.equals(src.schema) for b in dump)
    dst = make("b")
    assert dst.load_rows(dump) == len(src)
    a, b = snapshot(src), snapshot(dst)
    assert a.keys() == b.keys()
    for k in a:  # compare float bits, not values
        for col in ("values", "state"):
            if col in a[k]:
                assert np.array(a[k][col], np.float32).tobytes() == np.array(b[k][col], np.float32).tobytes()
        assert (a[k]["show"], a[k]["click"], a[k]["last_seen"]) == (b[k]["show"], b[k]["click"], b[k]["last_seen"])
    probe = np.arange(400, dtype=np.uint64)
    assert src.pull(probe).tobytes() == dst.pull(probe).tobytes()
    if spill:
        assert src.stats()["rows_spilled"] > 0 and dst.stats()["rows_spilled"] > 0
    src.close()
    dst.close()


def test_load_rows_rejects_a_wrong_schema():
    t = SparseTable(TableConfig(dim=4, optimizer="adagrad"))
    bad = pa.RecordBatch.from_pydict({"key": pa.array([1], pa.uint64())})
    with pytest.raises(TableInputError, match="missing column 'values'"):
        t.load_rows([bad])
    other = SparseTable(TableConfig(dim=3, optimizer="adagrad"))
    other.push(u64(1), np.ones((1, 3), np.float32))
    with pytest.raises(TableInputError, match=r"column 'values': expected fixed_size_list<item: float>\[4\]"):
        t.load_rows(other.rows())
    assert len(t) == 0


@pytest.mark.parametrize("spill", [False, True])
def test_concurrent_pushes_obey_the_algebra(spill, tmp_path):
    """8 threads each push g for the same keys N times with sgd, lr 1: the rows end at exactly -8·N·g."""
    t = SparseTable(TableConfig(dim=4, optimizer="sgd", learning_rate=1.0, initializer="zeros",
                                memory_rows=300, spill_path=str(tmp_path / "s") if spill else None))
    keys = np.arange(1000, dtype=np.uint64)
    g = np.full((len(keys), 4), 0.5, np.float32)  # exact in float32 for these sums
    n_threads, n_pushes = 8, 25
    errors = []

    def worker():
        try:
            for _ in range(n_pushes):
                t.push(keys, g)
                v = t.pull(keys[::3])
                if not (np.all(v == v[:, :1])):  # a torn row would mix old and new values
                    errors.append("torn row")
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker) for _ in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors
    np.testing.assert_array_equal(t.pull(keys), np.full((1000, 4), -0.5 * n_threads * n_pushes, np.float32))
    assert len(t) == 1000
    t.close()


def test_large_pulls_split_across_threads_match_single_thread():
    keys = np.random.default_rng(3).integers(0, 2**64, 100_000, dtype=np.uint64)
    tables = [SparseTable(TableConfig(dim=8, num_threads=n, seed=2)) for n in (1, 3)]
    for t in tables:
        t.push(keys[:60_000], np.ones((60_000, 8), np.float32))
    a, b = (t.pull(keys) for t in tables)
    assert a.tobytes() == b.tobytes()
    assert not a[60_000:].any() or len(np.unique(keys)) < len(keys)


def test_initial_rows_do_not_depend_on_order_or_shard():
    cfg = TableConfig(dim=6, initializer="normal", init_range=0.1, seed=99)
    keys = np.random.default_rng(1).integers(0, 2**64, 50, dtype=np.uint64)
    a, b = SparseTable(cfg), SparseTable(cfg)
    a.push_delta(keys, np.zeros((50, 6), np.float32))
    b.push_delta(keys[::-1].copy(), np.zeros((50, 6), np.float32))
    np.testing.assert_array_equal(a.pull(keys), b.pull(keys))
    np.testing.assert_allclose(a.pull(keys), np.stack([naive.initial_values(cfg, int(k)) for k in keys]),
                               rtol=1e-6, atol=1e-7)


def test_stats_account_for_every_row(tmp_path):
    t = SparseTable(TableConfig(dim=4, memory_rows=100, spill_path=str(tmp_path / "s")))
    t.push(np.arange(1000, dtype=np.uint64), np.ones((1000, 4), np.float32))
    s = t.stats()
    assert s["rows_in_ram"] <= 100 and s["rows_in_ram"] + s["rows_spilled"] == 1000 == len(t)
    assert s["evictions"] >= 900 and s["ram_bytes"] > 0 and s["created"] == 1000
    t.close()


def test_contains_and_delete_cover_both_tiers(tmp_path):
    t = SparseTable(TableConfig(dim=2, memory_rows=10, spill_path=str(tmp_path / "s")))
    keys = np.arange(50, dtype=np.uint64)
    t.push(keys, np.ones((50, 2), np.float32))
    t.clear_dirty()
    assert t.contains(u64(0, 49, 50)).tolist() == [True, True, False]
    victims = u64(0, 1, 48, 49, 77)  # early keys are on disk, late ones in RAM; 77 never existed
    assert t.delete(victims) == 4
    assert not t.contains(victims).any() and len(t) == 46
    assert not t.pull(victims).any()
    _, deleted = t.dirty_rows()
    assert deleted.tolist() == [0, 1, 48, 49]
    assert sorted(snapshot(t)) == list(range(2, 48))
    t.close()


def test_load_rows_overwriting_a_full_table_does_not_grow_it():
    """Loading rows the table already holds (a delta checkpoint's changed rows) needs no new room."""
    t = SparseTable(TableConfig(dim=4, optimizer="adagrad"), initial_rows=1000)
    keys = np.arange(1000, dtype=np.uint64)
    t.push(keys, np.ones((1000, 4), np.float32))
    cap, slots = t._arena_u.shape[0], len(t._index)
    assert cap == 1000
    dump = list(t.rows(chunk_rows=300))
    assert t.load_rows(dump) == 1000 and len(t) == 1000
    assert (t._arena_u.shape[0], len(t._index)) == (cap, slots)
    fresh = SparseTable(TableConfig(dim=4, optimizer="adagrad"))
    fresh.push(np.array([5000], np.uint64), np.ones((1, 4), np.float32))
    assert t.load_rows(fresh.rows()) == 1 and len(t) == 1001          # a new row does grow it
    assert t._arena_u.shape[0] > cap


@pytest.mark.nojit
@pytest.mark.parametrize("spill", [False, True])
def test_pull_into_rows_of_a_shared_reply_matches_a_plain_pull(spill, tmp_path):
    """A server shard writes its keys' rows in place: pull(keys, out=, rows=) equals pull(keys[rows])
    at those positions (RAM rows, rows on disk, missing keys with init_missing) and leaves the others."""
    cfg = TableConfig(dim=5, optimizer="adagrad", seed=4, memory_rows=300 if spill else 1 << 20,
                      spill_path=str(tmp_path / "s") if spill else None)
    t = SparseTable(cfg)
    rng = np.random.default_rng(8)
    known = rng.integers(0, 2**64, 1000, dtype=np.uint64)
    t.push(known, rng.normal(size=(1000, 5)).astype(np.float32))
    keys = np.concatenate([known[:600], rng.integers(0, 2**64, 200, dtype=np.uint64)])
    rng.shuffle(keys)
    rows = np.sort(rng.choice(len(keys), 500, replace=False)).astype(np.int64)
    for init in (False, True):
        want = t.pull(keys[rows], init_missing=init)
        out = np.full((len(keys), 5), 7.0, np.float32)
        assert t.pull(keys, init_missing=init, out=out, rows=rows) is out
        np.testing.assert_array_equal(out[rows], want)
        others = np.setdiff1d(np.arange(len(keys)), rows)
        assert (out[others] == 7.0).all()
    full = np.empty((len(keys), 5), np.float32)
    np.testing.assert_array_equal(t.pull(keys, out=full), t.pull(keys))
    t.close()


def test_pull_into_rejects_a_bad_out_or_rows():
    t = SparseTable(TableConfig(dim=3))
    keys = u64(1, 2, 3)
    with pytest.raises(TableInputError, match="rows needs out"):
        t.pull(keys, rows=np.arange(2))
    with pytest.raises(TableInputError, match=r"out must be a C-contiguous float32\[3, 3\]"):
        t.pull(keys, out=np.empty((3, 4), np.float32))
    with pytest.raises(TableInputError, match=r"rows must be positions in \[0, 3\)"):
        t.pull(keys, out=np.empty((3, 3), np.float32), rows=np.array([0, 3]))
    t.close()
