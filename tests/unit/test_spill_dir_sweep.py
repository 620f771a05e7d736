"""A server removes the spill directories a dead run of it left under names it does not open again
(``sparse_tables.spill.sweep_dead``, called by ``engine.ps.hosts`` as it makes a table's shards).

A server killed while its shards lived under the other slot name (``emb-server0-shard0.1``, after a base
load) kept their RocksDB files on disk: the next run opens ``emb-server0-shard0`` and claimed the ``.1``
names only at its next base load, never in a job started afresh (a real server, 1.5M rows: 2 x 60 MB left
while the new one ran). Directories in use, without the marker, of another table or of another server
stay.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from sparse_tables import TableConfig
from sparse_tables.spill import SpillDir

DIM = 4


def _dead(path: Path) -> Path:
    """A spill directory as a killed run leaves it: marker, free lock, a database file."""
    claim = SpillDir(path)
    (path / "rocksdb").mkdir()
    (path / "rocksdb" / "000042.sst").write_bytes(b"x" * 1000)
    claim.release(remove=False)
    return path


def test_a_server_removes_its_dead_runs_spill_directories_and_nothing_else(tmp_path):
    from engine.ps import InProcessTransport, PSClient, PSServer
    spill = tmp_path / "spill"
    spill.mkdir()
    gone = [_dead(spill / "emb-server0-shard0.1"), _dead(spill / "emb-server0-shard1.1"),
            _dead(spill / "emb-server0-shard5")]            # a run with more local shards
    kept = [_dead(spill / "emb2-server0-shard0.1"), _dead(spill / "emb-server1-shard0.1"),
            _dead(spill / "emb-server0-shard0.1.old")]
    live = SpillDir(spill / "emb-server0-shard7")           # another process's, in use
    foreign = spill / "emb-server0-shard6"
    foreign.mkdir()
    (foreign / "data").write_text("not ours")
    cfg = TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros", memory_rows=100,
                      spill_path=str(spill), num_threads=1)
    server = PSServer({"emb": cfg}, {}, index=0, num_servers=1, num_vshards=64, local_shards=2)
    try:
        assert not any(p.exists() for p in gone)
        assert all((p / "rocksdb" / "000042.sst").exists() for p in kept)
        assert (live.path / ".lock").exists() and (foreign / "data").read_text() == "not ours"
        with PSClient(InProcessTransport([server])) as client:
            keys = np.arange(1, 2_001, dtype=np.uint64)
            client.push("emb", keys, np.ones((len(keys), DIM), np.float32))
            np.testing.assert_array_equal(client.pull("emb", keys), -np.ones((len(keys), DIM), np.float32))
        assert sorted(p.name for p in spill.iterdir()) == sorted(
            ["emb-server0-shard0", "emb-server0-shard1", "emb-server0-shard6", "emb-server0-shard7",
             *(p.name for p in kept)])
    finally:
        server.close()
        live.release()
