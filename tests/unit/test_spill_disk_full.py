"""A spill disk that runs out of space, on real RocksDB stores over a small tmpfs (``tests/tmpfs.py``):
RocksDB stops writing for good once a flush fails (its background error), and reports that error again
when it closes. The store says so at once (``SpillFailedError``, ``failed``; no wait for a write stall
that never ends) and refuses every later write; closing it still removes its directory and lets go of
its lock, so a base load that runs out of disk leaves the live table as it was and a later load works.
A server with such a shard is neither ready nor live (Health), refuses every request touching it with
one UNAVAILABLE naming the shard and the store, writes no checkpoint of it, and a base load replaces
it."""
from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest

from engine.checkpoint import CheckpointManager
from engine.errors import RemoteError
from engine.ps import InProcessTransport, PSClient, PSServer
from sparse_tables import TableConfig
from sparse_tables.budget import MemoryBudget
from sparse_tables.errors import SpillError, SpillFailedError
from sparse_tables.spill import SpillStore
from tests.tmpfs import leave_free, open_files_under

DIM = 4
STRIDE = 12
BUDGET = 60 << 20           # the least memory_bytes of a dim-4 SGD table: 4 MiB memtables, ~170k RAM rows


def _records_of(keys: np.ndarray, stride: int = STRIDE) -> np.ndarray:
    """Records of random words (lz4 cannot shrink them) that hold their keys, as a table's do."""
    recs = np.random.default_rng(int(keys[0])).integers(0, 1 << 32, (len(keys), stride), dtype=np.uint64)
    recs = recs.astype(np.uint32)
    recs[:, :2] = keys.astype(np.uint64).view(np.uint32).reshape(-1, 2)
    return recs


def _fill(store: SpillStore, limit_rows: int = 2_000_000) -> int:
    """Put rows into ``store`` until RocksDB refuses (SpillError, raised); returns rows written."""
    n = 0
    while n < limit_rows:
        keys = np.arange(n + 1, n + 8_193, dtype=np.uint64)
        store.put(keys, _records_of(keys), np.ones(len(keys), bool))
        n += len(keys)
    raise AssertionError(f"{limit_rows} rows written and the disk is not full")


def test_a_store_stopped_by_a_full_disk_fails_at_once_for_good_and_closes_cleanly(tmpfs):
    disk = tmpfs("spill", 2 << 20)
    st = SpillStore(str(disk / "s"), stride=STRIDE, budget=MemoryBudget(300 << 20, 1, 4 * STRIDE))
    t0 = time.monotonic()
    # RocksDB answers a write after its background error with the error, or with "Write stall" and
    # writes stopped for good (which the store waited out for STALL_TIMEOUT_S, 300 s, before)
    with pytest.raises(SpillFailedError, match=r"rocksdb stopped writing for good: IO error: No space left") as ei:
        _fill(st)
    assert time.monotonic() - t0 < 60
    assert ei.value.path == str(disk / "s") and "No space left on device" in ei.value.cause
    assert st.failed is not None and str(disk / "s" / "rocksdb") in st.failed
    written = np.arange(1, 1_001, dtype=np.uint64)      # of the first batch, put before the failure
    free = os.statvfs(disk)
    assert free.f_bavail * free.f_frsize > 1 << 20      # RocksDB dropped its half-written file: room again,
    keys = np.arange(10**7, 10**7 + 10, dtype=np.uint64)
    with pytest.raises(SpillFailedError, match="writing 10 rows failed"):     # and still no write
        st.put(keys, _records_of(keys), np.ones(10, bool))
    pos, recs = st.get(written[:1000])
    assert len(pos) == 1000 and np.array_equal(recs, _records_of(written[:1000]))
    st.close()                          # RocksDB's close reports the error again: logged, not raised
    assert not (disk / "s").exists() and open_files_under(disk) == []
    again = SpillStore(str(disk / "s"), stride=STRIDE)      # the path is free for the next store
    again.close()


def _server(spill_path: str | None) -> tuple[PSServer, PSClient]:
    cfg = TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros", num_threads=1,
                      memory_bytes=BUDGET if spill_path else 0, spill_path=spill_path)
    server = PSServer({"emb": cfg}, {}, index=0, num_servers=1, num_vshards=64, local_shards=1)
    return server, PSClient(InProcessTransport([server]), retries=0)


