"""A delta's ``existed`` column (``sparse_tables._delta``): each changed row says whether its key held a
row at the parent checkpoint, and a restore of a chain into tables that spill takes that answer instead
of reading RocksDB, while every count stays exact.

- A model of the table's keys checks the column after random pushes, deletes, evictions, expiry passes
  and captures (bases and deltas).
- A base and two deltas written by two servers restore onto one server: the same rows, the same
  count, and no point read of RocksDB for the deltas' rows; the same chain loaded without trust (its
  parent not marked) reads and gives the same rows and count.
- Trust ends with traffic: a push inside ``delta_load`` makes the rest of the load ask RocksDB.
- A delta whose ``existed`` holds garbage is refused before any row changes, naming the file.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engine.checkpoint import CheckpointManager
from engine.errors import RemoteError
from engine.ps import InProcessTransport, PSClient, PSServer
from sparse_tables import SparseTable, TableConfig
from sparse_tables import rows as rows_mod
from sparse_tables.rows import EXISTED_NO, EXISTED_UNKNOWN, EXISTED_YES
from tests.faults import ServerClock

DIM = 4
UNIVERSE = 120


def spilled_table(path, memory_rows: int = 16, clock=None) -> SparseTable:
    cfg = TableConfig(dim=DIM, optimizer="adagrad", learning_rate=0.1, num_threads=1, memory_rows=memory_rows,
                      spill_path=str(path), expire_after=50.0)
    return SparseTable(cfg, clock=clock or (lambda: 0.0))


def keys_of(batches) -> np.ndarray:
    return np.concatenate([b.column("key").to_numpy() for b in batches]) if batches else np.empty(0, np.uint64)


ops = st.lists(st.one_of(
    # a push of a run of keys: runs of up to 48 overlap one another and outgrow the 16 rows in RAM
    st.tuples(st.just("push"), st.tuples(st.integers(0, UNIVERSE - 1), st.integers(1, 48)).map(
        lambda a: list(range(a[0], min(UNIVERSE, a[0] + a[1]))))),
    st.tuples(st.just("delete"), st.lists(st.integers(0, UNIVERSE - 1), min_size=1, max_size=20)),
    st.tuples(st.just("expire"), st.integers(0, 3)),
    st.tuples(st.just("delta"), st.just(0)),
    st.tuples(st.just("base"), st.just(0))), min_size=1, max_size=30)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_existed_matches_the_keys_at_the_parent(tmp_path_factory, program):
    """After any sequence of pushes, deletes and expiry passes (over RAM and RocksDB; 16 rows in RAM, so
    rows go back and forth), each row of a delta says EXISTED_YES exactly when its key had a row at the
    last capture (a key deleted and created again since included), and the tombstones are exactly the
    keys the last capture held that have no row now."""
    now = [0.0]
    t = spilled_table(tmp_path_factory.mktemp("spill"), clock=lambda: now[0])
    try:
        present: set[int] = set()
        seen_at: dict[int, float] = {}
        parent: set[int] = set()
        program = program + [("delta", 0)]
        for op, arg in program:
            if op == "push":
                keys = np.array(sorted(set(arg)), np.uint64)
                t.push(keys, np.full((len(keys), DIM), 0.5, np.float32))
                present |= set(arg)
                seen_at.update({k: now[0] for k in arg})
            elif op == "delete":
                t.delete(np.array(arg, np.uint64))
                present -= set(arg)
            elif op == "expire":           # rows last pushed more than 50 s ago go (RAM and RocksDB)
                now[0] += 20.0 * (arg + 1)
                gone = {k for k in present if now[0] - seen_at[k] > 50.0}
                t.shrink()
                present -= gone
            elif op == "base":
                assert set(keys_of(list(t.rows(clear=True))).tolist()) == present
                parent = set(present)
            else:
                batches, tombstones = t.dirty_rows(clear=True)
                keys = keys_of(batches)
                existed = (np.concatenate([b.column("existed").to_numpy() for b in batches])
                           if batches else np.empty(0, np.uint8))
                for k, e in zip(keys.tolist(), existed.tolist()):
                    assert e == (EXISTED_YES if k in parent else EXISTED_NO), (k, e)
                assert set(keys.tolist()) <= present
                # tombstones: exactly the keys the parent held that have no row now
                assert set(tombstones.tolist()) == parent - present
                parent = set(present)
            assert len(t) == len(present)
    finally:
        t.close()


# ------------------------------------------------------------------------------ restore of a chain
CLOCK = ServerClock()
N_KEYS = 600


def cluster(tmp_path, tag: str, n: int):
    cfg = TableConfig(dim=DIM, optimizer="adagrad", learning_rate=0.1, num_threads=1, memory_rows=40,
                      expire_after=100.0, spill_path=str(tmp_path / f"spill-{tag}"))
    servers = [PSServer({"emb": cfg}, {}, index=i, num_servers=n, num_vshards=64, local_shards=2, clock=CLOCK)
               for i in range(n)]
    return servers, PSClient(InProcessTransport(servers))


def shards(servers):
    return [sh for s in servers for sh in s.sparse["emb"].shards]


def point_reads(servers) -> int:
    return sum(sh.stats()["rocksdb"]["point_reads"] for sh in shards(servers))


def rows_held(servers) -> int:
    return sum(len(sh) for sh in shards(servers))


@pytest.fixture
def chain(tmp_path):
    """Two servers (2 shards each, 40 rows in RAM a shard): a base, then a delta with new keys, updates
    and an expiry pass's tombstones, then a second delta; returns the keys ever pushed, the source
    cluster and the checkpoints."""
    rng = np.random.default_rng(7)
    universe = rng.choice(1 << 40, 3 * N_KEYS, replace=False).astype(np.uint64)
    src, client = cluster(tmp_path, "src", 2)
    mgr = CheckpointManager(str(tmp_path / "ckpt"), "job")
    grads = lambda n: rng.normal(size=(n, DIM)).astype(np.float32)     # noqa: E731
    client.push("emb", universe[:N_KEYS], grads(N_KEYS))
    names = [mgr.save(client, "base", when=0.0)["name"]]
    CLOCK.advance(60.0)
    client.push("emb", universe[N_KEYS // 2:N_KEYS + 300], grads(N_KEYS // 2 + 300))   # updates and new keys
    CLOCK.advance(60.0)
    client.shrink("emb")          # rows last pushed 120 s ago expire: tombstones
    names.append(mgr.save(client, "delta", when=60.0)["name"])
    client.push("emb", universe[N_KEYS:N_KEYS + 500], grads(500))
    names.append(mgr.save(client, "delta", when=120.0)["name"])
    yield universe, src, client, mgr, names
    for s in src:
        s.close()


def test_chain_restore_trusts_existed_and_counts_exactly(chain, tmp_path):
    universe, src, client, mgr, names = chain
    want = client.pull("emb", universe)
    dst, dclient = cluster(tmp_path, "dst", 1)
    try:
        dclient.load(mgr.uri_of(names[0]))
        assert all(sh.checkpoint == mgr.uri_of(names[0]).rstrip("/") for sh in shards(dst))
        for name in names[1:]:
            before = point_reads(dst)
            dclient.load(mgr.uri_of(name))
            # every delta row was written without asking RocksDB whether its key was there
            assert point_reads(dst) == before, name
        np.testing.assert_array_equal(dclient.pull("emb", universe), want)
        assert rows_held(dst) == rows_held(src)
        assert sum(sh.stats()["rows_spilled"] for sh in shards(dst)) > 0
        assert sum(sh.stats()["loaded_unasked"] for sh in shards(dst)) > 0
    finally:
        for s in dst:
            s.close()


def test_delta_onto_another_state_asks_and_stays_exact(chain, tmp_path):
    """The same deltas on a table that does not hold their parent (a push after the base's restore
    ends the trust): the rows are read to count them, and the result is as exact."""
    universe, src, client, mgr, names = chain
    want_rows = rows_held(src)
    dst, dclient = cluster(tmp_path, "dst", 1)
    try:
        dclient.load(mgr.uri_of(names[0]))
        k = universe[:1]
        dclient.push("emb", k, np.zeros((1, DIM), np.float32))        # zero gradient: values unchanged
        assert all(sh.checkpoint is None for sh in shards(dst) if sh.contains(k).any())
        before = point_reads(dst)
        for name in names[1:]:
            dclient.load(mgr.uri_of(name))
        assert point_reads(dst) > before
        assert rows_held(dst) == want_rows
        np.testing.assert_array_equal(dclient.pull("emb", universe[1:]), client.pull("emb", universe[1:]))
    finally:
        for s in dst:
            s.close()


def test_garbage_existed_is_refused_before_any_row_changes(chain, tmp_path, monkeypatch):
    universe, src, client, mgr, names = chain
    real = rows_mod._existed
    monkeypatch.setattr(rows_mod, "_existed", lambda *a: pa.array(np.full(len(real(*a)), 7, np.uint8)))
    client.push("emb", universe[:50], np.ones((50, DIM), np.float32))
    bad = mgr.save(client, "delta", when=180.0)["name"]
    monkeypatch.undo()
    dst, dclient = cluster(tmp_path, "dst", 1)
    try:
        for name in names:
            dclient.load(mgr.uri_of(name))
        before = (dclient.pull("emb", universe).copy(), rows_held(dst))
        with pytest.raises(RemoteError, match=r"sparse/emb/.*\.arrow: rows 0\.\.\d+: .*'existed': row 0 holds 7"):
            dclient.load(mgr.uri_of(bad))
        np.testing.assert_array_equal(dclient.pull("emb", universe), before[0])
        assert rows_held(dst) == before[1]
    finally:
        for s in dst:
            s.close()


def test_a_push_during_a_delta_load_ends_the_trust(tmp_path):
    """Inside ``delta_load`` a row that (falsely) says EXISTED_NO for a key on disk would be counted
    twice if trusted: after a push in the same load it is asked about, and the count stays exact;
    without the push the table trusts it (the test's lie shows in the count)."""
    for traffic in (True, False):
        t = spilled_table(tmp_path / f"t{traffic}", memory_rows=16)
        try:
            t.push(np.arange(64, dtype=np.uint64), np.ones((64, DIM), np.float32))   # 48 on disk
            batches, _ = t.dirty_rows(clear=True)
            t.mark_checkpoint("mem://parent")
            rows = pa.Table.from_batches(batches).combine_chunks().to_batches()[0]
            lie = rows.set_column(rows.schema.get_field_index("existed"), "existed",
                                  pa.array(np.zeros(rows.num_rows, np.uint8)))
            n = len(t)
            with t.delta_load("mem://parent") as trusted:
                assert trusted
                if traffic:
                    t.push(np.array([1000], np.uint64), np.ones((1, DIM), np.float32))
                t.load_rows([lie])
            if traffic:
                assert len(t) == n + 1
            else:
                assert len(t) > n            # the lie was believed: rows on disk counted again
        finally:
            t.close()


def test_delta_load_of_another_parent_is_not_trusted(tmp_path):
    t = spilled_table(tmp_path / "t")
    try:
        t.mark_checkpoint("mem://a/")
        with t.delta_load("mem://b") as trusted:
            assert not trusted
        assert t.checkpoint is None          # the load itself leaves the table between checkpoints
        t.mark_checkpoint("mem://a")
        with t.delta_load("mem://a/") as trusted:
            assert trusted
        with t.delta_load("mem://a") as trusted:
            assert not trusted                # consumed by the first load
    finally:
        t.close()


@pytest.mark.parametrize("column", ["unknown", "absent"])
def test_rows_without_an_answer_are_asked(tmp_path, column):
    """Inside a trusted load, rows that say EXISTED_UNKNOWN, or a delta written before the column
    existed, ask RocksDB: the count stays exact (every key here is already on disk or in RAM)."""
    t = spilled_table(tmp_path / "t", memory_rows=16)
    try:
        t.push(np.arange(64, dtype=np.uint64), np.ones((64, DIM), np.float32))
        batches, _ = t.dirty_rows(clear=True)
        t.mark_checkpoint("mem://parent")
        rows = pa.Table.from_batches(batches).combine_chunks().to_batches()[0]
        at = rows.schema.get_field_index("existed")
        rows = (rows.set_column(at, "existed", pa.array(np.full(rows.num_rows, EXISTED_UNKNOWN, np.uint8)))
                if column == "unknown" else rows.remove_column(at))
        reads = t.stats()["rocksdb"]["point_reads"]
        with t.delta_load("mem://parent") as trusted:
            assert trusted
            t.load_rows([rows])
        assert len(t) == 64
        assert t.stats()["rocksdb"]["point_reads"] > reads
    finally:
        t.close()


@pytest.mark.parametrize("traffic", ["push", "delete", "expire", "none"])
def test_traffic_during_a_restore_leaves_the_table_unmarked(tmp_path, traffic):
    """A push, delete or expiry pass while a delta loads: the table holds neither the parent nor the
    delta exactly, so ``finish_restore`` does not mark it and the next delta is asked about; the load's
    own tombstones do not count as traffic."""
    t = spilled_table(tmp_path / "t")
    try:
        t.push(np.arange(40, dtype=np.uint64), np.ones((40, DIM), np.float32))
        t.mark_checkpoint("mem://parent")
        with t.delta_load("mem://parent") as trusted:
            assert trusted
            t.delete(np.array([3], np.uint64), tombstones=True, at_parent=True)
            if traffic == "push":
                t.push(np.array([1000], np.uint64), np.ones((1, DIM), np.float32))
            elif traffic == "delete":
                t.delete(np.array([4], np.uint64))
            elif traffic == "expire":
                t.shrink(now=0.0)
        assert t.finish_restore("mem://child") == (traffic == "none")
        assert t.checkpoint == ("mem://child" if traffic == "none" else None)
        with t.delta_load("mem://child") as trusted:
            assert trusted == (traffic == "none")
    finally:
        t.close()
