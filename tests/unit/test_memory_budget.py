"""memory_bytes: one RAM budget for a table's shards on a server (sparse_tables.budget), the arena
compaction that gives pages back when the budget shrinks the RAM tier, and the RocksDB parts."""
from __future__ import annotations

import numpy as np
import pytest

from sparse_tables import SparseTable, TableConfig, TableConfigError
from sparse_tables import _kernels as K
from sparse_tables._compact import compact_arena
from sparse_tables.budget import HEADROOM_ROWS, MemoryBudget, host_memory_bytes

MiB = 1 << 20
DIM = 4


def _keys(n, seed):
    return np.unique(np.random.default_rng(seed).integers(1, 2**63, n, dtype=np.uint64))


def _budgeted_and_reference(tmp_path, budget: int = 96 * MiB):
    """A spilling table under ``budget`` bytes and a RAM-only table with the same rule (SGD, lr 1)."""
    rule = dict(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros")
    return (SparseTable(TableConfig(**rule, memory_bytes=budget, spill_path=str(tmp_path / "spill"))),
            SparseTable(TableConfig(**rule)))


@pytest.mark.nojit
def test_compact_arena_moves_live_rows_below_the_target_and_keeps_every_key():
    t = SparseTable(TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros"),
                    initial_rows=64)
    keys = np.arange(1, 41, dtype=np.uint64)
    t.push(keys, np.arange(40 * DIM, dtype=np.float32).reshape(40, DIM))
    before = t.pull(keys)
    gone = keys[::3]                                  # free rows spread over the arena
    t.delete(gone)
    kept = np.setdiff1d(keys, gone)
    n_next = int(t._state[K.S_NEXT])
    target = len(kept) + 2
    moved = compact_arena(t._index, t._arena_u, t._state, t._lay, target)
    assert moved > 0 and int(t._state[K.S_NEXT]) == target
    rows = np.empty(len(kept), np.int64)
    K.find_rows(t._index, t._arena_u, kept, rows)
    assert rows.max() < target and len(np.unique(rows)) == len(kept)
    np.testing.assert_array_equal(t.pull(kept), before[np.isin(keys, kept)])
    assert not t.contains(gone).any()
    # the free list holds exactly the 2 spare rows below the target; new keys use them, then S_NEXT
    assert int(t._state[K.S_NFREE]) == 2
    t.push(np.array([1000, 1001, 1002], np.uint64), np.ones((3, DIM), np.float32))
    assert int(t._state[K.S_NEXT]) == target + 1
    # a target below the live rows, or above S_NEXT, changes nothing
    assert compact_arena(t._index, t._arena_u, t._state, t._lay, len(kept) - 1) == -1
    assert compact_arena(t._index, t._arena_u, t._state, t._lay, n_next + 100) == -1
    t.close()


def test_memory_bytes_needs_a_spill_path_and_a_budget_that_fits():
    with pytest.raises(TableConfigError, match="memory_bytes"):
        TableConfig(dim=DIM, memory_bytes=1 << 30)
    with pytest.raises(TableConfigError, match="memory_bytes"):
        TableConfig(dim=DIM, memory_bytes=-1, spill_path="/tmp/x")
    with pytest.raises(ValueError, match="give at least"):
        MemoryBudget(16 * MiB, 1, 96)


def test_a_budget_past_this_hosts_memory_is_a_config_error_naming_the_key(tmp_path):
    host = host_memory_bytes()
    assert host and host > 1 << 28
    over = 2 * host                   # mapped and indexed, this took minutes and most of the RAM, or ENOMEM
    with pytest.raises(TableConfigError, match=rf"TableConfig\.memory_bytes={over}: exceeds this host's {host} "
                                               rf"bytes of physical memory"):
        SparseTable(TableConfig(dim=DIM, memory_bytes=over, spill_path=str(tmp_path / "a")))
    from concurrent.futures import ThreadPoolExecutor
    from engine.ps.hosts import SparseHost
    with pytest.raises(TableConfigError, match=rf"tables\.sparse\.emb\.memory_bytes={over}: exceeds this host"):
        SparseHost("emb", TableConfig(dim=DIM, memory_bytes=over, spill_path=str(tmp_path / "b")), server=0,
                   num_servers=1, num_vshards=64, num_local=2, pool=ThreadPoolExecutor(1))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    with pytest.raises(TableConfigError, match=rf"memory_bytes={1 << 30}: exceeds this host's {1 << 29} bytes"):
        MemoryBudget(1 << 30, 1, 96).check_host(host_bytes=1 << 29)
    MemoryBudget(1 << 30, 1, 96).check_host(host_bytes=1 << 30)              # all of it: allowed


ENOMEM = r"""
import resource, sys
from sparse_tables import SparseTable, TableConfig, TableConfigError
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), hard))     # room to run, not for the arena
try:
    SparseTable(TableConfig(dim=4, memory_bytes=2 << 30, spill_path=sys.argv[1]))
except TableConfigError as e:
    print("TableConfigError:", e)
"""


def test_an_arena_the_os_refuses_to_map_is_a_config_error_naming_memory_bytes(tmp_path):
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-c", ENOMEM, str(tmp_path / "spill")], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith(f"TableConfigError: sparse table: memory_bytes={2 << 30}: its arena (") \
        and "cannot be mapped: [Errno 12] Cannot allocate memory" in p.stdout, p.stdout


def test_a_budgeted_table_keeps_ram_under_its_cap_and_loses_no_row(tmp_path):
    t, ref = _budgeted_and_reference(tmp_path)
    cap = t.budget.rows_cap()
    assert cap <= t.budget.max_rows_per_shard - HEADROOM_ROWS
    slots = len(t._index)
    for i in range(8):                                # more keys than the RAM tier holds
        k = _keys(150_000, i)
        g = np.random.default_rng(100 + i).standard_normal((len(k), DIM)).astype(np.float32)
        t.push(k, g)
        ref.push(k, g)
        st = t.stats()
        assert st["rows_in_ram"] <= cap
    assert st["rows_spilled"] > 0 and st["rows"] == len(ref)
    assert len(t._index) == slots, "a budgeted table sized its index once and never rehashed"
    probe = _keys(150_000, 3)
    np.testing.assert_array_equal(t.pull(probe), ref.pull(probe))
    mem, parts = st["memory"], st["memory_budget"]
    assert parts["budget"] == 96 * MiB
    assert parts["rows"] + parts["index"] + parts["rocksdb"] + parts["growing"] + parts["reserve"] <= 96 * MiB
    assert mem["filters"] > 0 and mem["index"] == parts["index"]
    assert mem["rocksdb_block_cache"] <= parts["rocksdb"]
    t.close()
    ref.close()


def test_a_shrinking_budget_compacts_the_arena_and_gives_pages_back(tmp_path):
    t, ref = _budgeted_and_reference(tmp_path)
    for i in range(5):
        k = _keys(150_000, i)
        t.push(k, np.ones((len(k), DIM), np.float32))
        ref.push(k, np.ones((len(k), DIM), np.float32))
    cap = t.budget.rows_cap()
    other = t.budget.register()                       # another shard whose filters grew by 12 MiB
    t.budget.report(other, 12 * MiB, 0)
    assert 1024 < t.budget.rows_cap() < cap - 200_000
    k = _keys(50_000, 99)
    t.push(k, np.ones((len(k), DIM), np.float32))
    ref.push(k, np.ones((len(k), DIM), np.float32))
    st = t.stats()
    assert st["compactions"] == 1 and st["compacted_rows"] > 0 and st["released_bytes"] > 0
    assert st["memory"]["rows"] <= t.budget.rows_allowed() * st["row_bytes"]
    parts = st["memory_budget"]
    assert parts["rows"] + parts["index"] + parts["rocksdb"] + parts["growing"] + parts["reserve"] <= 96 * MiB
    for seed in (0, 2, 4, 99):
        probe = _keys(150_000, seed) if seed != 99 else k
        np.testing.assert_array_equal(t.pull(probe), ref.pull(probe))
    t.close()
    ref.close()


def test_a_servers_shards_share_one_budget_one_block_cache_and_report_its_parts(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from engine.ps.hosts import SparseHost
    cfg = TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros",
                      memory_bytes=128 * MiB, spill_path=str(tmp_path / "spill"))
    host = SparseHost("emb", cfg, server=0, num_servers=1, num_vshards=64, num_local=2,
                      pool=ThreadPoolExecutor(2))
    budget = host.budget
    assert budget is not None and budget.shards == 2 and all(s.budget is budget for s in host.shards)
    for i in range(12):
        k = _keys(150_000, i)
        host.push(k, np.ones((len(k), DIM), np.float32), None, None, delta=False)
    assert budget.cache is not None       # one Cache object made by the first store, used by both
    st = host.stats()
    assert st["rows_spilled"] > 0
    # each shard evicts to the cap of its own last call; the other shard's later growth may have lowered
    # the cap since, never below what the budget allows
    assert max(s.stats()["rows_in_ram"] for s in host.shards) <= budget.rows_allowed()
    parts = st["memory_budget"]
    assert parts["rows"] == st["memory"]["rows"] and parts["index"] == st["memory"]["index"]
    assert parts["rows"] + parts["index"] + parts["rocksdb"] + parts["growing"] + parts["reserve"] <= 128 * MiB
    for s in host.shards:
        s.close()


@pytest.mark.nojit
def test_sampled_lru_picks_distinct_live_rows_and_spares_the_hot_ones():
    from sparse_tables._evict import sample_lru
    t = SparseTable(TableConfig(dim=DIM, optimizer="sgd", initializer="zeros"), initial_rows=4096)
    keys = np.arange(1, 3001, dtype=np.uint64)
    for i in range(0, 3000, 100):            # 30 pushes: rows of later pushes have later ticks
        t.push(keys[i:i + 100], np.ones((100, DIM), np.float32))
    t.delete(keys[::7])                      # free rows among the candidates
    out = np.empty(200, np.int64)
    n = sample_lru(t._arena_u, t._state, t._lay, 200, 8, np.uint64(5), out, False)
    rows = out[:n]
    assert n == 200 and len(np.unique(rows)) == n
    flags = t._arena_u[rows, t.layout.meta + K.M_FLAGS]
    assert not (flags & K.F_FREE).any()
    ticks = t._arena_u[rows, t.layout.meta + K.M_TICK]
    all_ticks = t._arena_u[:int(t._state[K.S_NEXT]), t.layout.meta + K.M_TICK][
        (t._arena_u[:int(t._state[K.S_NEXT]), t.layout.meta + K.M_FLAGS] & K.F_FREE) == 0]
    # the victims are old: none from the newest third of the rows, most from the oldest third
    assert ticks.max() < np.quantile(all_ticks, 0.67)
    assert np.mean(ticks <= np.quantile(all_ticks, 0.34)) > 0.8
    # as many draws as rows handed out: the strata are single rows, every live row is a candidate and
    # the choice is exact LRU
    n = sample_lru(t._arena_u, t._state, t._lay, 200, 100, np.uint64(9), out, False)
    assert n == 200 and np.sort(t._arena_u[out, t.layout.meta + K.M_TICK]).tolist() == \
        np.sort(all_ticks)[:200].tolist()
    t.close()


@pytest.mark.nojit
def test_sorted_key_set_is_an_exact_set_with_bounded_runs(monkeypatch):
    from sparse_tables.keysets import SortedKeySet
    monkeypatch.setattr(SortedKeySet, "TAIL", 64)
    monkeypatch.setattr(SortedKeySet, "MAX_RUN", 1000)
    s, ref = SortedKeySet(), set()
    rng = np.random.default_rng(3)
    for i in range(400):
        k = rng.integers(0, 5000, int(rng.integers(0, 40)), dtype=np.uint64)
        s.add(k)
        ref.update(int(x) for x in k)
        if i % 40 == 0:
            q = rng.integers(0, 6000, 500, dtype=np.uint64)
            np.testing.assert_array_equal(s.contains(q), [int(x) in ref for x in q])
    assert len(s) == len(ref) and s.to_array().tolist() == sorted(ref)
    assert max(len(r) for r in s._runs) <= 1000 + 64        # merges stop at MAX_RUN (a run may exceed it by a tail)
    assert s.nbytes <= 8 * (sum(len(r) for r in s._runs) + 64)
    s.clear()
    assert len(s) == 0 and not s.contains(np.array([1], np.uint64)).any()


def _dump(t):
    import pyarrow as pa
    tab = pa.Table.from_batches(list(t.rows()), schema=t.schema).sort_by("key")
    return {c: np.asarray(tab.column(c).combine_chunks().flatten() if "list" in str(tab.schema.field(c).type)
                          else tab.column(c).to_numpy()) for c in tab.column_names}


def test_a_load_into_a_full_ram_tier_writes_the_rest_straight_to_disk_bit_exact(tmp_path):
    src = SparseTable(TableConfig(dim=DIM, optimizer="adagrad"))
    k = _keys(300_000, 1)
    src.push(k, np.random.default_rng(2).standard_normal((len(k), DIM)).astype(np.float32))
    dst = SparseTable(TableConfig(dim=DIM, optimizer="adagrad", memory_rows=100_000,
                                  spill_path=str(tmp_path / "spill")))
    assert dst.load_rows(src.rows()) == len(k)
    st = dst.stats()
    assert st["loaded_to_disk"] > 100_000 and st["rows"] == len(k) and st["rows_in_ram"] <= 100_000
    a, b = _dump(src), _dump(dst)
    for c in ("key", "values", "state", "show", "click", "last_seen"):
        np.testing.assert_array_equal(a[c], b[c])
    # a second load of part of the rows, changed, overwrites them (in RAM or on disk) and adds no row
    part = k[::3]
    src.push(part, np.ones((len(part), DIM), np.float32))
    dst.load_rows(src.rows())
    assert len(dst) == len(k)
    np.testing.assert_array_equal(dst.pull(k), src.pull(k))
    src.close()
    dst.close()


def test_a_key_twice_in_one_load_batch_keeps_its_last_value_when_the_ram_tier_is_full(tmp_path):
    import pyarrow as pa
    src = SparseTable(TableConfig(dim=DIM, optimizer="sgd", initializer="zeros"))
    keys = np.array([10, 1, 2, 3, 10, 5], np.uint64)
    src.push(np.unique(keys), np.zeros((5, DIM), np.float32))
    batch = next(iter(src.rows()))
    order = [int(np.flatnonzero(batch.column(0).to_numpy() == k)[0]) for k in keys]
    rows = batch.take(pa.array(order))
    vals = np.arange(6 * DIM, dtype=np.float32).reshape(6, DIM)
    rows = rows.set_column(1, "values", pa.FixedSizeListArray.from_arrays(pa.array(vals.reshape(-1)), DIM))
    for memory_rows in (4, 100):                 # a full RAM tier (direct-to-disk path) and room for all
        dst = SparseTable(TableConfig(dim=DIM, optimizer="sgd", initializer="zeros", memory_rows=memory_rows,
                                      spill_path=str(tmp_path / f"spill{memory_rows}")))
        dst.load_rows([rows])
        np.testing.assert_array_equal(dst.pull(np.array([10], np.uint64))[0], vals[4])   # the last copy wins
        assert len(dst) == 5
        dst.close()
    src.close()


def test_a_push_bigger_than_the_headroom_evicts_within_the_call_instead_of_growing(tmp_path):
    t, ref = _budgeted_and_reference(tmp_path)
    arena_rows, slots = t._arena_u.shape[0], len(t._index)
    cap = t.budget.rows_cap()
    old = _keys(cap, 7)                                   # fill the RAM tier
    t.push(old, np.ones((len(old), DIM), np.float32))
    ref.push(old, np.ones((len(old), DIM), np.float32))
    big = np.concatenate([_keys(3 * HEADROOM_ROWS, 8), old[:50_000]])   # far more new rows than the headroom
    g = np.random.default_rng(9).standard_normal((len(big), DIM)).astype(np.float32)
    t.push(big, g)
    ref.push(big, g)
    assert t._arena_u.shape[0] == arena_rows and len(t._index) == slots, "the arena grew under a budget"
    assert t.stats()["rows_in_ram"] <= cap
    for probe in (old, big):
        np.testing.assert_array_equal(t.pull(probe), ref.pull(probe))
    assert len(t) == len(ref)
    t.close()
    ref.close()


def test_stats_never_read_an_array_being_swapped_nor_wait_for_the_writer(tmp_path):
    """A Stats RPC or a Prometheus scrape calls stats() from another thread; a compaction or a release
    of RAM swaps the arena and index under the exclusive lock, so stats() reads them only under the
    shared lock. It does not wait for a writer either (an expiry pass holds a shard for a minute at
    10^8 keys): while one holds the lock, the sizes of the last read are served, marked stale."""
    import threading

    t, ref = _budgeted_and_reference(tmp_path)
    keys = _keys(5000, 7)
    t.push(keys, np.ones((len(keys), DIM), np.float32))
    t.stats()                                  # the last read with the lock
    got, held, release = [], threading.Event(), threading.Event()
    arrays = (t._arena_u, t._arena_f, t._index)

    def writer():
        with t._lock.exclusive():
            t._arena_u = t._arena_f = t._index = None      # half-way through a swap: unreadable
            held.set()
            release.wait(10)
            t._arena_u, t._arena_f, t._index = arrays

    w = threading.Thread(target=writer)
    w.start()
    held.wait(10)
    r = threading.Thread(target=lambda: got.append(t.stats()))
    r.start()
    r.join(5)
    assert not r.is_alive() and got            # answered, without touching the arrays
    st = got[0]
    assert st["stale"] and st["rows"] == len(keys) and st["rows_in_ram"] + st["rows_spilled"] == len(keys)
    assert st["push_keys"] == len(keys) and "rocksdb" in st and st["memory_budget"]
    release.set()
    w.join(10)
    st = t.stats()
    assert not st["stale"] and st["rows"] == len(keys) and st["rows_in_ram"] + st["rows_spilled"] == len(keys)
    t.close()
    ref.close()


def test_a_load_of_sorted_batches_from_a_spilled_dump_goes_to_disk_bit_exact_and_counts_once(tmp_path):
    # a spilled table dumps its RocksDB rows in key order: the load writes those without sorting them
    src = SparseTable(TableConfig(dim=DIM, optimizer="adagrad", memory_rows=20_000,
                                  spill_path=str(tmp_path / "src")))
    k = _keys(120_000, 4)
    src.push(k, np.random.default_rng(3).standard_normal((len(k), DIM)).astype(np.float32))
    batches = list(src.rows(chunk_rows=8192))
    sorted_batches = [b for b in batches if np.all(np.diff(b.column(0).to_numpy().astype(np.float64)) > 0)]
    assert len(sorted_batches) >= 5                     # the dump really has sorted batches
    dst = SparseTable(TableConfig(dim=DIM, optimizer="adagrad", memory_rows=10_000,
                                  spill_path=str(tmp_path / "dst")))
    assert dst.load_rows(batches) == len(k)
    st = dst.stats()
    assert st["loaded_to_disk"] > 50_000 and st["rows"] == len(k) == len(dst)
    a, b = _dump(src), _dump(dst)
    for c in ("key", "values", "state", "show", "click", "last_seen"):
        np.testing.assert_array_equal(a[c], b[c])
    dst.load_rows(sorted_batches)                        # again: overwritten where they are, no new row
    assert len(dst) == len(k) and dst.stats()["rows_spilled"] + dst.stats()["rows_in_ram"] == len(k)
    np.testing.assert_array_equal(dst.pull(k), src.pull(k))
    src.close()
    dst.close()


def test_a_pull_promoting_more_than_the_headroom_reads_in_chunks_and_never_grows_the_arena(tmp_path):
    """A pull whose rows on disk exceed the arena's room promotes and reads them chunk by chunk (each
    chunk read before the next one's eviction pass): same values, misses, initial values and counters as
    one promotion of everything, but the arena a budget sized is never replaced by a bigger copy. A
    push of that many rows on disk takes them in parts the same way."""
    rule = dict(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="uniform", init_range=0.5, seed=3)
    t = SparseTable(TableConfig(**rule, memory_bytes=56 * MiB, spill_path=str(tmp_path / "spill")))
    ref = SparseTable(TableConfig(**rule))
    cap = t.budget.rows_cap()
    room = t.budget.max_rows_per_shard - cap                   # rows the arena takes past a full tier
    cold, hot = _keys(300_000, 11), _keys(cap, 12)              # cold first: on disk once hot fills RAM
    for i, k in enumerate((cold, hot)):
        g = np.random.default_rng(20 + i).standard_normal((len(k), DIM)).astype(np.float32)
        t.push(k, g)
        ref.push(k, g)
    arena, index = t._arena_u, t._index
    unknown = _keys(5000, 13)
    probe = np.concatenate([cold, hot[:20_000], unknown, cold[:7000]])     # repeats and keys with no row
    np.random.default_rng(14).shuffle(probe)
    for call in range(2):
        rows_in = np.empty(len(probe), np.int64)
        K.find_rows(t._index, t._arena_u, probe, rows_in)
        on_disk = np.setdiff1d(probe[rows_in < 0], unknown)
        assert len(on_disk) > room, "the pull must promote more rows than the arena has room for"
        before = t.stats()
        if call == 0:
            got = t.pull(probe, init_missing=True)
        else:                                                   # a server shard's part of a request
            pos = np.arange(0, len(probe), 2)
            got = np.full((len(probe), DIM), -7.0, np.float32)
            t.pull(probe, init_missing=True, out=got, rows=pos)
            assert (got[1::2] == -7.0).all()
            got, rows_in = got[pos], rows_in[pos]
            on_disk = np.setdiff1d(probe[pos][rows_in < 0], unknown)
        want = ref.pull(probe if call == 0 else probe[::2], init_missing=True)
        np.testing.assert_array_equal(got, want)
        st = t.stats()
        assert t._arena_u is arena and t._index is index, "the arena or index was copied under the lock"
        assert st["promotions"] - before["promotions"] == len(on_disk)
        assert st["pull_hits"] - before["pull_hits"] == int(np.count_nonzero(rows_in >= 0))
        assert st["pull_misses"] - before["pull_misses"] == int(np.count_nonzero(rows_in < 0))
        assert st["rows_in_ram"] <= cap and st["rows"] == len(ref)
    # a push of as many rows on disk (and new keys) promotes them in parts, an eviction pass between
    rows_in = np.empty(len(cold), np.int64)
    K.find_rows(t._index, t._arena_u, cold, rows_in)
    assert np.count_nonzero(rows_in < 0) > room
    k = np.concatenate([cold, _keys(20_000, 15)])
    g = np.random.default_rng(16).standard_normal((len(k), DIM)).astype(np.float32)
    t.push(k, g)
    ref.push(k, g)
    assert t._arena_u is arena and t._index is index, "a push copied the arena or index under the lock"
    assert t.stats()["rows_in_ram"] <= cap and len(t) == len(ref)
    np.testing.assert_array_equal(t.pull(k), ref.pull(k))
    t.close()
    ref.close()


def test_a_base_load_with_reads_of_the_old_shards_holds_one_budget(tmp_path):
    """During a base load the old shards keep no row in RAM (reads go to RocksDB without promoting) and
    the fresh shards share their budget, so reads on other threads during the load never make the table
    hold two budgets. A load that fails gives the old shards their RAM tier back."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from engine.ps.hosts import SparseHost
    budget_bytes = 112 * MiB
    cfg = TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros",
                      memory_bytes=budget_bytes, spill_path=str(tmp_path / "spill"))
    host = SparseHost("emb", cfg, server=0, num_servers=1, num_vshards=64, num_local=2,
                      pool=ThreadPoolExecutor(2))
    budget, old = host.budget, list(host.shards)
    keys = _keys(240_000, 5)
    grads = np.random.default_rng(6).standard_normal((len(keys), DIM)).astype(np.float32)
    host.push(keys, grads, None, None, delta=False)
    assert sum(s.stats()["rows_in_ram"] for s in old) > 0

    def held():
        """bytes the table holds by the budget's parts, old and fresh shards together"""
        parts = budget.parts()
        rows = sum(s.stats()["memory"]["rows"] for s in old + fresh)
        return rows + parts["index"] + parts["rocksdb"] + parts["growing"] + parts["reserve"]

    fresh = host.fresh_shards(len(keys))
    assert all(s.budget is budget for s in fresh), "the fresh shards take over the live shards' budget"
    seen, errors, stop = [], [], threading.Event()

    def reader():
        rng = np.random.default_rng(7)
        try:
            while not stop.is_set():
                pick = rng.choice(len(keys), 20_000, replace=False)
                np.testing.assert_array_equal(host.pull(keys[pick], False), -grads[pick])
                seen.append((sum(s.stats()["rows_in_ram"] for s in old), held()))
        except BaseException as e:      # noqa: BLE001 - reported by the main thread
            errors.append(e)

    r = threading.Thread(target=reader)
    r.start()
    for src, dst in zip(old, fresh):
        dst.load_rows(src.rows(chunk_rows=16_384))
    stop.set()
    r.join(60)
    assert not errors, errors
    assert len(seen) >= 1 and all(n == 0 for n, _ in seen), "an old shard promoted rows during the load"
    assert max(b for _, b in seen) <= budget_bytes and held() <= budget_bytes
    host.adopt(fresh)
    np.testing.assert_array_equal(host.pull(keys, False), -grads)
    # a load that fails: the live shards get their RAM tier back, sized by the budget (no regrowth)
    host.discard(host.fresh_shards(len(keys)))
    assert all(s._arena_u.shape[0] == budget.max_rows_per_shard for s in host.shards)
    np.testing.assert_array_equal(host.pull(keys, False), -grads)
    assert sum(s.stats()["rows_in_ram"] for s in host.shards) > 0
    assert budget.parts()["rows"] == sum(s.stats()["memory"]["rows"] for s in host.shards)
    host.close()


@pytest.mark.nojit
def test_a_released_shard_keeps_no_row_in_ram_until_restored_and_loses_no_update(tmp_path):
    rule = dict(dim=DIM, optimizer="adagrad", learning_rate=0.5, initializer="uniform", init_range=0.5)
    t = SparseTable(TableConfig(**rule, memory_rows=500, spill_path=str(tmp_path / "spill")))
    ref = SparseTable(TableConfig(**rule))
    rng = np.random.default_rng(1)
    keys = np.arange(1, 3001, dtype=np.uint64)

    def push(k):
        g = rng.standard_normal((len(k), DIM)).astype(np.float32)
        t.push(k, g)
        ref.push(k, g)

    push(keys)
    assert t.release_ram() > 0
    probe = np.concatenate([keys[::7], np.array([10**6, 10**6 + 1], np.uint64), keys[:50]])
    promotions = t.stats()["promotions"]
    np.testing.assert_array_equal(t.pull(probe, init_missing=True), ref.pull(probe, init_missing=True))
    push(np.concatenate([keys[::3], np.arange(5000, 5400, dtype=np.uint64)]))   # rows on disk and new ones
    t.load_rows(ref.rows())                                                     # a load while released
    st = t.stats()
    assert st["rows_in_ram"] == 0 and st["promotions"] - promotions == len(keys[::3])   # the push's only
    assert t._arena_u.shape[0] == 16 and len(t) == len(ref) == 3400
    all_keys = np.concatenate([keys, np.arange(5000, 5400, dtype=np.uint64)])
    np.testing.assert_array_equal(t.pull(all_keys), ref.pull(all_keys))
    t.restore_ram()
    np.testing.assert_array_equal(t.pull(all_keys), ref.pull(all_keys))
    assert 0 < t.stats()["rows_in_ram"] <= 500
    t.close()
    ref.close()


def test_a_bulk_load_raises_rocksdbs_write_stalls_and_restores_them(tmp_path):
    """``SparseTable.bulk_load`` (a base restore into fresh shards): RocksDB accepts the raised level-0
    triggers (a live SetOptions; a wrong option name would raise SpillError), the rows load bit-exact,
    and the triggers are back afterwards, also when the load fails."""
    src = SparseTable(TableConfig(dim=DIM, optimizer="adagrad"))
    k = _keys(150_000, 7)
    src.push(k, np.random.default_rng(8).standard_normal((len(k), DIM)).astype(np.float32))
    dst = SparseTable(TableConfig(dim=DIM, optimizer="adagrad", memory_rows=50_000, spill_path=str(tmp_path / "s")))
    with dst.bulk_load():
        assert dst._spill.bulk_loading and dst.stats()["rocksdb"]["catching_up"] == 1
        assert dst.load_rows(src.rows()) == len(k)
    assert not dst._spill.bulk_loading
    assert dst.stats()["rocksdb"]["catching_up"] == 0 and dst.stats()["rocksdb"]["catch_up_failed"] == 0
    a, b = _dump(src), _dump(dst)
    for c in ("key", "values", "state"):
        np.testing.assert_array_equal(a[c], b[c])
    with pytest.raises(RuntimeError, match="a part file failed"):
        with dst.bulk_load():
            assert dst._spill.bulk_loading
            raise RuntimeError("a part file failed")
    assert not dst._spill.bulk_loading
    with SparseTable(TableConfig(dim=DIM)).bulk_load() as t:      # RAM-only: nothing to raise
        assert t._spill is None


def test_the_write_stall_triggers_come_back_from_a_background_thread_once_level0_drains(tmp_path, monkeypatch):
    """After a bulk load that left level 0 at or over the slowdown trigger, ``bulk(False)`` returns at
    once and a background thread puts RocksDB's triggers back when level 0 drains (here: never below a
    trigger of 1 file, so at ``BULK_SETTLE_S``, 1 s); a new load or ``close`` takes the store out of
    that thread's queue (``_catch_up.CATCH_UP``)."""
    import time

    from sparse_tables import spill
    monkeypatch.setattr(spill, "L0_TRIGGERS", (4, 1, 36))
    monkeypatch.setattr(spill, "BULK_SETTLE_S", 1.0)
    st = spill.SpillStore(str(tmp_path / "s"), 4)
    keys = np.arange(1, 1001, dtype=np.uint64)
    st.bulk(True)
    st.put(keys, np.ones((len(keys), 4), np.uint32), np.ones(len(keys), bool), presorted=True)
    st._db.flush()                                   # one level-0 file: at the (patched) trigger
    assert st._level0_files() >= 1
    t0 = time.monotonic()
    st.bulk(False)
    assert st.bulk_loading and time.monotonic() - t0 < 0.5      # not waited for
    while st.bulk_loading and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert not st.bulk_loading and 0.9 <= time.monotonic() - t0 < 5
    st.bulk(True)
    st.bulk(False)                                   # level 0 still there: queued for its catch-up again
    assert st.bulk_loading and spill.CATCH_UP.queued(st)
    st.close()                                       # takes it out; the database closes after that
    assert not st.bulk_loading and not spill.CATCH_UP.queued(st)


IN_CGROUP = r"""
import os, sys
from concurrent.futures import ThreadPoolExecutor
with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
from sparse_tables import SparseTable, TableConfig, TableConfigError
from engine.ps.hosts import SparseHost
try:
    SparseHost("emb", TableConfig(dim=4, memory_bytes=int(sys.argv[2]), spill_path=sys.argv[3]), server=0,
               num_servers=1, num_vshards=64, num_local=2, pool=ThreadPoolExecutor(1))
except TableConfigError as e:
    print(e)
    sys.exit(2)
print("accepted")
"""


@pytest.fixture
def memory_cgroup(tmp_path):
    """A real cgroup v1 memory cgroup with a 256 MiB limit (removed afterwards, its processes gone)."""
    import os
    base = "/sys/fs/cgroup/memory"
    if not os.access(base, os.W_OK) or not os.path.isfile(os.path.join(base, "cgroup.procs")):
        pytest.skip("no writable cgroup v1 memory controller here (needs root)")
    path = os.path.join(base, f"engine-test-{os.getpid()}-{tmp_path.name}")
    os.mkdir(path)
    try:
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(256 * MiB))
        yield path
    finally:
        os.rmdir(path)


def test_a_budget_past_the_cgroup_memory_limit_is_a_config_error_naming_it(tmp_path, memory_cgroup):
    """A real process in a real memory cgroup (as a container's or a Kubernetes pod's): a budget past its
    limit was accepted (only physical memory was compared), and the server was OOM-killed as it grew."""
    import subprocess
    import sys
    run = [sys.executable, "-c", IN_CGROUP, memory_cgroup]
    over = subprocess.run(run + [str(384 * MiB), str(tmp_path / "a")], capture_output=True, text=True, timeout=120)
    limit_file = f"{memory_cgroup}/memory.limit_in_bytes"
    assert over.returncode == 2, over.stdout + over.stderr
    assert over.stdout.strip().startswith(f"tables.sparse.emb.memory_bytes={384 * MiB}: exceeds this process's "
                                          f"cgroup memory limit of {256 * MiB} bytes ({limit_file}: "), over.stdout
    assert not (tmp_path / "a").exists()
    under = subprocess.run(run + [str(128 * MiB), str(tmp_path / "b")], capture_output=True, text=True, timeout=120)
    assert under.returncode == 0 and under.stdout.strip() == "accepted", under.stdout + under.stderr
