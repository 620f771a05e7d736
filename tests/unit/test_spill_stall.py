"""RocksDB write stalls are waited out with the GIL released (``SpillStore._write``).

Each test drives a real RocksDB into a stall: level-0 compaction is put off (trigger 100) and the
slowdown / stop triggers are lowered to 2 / 3 files, so flushing memtables by hand slows writes (2 files)
or stops them (3 files) until the triggers go back up. A ticker thread measures the longest time it could
not run: before the change, rocksdict's write held the GIL through the stall, so a stopped write froze
every thread, the one that would lift the stop included.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from sparse_tables import spill
from sparse_tables.errors import SpillError
from sparse_tables.spill import SpillStore
from tests.faults import FailingWrites

STRIDE = 24


@pytest.fixture(autouse=True)
def _watchdog():
    """A stall that held the GIL would hang this process where no Python code can run: faulthandler's C
    watchdog thread dumps every thread's stack and ends the process after 60 s instead."""
    import faulthandler
    faulthandler.dump_traceback_later(60, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _records_of(keys: np.ndarray) -> np.ndarray:
    recs = np.random.default_rng(0).integers(0, 1 << 32, (len(keys), STRIDE), dtype=np.uint64).astype(np.uint32)
    recs[:, :2] = keys.astype(np.uint64).view(np.uint32).reshape(-1, 2)
    return recs


def _stalled_store(tmp_path, level0_files: int) -> SpillStore:
    """A store whose level 0 holds ``level0_files`` files, with slowdown / stop at 2 / 3 files."""
    st = SpillStore(str(tmp_path / "spill"), stride=STRIDE)
    st._db.set_options({"level0_file_num_compaction_trigger": "100", "level0_slowdown_writes_trigger": "2",
                        "level0_stop_writes_trigger": "3"})
    for i in range(level0_files):
        keys = np.arange(1, 101, dtype=np.uint64) + np.uint64(1_000_000 * (i + 1))
        st.put(keys, _records_of(keys), np.ones(100, bool))
        st._db.flush()
    assert st.compaction()["level0_files"] == level0_files
    return st


class Ticker:
    """A thread that sleeps 1 ms at a time and records the longest gap between its wake-ups (seconds)."""

    def __init__(self):
        self.gap, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        time.sleep(0.05)

    def _run(self):
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            self.gap, last = max(self.gap, now - last), now

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.gap


def test_a_stopped_write_waits_without_the_gil_and_completes_when_the_stop_lifts(tmp_path):
    st = _stalled_store(tmp_path, 3)
    try:
        assert st.compaction()["write_stopped"] == 1
        keys = np.arange(1, 5_001, dtype=np.uint64)
        records = _records_of(keys)
        entered, done, errors = threading.Event(), threading.Event(), []

        def writer():
            try:
                entered.set()
                st.put(keys, records, np.ones(len(keys), bool))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
            done.set()

        ticker = Ticker()
        t = threading.Thread(target=writer)
        t.start()
        assert entered.wait(10.0)       # the stall is timed from here (a loaded machine starts threads late)
        time.sleep(0.6)
        assert not done.is_set(), "the write went through a stop"
        # this thread needs the GIL to lift the stop: with the GIL held by the stalled write it would hang
        st._db.set_options({"level0_slowdown_writes_trigger": "20", "level0_stop_writes_trigger": "36"})
        assert done.wait(10.0)
        t.join()
        gap = ticker.stop()
        assert errors == []
        # a write holding the GIL through the stop would hang this test (nobody could lift the stop); one
        # holding it in stretches would freeze the ticker for them; a loaded machine alone can delay a
        # thread's wake-up by a good part of 0.25 s
        assert gap < 0.45, f"another thread was frozen for {gap:.3f} s during the stall"
        pos, recs = st.get(keys)
        assert len(pos) == len(keys) and np.array_equal(recs, _records_of(keys)[pos])
        assert st.count == 300 + len(keys) and st.stalls == 1 and st.stall_s >= 0.5
    finally:
        st.close()


def test_a_stall_longer_than_the_limit_fails_the_write_naming_the_store_and_writes_nothing_of_it(tmp_path):
    st = _stalled_store(tmp_path, 3)
    try:
        st.stall_timeout_s = 0.3
        keys = np.arange(1, 2_001, dtype=np.uint64)
        t0 = time.monotonic()
        with pytest.raises(SpillError, match=r"writes stalled for .* 3 level-0 files.*stopped=True.*2000 rows"):
            st.put(keys, _records_of(keys), np.ones(len(keys), bool))
        assert time.monotonic() - t0 < 5.0
        assert st.count == 300
        pos, _ = st.get(keys)
        assert len(pos) == 0
        assert str(st.path) in str(_raised(st, keys))
    finally:
        st.close()


def _raised(st: SpillStore, keys: np.ndarray) -> Exception:
    try:
        st.put(keys, _records_of(keys), np.ones(len(keys), bool))
    except SpillError as e:
        return e
    raise AssertionError("the stalled write did not fail")


def test_a_failed_write_is_a_spill_error_naming_the_store(tmp_path):
    st = SpillStore(str(tmp_path / "spill"), stride=STRIDE)
    real = st._db
    st._db = FailingWrites(real, 0, "IO error: No space left on device (injected)")
    try:
        keys = np.arange(1, 11, dtype=np.uint64)
        with pytest.raises(SpillError, match=r"spill.*writing 10 rows failed: IO error: No space left"):
            st.put(keys, _records_of(keys), np.ones(10, bool))
        with pytest.raises(SpillError, match=r"writing 3 deletes failed"):
            st.delete(keys[:3])
    finally:
        st._db = real
        st.close()


def test_a_batch_whose_delay_is_longer_than_a_nap_still_goes_through_under_a_slowdown(tmp_path, monkeypatch):
    """Under a slowdown RocksDB charges a write the delay of the previous write's size at its delayed
    rate, reserves that delay when it refuses the write, and credits only the time after it. A retry
    that came back after one 0.1 s nap, before twice the delay, was refused again and pushed the debt
    further: a batch whose delay passed 0.1 s never went through while the slowdown lasted."""
    rows = 10_000                       # 1 MB a batch: 0.5 s of delay at 2 MB/s
    monkeypatch.setattr(spill, "WRITE_BATCH_ROWS", rows)
    # RocksDB's delayed write rate starts at the rate limiter's (256 MiB/s in production, which Python's
    # batches never outrun); it falls as compaction falls behind (9.5 MB/s at the end of a 100M-key run)
    # (2 MB/s here: a delay long enough that a frozen thread stands well clear of a loaded machine's
    # scheduling gaps)
    monkeypatch.setattr(spill, "RATE_LIMIT_BYTES_PER_S", 2 << 20)
    st = _stalled_store(tmp_path, 2)
    try:
        st.stall_timeout_s = 10.0
        rate = st.compaction()["delayed_write_rate"]
        assert rate == 2 << 20 and rows * (8 + 4 * STRIDE) / rate > 0.45
        keys = np.arange(1, 3 * rows + 1, dtype=np.uint64)
        ticker = Ticker()
        t0 = time.monotonic()
        st.put(keys, _records_of(keys), np.ones(len(keys), bool))   # each batch pays for the one before
        took, gap = time.monotonic() - t0, ticker.stop()
        # RocksDB's own wait (0.5 s a batch here) held the GIL: the delays are now slept with it released
        # (a thread frozen through one shows a gap of 0.5 s; a loaded machine's own gaps stay under 0.4)
        assert gap < 0.4, f"another thread was frozen for {gap:.3f} s during the slowdown"
        assert took < 10.0 and st.stalls >= 1
        assert 0.5 <= st.stall_s <= took     # the pacing before each later batch counts too
        pos, recs = st.get(keys[::997])
        assert len(pos) == len(keys[::997]) and np.array_equal(recs, _records_of(keys)[::997][pos])
        assert st.count == 200 + len(keys)
    finally:
        st.close()


def test_an_eviction_whose_write_fails_midway_marks_the_rows_it_wrote_as_on_disk(tmp_path, monkeypatch):
    """The batches before a failed one are on disk while their rows stay in RAM: those rows must say so,
    or deleting one would leave its disk copy to come back on the next read."""
    from sparse_tables import SparseTable, TableConfig
    monkeypatch.setattr(spill, "WRITE_BATCH_ROWS", 100)
    t = SparseTable(TableConfig(dim=4, memory_rows=1_000, spill_path=str(tmp_path / "spill"), num_threads=1))
    real = t._spill._db
    try:
        t.push(np.arange(1, 1_001, dtype=np.uint64), np.ones((1_000, 4), np.float32))
        t._spill._db = FailingWrites(real, 2, "IO error: write refused (injected)")
        with pytest.raises(SpillError, match="injected") as info:
            t.push(np.arange(10_001, 10_601, dtype=np.uint64), np.ones((600, 4), np.float32))
        t._spill._db = real
        written = info.value.written
        assert len(written) == 100 and len(t._spill.get(written)[0]) == 100
        t.delete(written)
        assert len(t._spill.get(written)[0]) == 0, "deleted rows kept their disk copies"
        assert not t.contains(written).any()
        before = t.stats()["rows"]
        t.push(np.arange(20_001, 22_001, dtype=np.uint64), np.ones((2_000, 4), np.float32))   # evicts again
        assert t.stats()["rows"] == before + 2_000          # counted once, though written twice
    finally:
        t._spill._db = real
        t.close()


def test_a_store_whose_catch_up_rocksdb_refuses_says_so_and_the_next_store_still_catches_up(
        tmp_path, monkeypatch, caplog):
    """RocksDB refuses to turn a store's compaction back on when its turn comes: the store keeps the
    error (``catch_up_error``, logged once at error level, naming the store) and stays bulk loading; the
    queue goes on, and the store after it catches up."""
    import logging

    from sparse_tables._catch_up import CatchUpQueue
    monkeypatch.setattr(spill, "L0_TRIGGERS", (4, 6, 36))
    monkeypatch.setattr(spill, "CATCH_UP", CatchUpQueue(poll_s=0.1))
    rng = np.random.default_rng(2)
    bad, good = (SpillStore(str(tmp_path / n), STRIDE) for n in ("bad", "good"))
    try:
        for st in (bad, good):
            st.bulk(True)
            for _ in range(8):
                keys = np.unique(rng.integers(1, 2**63, 1000, dtype=np.uint64))
                st.put(keys, np.ones((len(keys), STRIDE), np.uint32), np.ones(len(keys), bool))
                st._db.flush()

        def refuse(options):
            raise SpillError(f"RocksDB spill store at {bad._dir.db_path}: set_options: IO error (injected)")
        monkeypatch.setattr(bad, "_set_options", refuse)
        with caplog.at_level(logging.ERROR, logger="sparse_tables.spill"):
            bad.bulk(False)
            good.bulk(False)
            deadline = time.monotonic() + 20
            while good.bulk_loading and time.monotonic() < deadline:
                time.sleep(0.05)
        assert not good.bulk_loading and good._level0_files() < 6 and good.catch_up_error is None
        assert bad.bulk_loading and bad._level0_files() == 8
        assert "IO error (injected)" in bad.catch_up_error and str(bad._dir.db_path) in bad.catch_up_error
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [bad.catch_up_error]
    finally:
        for st in (bad, good):
            st.close()


def test_a_bulk_load_puts_compaction_off_and_its_end_lets_level0_drain_before_the_stall_triggers_return(
        tmp_path, monkeypatch):
    """``bulk(True)`` turns auto compaction off (8 flushed files stay in level 0); ``bulk(False)`` hands the
    store to the catch-up thread (``_catch_up``), which turns compaction on, so level 0 drains, and puts
    the stall triggers back once it is under the (patched) slowdown trigger."""
    monkeypatch.setattr(spill, "L0_TRIGGERS", (4, 6, 36))
    rng = np.random.default_rng(0)
    st = SpillStore(str(tmp_path / "s"), STRIDE)
    try:
        st.bulk(True)
        for _ in range(8):                    # overlapping random keys: each file spans the key range
            keys = np.unique(rng.integers(1, 2**63, 2000, dtype=np.uint64))
            st.put(keys, np.ones((len(keys), STRIDE), np.uint32), np.ones(len(keys), bool))
            st._db.flush()
        time.sleep(0.5)
        assert st._level0_files() == 8        # over the compaction trigger (4): compaction is off
        st.bulk(False)
        assert st.bulk_loading                # 8 files >= the slowdown trigger: caught up later
        deadline = time.monotonic() + 20
        while (st.bulk_loading or st._level0_files() >= 4) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert st._level0_files() < 4 and not st.bulk_loading
        assert st.count == sum(1 for _ in st._db.keys())      # nothing lost in the compaction
    finally:
        st.close()


def test_stores_whose_bulk_loads_end_together_catch_up_one_at_a_time(tmp_path, monkeypatch):
    """Three stores end their loads with level 0 over the slowdown trigger (a base restore into a
    server's shards). Their catch-up compactions run one at a time, in the order the loads ended: while
    the first merges, the others keep compaction off and their level-0 files; each catches up (level 0
    under the slowdown trigger, stall triggers back) and nothing is lost. Closing a store that waits
    its turn takes it out of the queue, and the one after it still catches up."""
    from sparse_tables._catch_up import CatchUpQueue
    monkeypatch.setattr(spill, "L0_TRIGGERS", (4, 6, 36))
    # this test's own queue and thread; polled every 2 s, not 0.5: the first store's turn is seen from
    # here before its first poll can end it, on a loaded machine too
    monkeypatch.setattr(spill, "CATCH_UP", CatchUpQueue(poll_s=2.0))
    rng = np.random.default_rng(1)
    stores = [SpillStore(str(tmp_path / f"s{i}"), STRIDE) for i in range(4)]
    try:
        for st in stores:
            st.bulk(True)
            for _ in range(8):                # overlapping random keys: each file spans the key range
                keys = np.unique(rng.integers(1, 2**63, 3000, dtype=np.uint64))
                st.put(keys, np.ones((len(keys), STRIDE), np.uint32), np.ones(len(keys), bool))
                st._db.flush()
        for st in stores:
            st.bulk(False)
        t0 = time.monotonic()                 # the first one's turn begins (its first poll after poll_s)
        while spill.CATCH_UP._current is not stores[0] and time.monotonic() - t0 < 5:
            time.sleep(0.001)
        assert spill.CATCH_UP._current is stores[0] and list(spill.CATCH_UP._waiting) == stores[1:]
        assert all(st.bulk_loading for st in stores)
        stores[2].close()                     # waiting its turn: out of the queue, closed at once
        assert not spill.CATCH_UP.queued(stores[2])
        live = [stores[0], stores[1], stores[3]]
        order, deadline = [], time.monotonic() + 30
        while len(order) < len(live) and time.monotonic() < deadline:
            with spill.CATCH_UP._lock:        # the queue's thread turns compaction on and settles under it
                merging = [st for st in live if not st._compaction_deferred and st.bulk_loading]
                assert len(merging) <= 1, [str(st) for st in merging]     # never two at once
                order += [st for st in live if not st._compaction_deferred and not st.bulk_loading
                          and st not in order]
                # the ones waiting their turn keep compaction off and their level-0 files
                assert all(st._level0_files() == 8 for st in live if st._compaction_deferred)
            time.sleep(0.02)
        assert order == live
        assert not spill.CATCH_UP.queued(live[-1]) and spill.CATCH_UP._thread is None
        for st in live:
            assert st._level0_files() < spill.L0_TRIGGERS[1]
            assert st.count == sum(1 for _ in st._db.keys())     # nothing lost in the compactions
    finally:
        for st in stores:
            if st._db is not None:
                st.close()


def test_a_bulk_load_that_piles_up_level0_turns_compaction_back_on(tmp_path, monkeypatch, caplog):
    """Compaction is off during a bulk load, and RocksDB then applies no level-0 stall: nothing would
    bound level 0 (each file's filter pinned in the block cache) in a load big enough. The write that
    leaves as many level-0 files as the raised slowdown trigger turns compaction back on and says so;
    level 0 then drains while the load goes on."""
    import logging
    monkeypatch.setattr(spill, "L0_TRIGGERS_BULK", (2, 3, 800))
    rng = np.random.default_rng(1)
    st = SpillStore(str(tmp_path / "s"), STRIDE)
    try:
        st.bulk(True)
        with caplog.at_level(logging.WARNING, logger="sparse_tables.spill"):
            for _ in range(2):
                keys = np.unique(rng.integers(1, 2**63, 2000, dtype=np.uint64))
                st.put(keys, np.ones((len(keys), STRIDE), np.uint32), np.ones(len(keys), bool))
                st._db.flush()
            assert st._level0_files() == 2 and st._compaction_deferred
            keys = np.unique(rng.integers(1, 2**63, 2000, dtype=np.uint64))
            st.put(keys, np.ones((len(keys), STRIDE), np.uint32), np.ones(len(keys), bool))
            st._db.flush()                        # the third file: the next write sees it
            st.put(keys[:10], np.ones((10, STRIDE), np.uint32), np.zeros(10, bool))
        assert not st._compaction_deferred
        assert any("compaction resumes" in r.getMessage() for r in caplog.records)
        deadline = time.monotonic() + 20
        while st._level0_files() >= 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert st._level0_files() < 3            # merged while the load still holds the stall triggers up
        assert st.bulk_loading
        st.bulk(False)
        assert st.count == sum(1 for _ in st._db.keys())
    finally:
        st.close()
