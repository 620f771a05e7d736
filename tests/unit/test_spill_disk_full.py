"""A spill disk that runs out of space, on real RocksDB stores over a small tmpfs (``tests/tmpfs.py``):
RocksDB stops writing for good once a flush fails (its background error), and reports that error again
when it closes. Closing such a store still removes its directory and lets go of its lock, so a base
load that runs out of disk leaves the live table as it was and a later load works."""
from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint import CheckpointManager
from engine.errors import RemoteError
from engine.ps import InProcessTransport, PSClient, PSServer
from sparse_tables import TableConfig
from sparse_tables.budget import MemoryBudget
from sparse_tables.errors import SpillError
from sparse_tables.spill import SpillStore
from tests.tmpfs import open_files_under

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


def _leave_free(disk: Path, nbytes: int) -> Path:
    """A file that takes the free space of ``disk`` but ``nbytes``."""
    st = os.statvfs(disk)
    path = disk / "filler"
    with open(path, "wb") as f:
        f.write(bytes(max(0, st.f_bavail * st.f_frsize - nbytes)))
    return path


def test_a_store_stopped_by_a_full_disk_closes_and_lets_go_of_its_directory(tmpfs):
    disk = tmpfs("spill", 2 << 20)
    st = SpillStore(str(disk / "s"), stride=STRIDE, budget=MemoryBudget(300 << 20, 1, 4 * STRIDE))
    st.stall_timeout_s = 5.0      # a write may meet writes stopped for good (the background error) instead
    with pytest.raises(SpillError, match="No space left on device|writes stalled"):
        _fill(st)
    st.close()                          # RocksDB's close reports the error again: logged, not raised
    assert not (disk / "s").exists() and open_files_under(disk) == []
    again = SpillStore(str(disk / "s"), stride=STRIDE)      # the path is free for the next store
    again.close()


def _server(spill_path: str | None) -> tuple[PSServer, PSClient]:
    cfg = TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros", num_threads=1,
                      memory_bytes=BUDGET if spill_path else 0, spill_path=spill_path)
    server = PSServer({"emb": cfg}, {}, index=0, num_servers=1, num_vshards=64, local_shards=1)
    return server, PSClient(InProcessTransport([server]), retries=0)


def test_a_base_load_that_runs_out_of_spill_disk_changes_nothing_and_a_later_load_works(tmp_path, tmpfs,
                                                                                       monkeypatch):
    # RocksDB may answer the writes after its background error with "Write stall" (writes stopped for
    # good), which the store waits out for STALL_TIMEOUT_S: shortened, as this test is about the clean-up
    from sparse_tables import spill
    monkeypatch.setattr(spill, "STALL_TIMEOUT_S", 5.0)
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
        filler = _leave_free(disk, 256 << 10)
        with pytest.raises(RemoteError, match=r"spill store at \S+/emb-server0-shard0\.1/rocksdb") as ei:
            big.restore(client)
        assert "in use by another table or process" not in str(ei.value)
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
