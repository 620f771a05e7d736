"""``SparseTable.stats()`` never waits behind a writer (``sparse_tables.stats``), so ``/metrics`` and the
``Stats`` RPC answer during an expiry pass, a restore or any long exclusive section; and a server's table
counters survive a ``Load`` or a clear (no counter reset for Prometheus)."""
from __future__ import annotations

import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sparse_tables import SparseTable, TableConfig
from sparse_tables.rwlock import RWLock
from sparse_tables.stats import STATS_LOCK_WAIT_S

DIM = 4
PROMPT_S = 1.5        # a call that takes longer waited for the writer (it holds the lock for 30 s)


def _cfg(**kw) -> TableConfig:
    return TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros", **kw)


def _keys(n: int, start: int = 1) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.uint64)


@contextmanager
def held_exclusive(table: SparseTable):
    """Another thread holds ``table``'s exclusive lock (as an expiry pass does) until the block ends."""
    got, done = threading.Event(), threading.Event()

    def hold():
        with table._lock.exclusive():
            got.set()
            done.wait(30)

    th = threading.Thread(target=hold, daemon=True)
    th.start()
    assert got.wait(10)
    try:
        yield
    finally:
        done.set()
        th.join(10)


def prompt(fn, *args, limit_s: float = PROMPT_S):
    """fn(*args) run in a thread; its result when it returns within limit_s, else the test fails (the
    thread is left to finish once the lock is released)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            box["error"] = e

    th = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    th.start()
    th.join(limit_s)
    assert not th.is_alive(), f"{getattr(fn, '__name__', fn)} blocked behind the writer for {limit_s} s"
    if "error" in box:
        raise box["error"]
    return box["value"], time.monotonic() - t0


def test_try_shared_gives_up_on_a_writer_and_holds_otherwise():
    lock = RWLock()
    with lock.try_shared(0) as held:
        assert held and lock._readers == 1
    assert lock._readers == 0
    got, done = threading.Event(), threading.Event()

    def writer():
        with lock.exclusive():
            got.set()
            done.wait(10)

    th = threading.Thread(target=writer, daemon=True)
    th.start()
    assert got.wait(10)
    t0 = time.monotonic()
    with lock.try_shared(0.1) as held:
        assert not held
    assert 0.09 <= time.monotonic() - t0 < 1.0 and lock._readers == 0
    done.set()
    th.join(10)
    with lock.try_shared(0) as held, lock.try_shared(0) as held2:     # readers share
        assert held and held2 and lock._readers == 2
    with lock.exclusive():                                            # nothing leaked
        pass


def test_a_fresh_read_is_current_and_says_so():
    t = SparseTable(_cfg())
    st = t.stats()
    assert st["stale"] is False and st["stats_age_s"] == 0.0 and st["rows"] == 0
    t.push(_keys(100), np.ones((100, DIM), np.float32))
    st = t.stats()
    assert st["rows"] == st["rows_in_ram"] == 100 and st["push_keys"] == 100 and not st["stale"]
    t.close()


@pytest.mark.parametrize("spill", [False, True])
def test_stats_answer_while_a_writer_holds_the_shard(tmp_path, spill):
    kw = dict(memory_rows=2_000, spill_path=str(tmp_path / "spill"), num_threads=1) if spill else {}
    t = SparseTable(_cfg(**kw))
    t.push(_keys(500), np.ones((500, DIM), np.float32))
    assert t.stats()["rows"] == 500            # the last read with the lock: 500 rows
    t.push(_keys(300, 10_000), np.ones((300, DIM), np.float32))
    t.pull(_keys(50))
    with held_exclusive(t):
        time.sleep(0.1)
        st, took = prompt(t.stats)
        assert took < STATS_LOCK_WAIT_S + 1.0
        assert st["stale"] is True and st["stats_age_s"] >= 0.1
        # counters are live: the pushes and the pull since the last read are there
        assert st["push_keys"] == 800 and st["created"] == 800 and st["pull_keys"] == 50
        # sizes are those of the last read (one instant: they add up)
        assert st["rows"] == 500 and st["rows"] == st["rows_in_ram"] + st["rows_spilled"]
        assert st["memory"]["rows"] == 500 * st["row_bytes"] or spill
        assert ("rocksdb" in st) == spill and "disk_bytes" in st
        again, _ = prompt(t.stats)
        assert again["stats_age_s"] >= st["stats_age_s"]
    st = t.stats()                               # the writer is gone: current again
    assert st["stale"] is False and st["stats_age_s"] == 0.0 and st["rows"] == 800
    t.close()


def test_stats_do_not_queue_behind_a_waiting_writer():
    """A long pull holds the lock shared and a push waits for it: the lock is writer-preferring, so a
    reader arriving then would wait for both (minutes behind a long pass)."""
    t = SparseTable(_cfg())
    t.push(_keys(10), np.ones((10, DIM), np.float32))
    t.stats()
    got, done = threading.Event(), threading.Event()

    def reader():
        with t._lock.shared():
            got.set()
            done.wait(30)

    r = threading.Thread(target=reader, daemon=True)
    r.start()
    assert got.wait(10)
    w = threading.Thread(target=t.push, args=(_keys(5, 100), np.ones((5, DIM), np.float32)), daemon=True)
    w.start()
    deadline = time.monotonic() + 10
    while not t._lock._writers_waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        st, _ = prompt(t.stats)
        assert st["stale"] and st["rows"] == 10
    finally:
        done.set()
        r.join(10)
        w.join(10)
    assert t.stats()["rows"] == 15
    t.close()


def _host(cfg, num_local=2):
    from engine.ps.hosts import SparseHost
    return SparseHost("emb", cfg, server=0, num_servers=1, num_vshards=8, num_local=num_local,
                      pool=ThreadPoolExecutor(2))


def test_host_stats_say_which_shards_are_stale():
    host = _host(_cfg())
    keys = _keys(1000)
    host.push(keys, np.ones((len(keys), DIM), np.float32), None, None, delta=False)
    before = host.stats()
    assert before["stale_shards"] == 0 and before["stats_age_s"] == 0.0 and before["rows"] == 1000
    with held_exclusive(host.shards[1]):
        time.sleep(0.05)
        st, _ = prompt(host.stats)
        assert st["stale_shards"] == 1 and st["stats_age_s"] >= 0.05
        assert st["rows"] == 1000 and st["push_keys"] == 1000 and "stale" not in st
    host.close()


@pytest.fixture
def metrics_server(tmp_path):
    """A PS server with its Prometheus endpoint and a checkpoint root; yields (endpoint, core, metrics
    URL, checkpoint root)."""
    from engine.observability.prometheus import RoleMetrics
    from engine.ps import PSServer, serve
    from engine.ps.grpc_service import method_paths
    root = str(tmp_path / "ckpt")
    m = RoleMetrics("server", 0)
    core = PSServer({"emb": TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0)}, local_shards=2,
                    checkpoint_root=root)
    m.watch_server(core)
    srv, port = serve(core, "127.0.0.1", 0, threads=4, interceptors=[m.interceptor(method_paths())])
    m.serve("127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{port}", core, m.url, root
    finally:
        m.close()
        srv.stop(0).wait()
        core.close()


def _scrape(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_scrape_and_stats_rpc_answer_during_a_long_exclusive_section(metrics_server):
    from engine.ps import PSClient
    ep, core, url, _ = metrics_server
    keys = _keys(300)
    with PSClient([ep], timeout_s=10, retries=0) as c:
        c.push("emb", keys, np.ones((300, DIM), np.float32))
        c.pull("emb", keys)
    assert _scrape(url)[("engine_ps_table_stats_age_seconds", (("table", "emb"),))] == 0.0
    with held_exclusive(core.sparse["emb"].shards[0]):
        time.sleep(0.05)
        got = _scrape(url, timeout=3)
        assert got[("engine_ps_pull_keys_total", (("table", "emb"),))] == 300
        assert got[("engine_ps_rows", (("table", "emb"), ("tier", "ram")))] == 300
        assert got[("engine_ps_table_stats_age_seconds", (("table", "emb"),))] > 0     # the sizes are stale
        with PSClient([ep], timeout_s=2, retries=0) as c:
            table = c.stats()[0]["sparse"]["emb"]
        assert table["rows"] == 300 and table["stale_shards"] == 1 and table["pull_keys"] == 300


def test_load_keeps_the_table_counters_of_a_live_server(metrics_server):
    """Load swaps in new shards: counters go on from the old ones' (no reset), gauges are the new ones'."""
    from engine.checkpoint import CheckpointManager
    from engine.ps import PSClient
    ep, core, url, root = metrics_server
    keys = _keys(300)
    with PSClient([ep], timeout_s=10, retries=0) as c:
        c.push("emb", keys, np.ones((300, DIM), np.float32))
        mgr = CheckpointManager(root, "job")
        base = mgr.save(c, "base", when=0.0)
        for _ in range(5):
            c.pull("emb", keys)
        c.push("emb", _keys(200, 1000), np.ones((200, DIM), np.float32))   # not in the base
        before = _scrape(url)
        c.load(mgr.uri_of(base["name"]))
        after = _scrape(url)
    counters = [k for k in before if k[0].startswith(("engine_ps_", )) and k[0].endswith("_total")
                and not k[0].startswith(("engine_ps_rpc", "engine_ps_checkpoint", "engine_ps_requests"))
                and dict(k[1]).get("table") == "emb"]
    assert len(counters) >= 10
    for k in counters:
        assert after[k] >= before[k], f"{k}: {before[k]} -> {after[k]} (a counter reset)"
    lbl = (("table", "emb"),)
    assert before[("engine_ps_pull_keys_total", lbl)] == after[("engine_ps_pull_keys_total", lbl)] == 1500
    assert after[("engine_ps_push_keys_total", lbl)] == 500
    assert after[("engine_ps_rows_created_total", lbl)] == 500
    calls = [k for k in before if k[0] == "engine_ps_table_call_seconds_total" and before[k] > 0]
    assert calls and all(after[k] >= before[k] for k in calls)
    # gauges are the loaded shards': the base's 300 rows, not 500
    assert before[("engine_ps_rows", lbl + (("tier", "ram"),))] == 500
    assert after[("engine_ps_rows", lbl + (("tier", "ram"),))] == 300
    assert core.sparse["emb"].stats()["rows"] == 300


def test_clear_keeps_counters_and_empties_the_table():
    host = _host(_cfg())
    keys = _keys(400)
    host.push(keys, np.ones((len(keys), DIM), np.float32), None, None, delta=False)
    host.pull(keys, False)
    before = host.stats()
    host.clear()
    st = host.stats()
    assert st["rows"] == 0 and st["memory"]["rows"] == 0
    for k in ("pull_keys", "push_keys", "created", "push_locked_ns"):
        assert st[k] == before[k] > 0
    host.clear()                                  # carried again: chained through every swap
    assert host.stats()["pull_keys"] == before["pull_keys"]
    host.close()


def test_a_spilled_tables_rocksdb_counters_survive_a_base_swap(tmp_path):
    host = _host(_cfg(memory_rows=1_000, spill_path=str(tmp_path / "spill"), num_threads=1))
    keys = _keys(6_000)
    host.push(keys, np.ones((len(keys), DIM), np.float32), None, None, delta=False)
    host.pull(keys, False)
    fresh = host.fresh_shards(0)
    before = host.stats()
    assert before["rocksdb"]["point_reads"] > 0 and before["evictions"] > 0
    host.adopt(fresh)
    st = host.stats()
    assert st["rows"] == 0 and st["rows_spilled"] == 0
    for k in ("evictions", "spill_writes", "promotions", "pull_keys", "evict_ns"):
        assert st[k] == before[k]
    assert st["rocksdb"]["point_reads"] == before["rocksdb"]["point_reads"]
    assert st["rocksdb"]["write_stalls"] == before["rocksdb"]["write_stalls"]
    host.close()