def test_a_base_load_that_runs_out_of_spill_disk_changes_nothing_and_a_later_load_works(tmp_path, tmpfs):
    disk = tmpfs("spill", 16 << 20)
    rng = np.random.default_rng(0)
    # a base with more rows than the RAM tier holds, saved by a RAM-only server: its load writes to disk
    big_keys = np.arange(1, 400_001, dtype=np.uint64)
    ram, ram_client = _server(None)
    ram_client.push("emb", big_keys, rng.standard_normal((len(big_keys), DIM), dtype=np.float32))
    big = CheckpointManager(str(tmp_path / "big"), "job")
    big.save(ram_client, "base", when=0.0, step=1)
    ram.close()
    # the live server: a few rows, a base of them, then more training
    server, client = _server(str(disk / "spill"))
    keys = np.arange(10**7, 10**7 + 2_000, dtype=np.uint64)
    client.push("emb", keys, rng.standard_normal((len(keys), DIM), dtype=np.float32))
    small = CheckpointManager(str(tmp_path / "small"), "job")
    small.save(client, "base", when=0.0, step=1)
    at_base = client.pull("emb", keys)
    client.push("emb", keys[:500], np.ones((500, DIM), np.float32))
    live = client.pull("emb", keys)
    try:
        filler = leave_free(disk, 256 << 10)
        with pytest.raises(RemoteError, match=r"spill store at \S+/emb-server0-shard0\.1/rocksdb stopped writing "
                                              r"for good: IO error: No space left on device.*the load was undone") as ei:
            big.restore(client)
        assert ei.value.code == "UNAVAILABLE" and client.health()[0]["ready"]     # the live shards are fine
        shard = server.sparse["emb"].shards[0]
        assert sorted(os.listdir(disk / "spill")) == ["emb-server0-shard0"]       # the new shard's directory went
        assert open_files_under(disk / "spill" / "emb-server0-shard0.1") == []    # and its lock
        np.testing.assert_array_equal(client.pull("emb", keys), live)             # the live table as it was
        assert shard.stats()["rows_in_ram"] == len(keys)                          # its rows back in RAM
        filler.unlink()
        assert small.restore(client)["name"] == "19700101/0000-base"              # a later load works
        np.testing.assert_array_equal(client.pull("emb", keys), at_base)
        assert sorted(os.listdir(disk / "spill")) == ["emb-server0-shard0.1"]
    finally:
        server.close()
    assert open_files_under(disk) == []


def test_a_server_whose_spill_store_failed_refuses_its_requests_is_not_live_and_a_base_load_replaces_it(
        tmp_path, tmpfs, caplog):
    disk = tmpfs("spill", 16 << 20)
    server, client = _server(str(disk / "spill"))
    rng = np.random.default_rng(1)
    keys = np.arange(1, 2_001, dtype=np.uint64)
    client.push("emb", keys, rng.standard_normal((len(keys), DIM), dtype=np.float32))
    mgr = CheckpointManager(str(tmp_path / "ckpt"), "job")
    mgr.save(client, "base", when=0.0, step=1)
    at_base = client.pull("emb", keys)
    path = disk / "spill" / "emb-server0-shard0"
    try:
        filler = leave_free(disk, 256 << 10)
        caplog.set_level(logging.INFO)
        with pytest.raises(RemoteError) as ei:         # pushes of new keys until the write-back fails
            for i in range(1, 40):
                new = np.arange(i * 10**6, i * 10**6 + 50_000, dtype=np.uint64)
                client.push("emb", new, np.ones((len(new), DIM), np.float32))
        met = str(ei.value)
        assert ei.value.code == "UNAVAILABLE" and "shard 0" in met and str(path) in met, met
        assert "stopped writing for good: IO error: No space left on device" in met and "met the failure" in met
        health = client.health()[0]
        assert not health["ready"] and not health["live"] and health["stuck"] is None
        assert client.stats()[0]["sparse"]["emb"]["rocksdb"]["failed"] == 1
        assert health["failed"].startswith(f"table 'emb' shard 0: RocksDB spill store at {path}/rocksdb stopped "
                                           f"writing for good: IO error: No space left on device")
        filler.unlink()                                # room again: the store stays failed
        for call in (lambda: client.push("emb", keys[:10], np.ones((10, DIM), np.float32)),
                     lambda: client.pull("emb", keys[:10]),
                     lambda: client.shrink("emb")):
            with pytest.raises(RemoteError, match=r"shard 0, .*shard 0 of table 'emb' is out of service: .*"
                                                  r"the request was refused, nothing applied") as ei:
                call()
            assert ei.value.code == "UNAVAILABLE"
        with pytest.raises(RemoteError, match="out of service") as ei:      # no checkpoint of this state
            mgr.save(client, "base", when=3600.0, step=2)
        assert ei.value.code == "UNAVAILABLE" and mgr.latest().name == "19700101/0000-base"
        server_logs = [r for r in caplog.records if r.name.startswith("engine.ps")]
        assert not [r for r in server_logs if r.exc_info], "a refused request logged a traceback"
        failures = [r for r in caplog.records if "stopped writing for good" in r.getMessage()]
        assert len(failures) == 1 and failures[0].levelno == logging.ERROR          # said once
        # the roll-back: a base load replaces the failed shard (nothing is written into its store)
        assert mgr.restore(client)["name"] == "19700101/0000-base"
        health = client.health()[0]
        assert health["ready"] and health["live"] and health["failed"] is None
        np.testing.assert_array_equal(client.pull("emb", keys), at_base)
        client.push("emb", keys[:10], np.ones((10, DIM), np.float32))
        assert sorted(os.listdir(disk / "spill")) == ["emb-server0-shard0.1"]
        assert client.stats()[0]["sparse"]["emb"]["rocksdb"]["failed"] == 0
    finally:
        server.close()
    assert open_files_under(disk) == []
