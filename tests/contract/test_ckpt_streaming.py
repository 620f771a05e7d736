"""A base checkpoint streams each shard's rows into its part files (``engine.checkpoint.writer``'s
``_GroupFiles``): files are written while the shard's rows are still being read, the restore is
bit-exact, a transient storage error mid-stream redoes the shard's dump, and a permanent one fails the
save, leaves none of the shard's files behind and publishes nothing, so the next save starts clean."""
from __future__ import annotations

import datetime as dt

import numpy as np
import pytest

from engine.checkpoint import CheckpointManager
from engine.checkpoint import writer as W
from hdfs_io import IpcFileWriter, RetryPolicy
from sparse_tables import TableConfig
from sparse_tables.errors import SpillError
from tests.contract.test_ckpt_format import ShardCluster

T0 = dt.datetime(2024, 1, 1, 0, 0, tzinfo=dt.timezone.utc)


def _spilled_cluster(tmp_path, n=40_000):
    cfg = TableConfig(dim=4, optimizer="adagrad", learning_rate=0.1, memory_rows=5_000,
                      spill_path=str(tmp_path / "spill"), num_threads=1)
    c = ShardCluster(1, {"emb": cfg}, local=1)
    keys = np.random.default_rng(0).choice(1 << 40, n, replace=False).astype(np.uint64)
    grads = np.random.default_rng(1).normal(size=(n, 4)).astype(np.float32)
    for i in range(0, n, 4_000):
        c.push("emb", keys[i:i + 4_000], grads[i:i + 4_000])
    return c


def _fail_12th_write(monkeypatch, exc: OSError) -> list:
    """IpcFileWriter.write raises ``exc`` on its 12th call (mid-stream: a few files open); returns the
    call counter."""
    write, calls = IpcFileWriter.write, [0]

    def failing(self, data):
        calls[0] += 1
        if calls[0] == 12:
            raise exc
        write(self, data)
    monkeypatch.setattr(IpcFileWriter, "write", failing)
    return calls


def test_a_base_writes_part_files_while_the_shard_is_still_being_read_and_restores_bit_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(W, "STREAM_ROWS", 500)
    src = _spilled_cluster(tmp_path / "src")
    shard = src.tables[0]["emb"][0]
    assert shard.stats()["rows_spilled"] > 30_000
    yielded = [0]
    rows = shard.rows

    def counted(chunk_rows=65536, *, clear=False, sketch=None):
        for batch in rows(chunk_rows=4_096, clear=clear, sketch=sketch):       # ten batches and more: RAM rows, then RocksDB's
            yielded[0] += 1
            yield batch
    monkeypatch.setattr(shard, "rows", counted)
    at_write = []
    write = IpcFileWriter.write
    monkeypatch.setattr(IpcFileWriter, "write", lambda self, data: (at_write.append(yielded[0]), write(self, data)))
    mgr = CheckpointManager(str(tmp_path / "ckpt"), "job", groups=8)
    mgr.save(src, "base", when=T0)
    assert yielded[0] >= 10 and at_write and at_write[0] <= 2, (yielded[0], at_write[:5])
    dst = ShardCluster(1, {"emb": src.configs["emb"]}, local=1)
    try:
        assert mgr.restore(dst)["kind"] == "base"
        assert dst.dump("emb") == src.dump("emb") and len(dst.dump("emb")) == 40_000
    finally:
        dst.close()
        src.close()


def test_a_storage_error_mid_stream_fails_the_base_and_leaves_no_part_file(tmp_path, monkeypatch):
    monkeypatch.setattr(W, "STREAM_ROWS", 500)
    src = _spilled_cluster(tmp_path / "src")
    write = IpcFileWriter.write
    _fail_12th_write(monkeypatch, PermissionError("write refused (injected)"))     # permanent: not retried
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(str(root), "job", groups=8)
    try:
        with pytest.raises(OSError, match="injected"):
            mgr.save(src, "base", when=T0)
        assert not list(root.rglob("*.arrow")), "a failed base left part files behind"
        assert not list(root.rglob("_SUCCESS"))
        monkeypatch.setattr(IpcFileWriter, "write", write)
        m = mgr.save(src, "base", when=T0 + dt.timedelta(hours=1))        # the next save starts clean
        dst = ShardCluster(1, {"emb": src.configs["emb"]}, local=1)
        try:
            assert mgr.restore(dst)["name"] == m["name"] and dst.dump("emb") == src.dump("emb")
        finally:
            dst.close()
    finally:
        src.close()


def test_a_transient_error_mid_stream_redoes_the_shards_dump_and_the_base_is_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(W, "STREAM_ROWS", 500)
    src = _spilled_cluster(tmp_path / "src")
    calls = _fail_12th_write(monkeypatch, ConnectionResetError("connection reset by peer (injected)"))
    mgr = CheckpointManager(str(tmp_path / "ckpt"), "job", groups=8, retry=RetryPolicy(initial_delay_s=0.01))
    dst = ShardCluster(1, {"emb": src.configs["emb"]}, local=1)
    try:
        m = mgr.save(src, "base", when=T0)
        assert calls[0] > 12                    # the error happened, and the dump was done again
        assert mgr.restore(dst)["name"] == m["name"] and dst.dump("emb") == src.dump("emb")
    finally:
        dst.close()
        src.close()


def test_a_shard_with_no_rows_writes_no_part_file(tmp_path):
    c = ShardCluster(1, {"emb": TableConfig(dim=4)}, local=2)
    try:
        m = CheckpointManager(str(tmp_path / "ckpt"), "job", groups=8).save(c, "base", when=T0)
        assert not list((tmp_path / "ckpt").rglob("*.arrow")) and m["kind"] == "base"
    finally:
        c.close()


def test_a_base_over_a_corrupt_spill_store_fails_naming_it_and_publishes_nothing(tmp_path):
    from tests.unit.test_spill_dump import _corrupt_middle_of_largest_sst
    src = _spilled_cluster(tmp_path / "src")
    shard = src.tables[0]["emb"][0]
    shard._spill._db.flush()
    _corrupt_middle_of_largest_sst(shard._spill._dir.db_path)
    root = tmp_path / "ckpt"
    try:
        with pytest.raises(SpillError, match="a scan stopped after .* on a read error: Corruption"):
            CheckpointManager(str(root), "job", groups=8).save(src, "base", when=T0)
        assert not list(root.rglob("*.arrow")), "a failed base left part files behind"
        assert not list(root.rglob("_SUCCESS")) and not list(root.rglob("manifest.json"))
    finally:
        src.close()


def test_a_transient_error_mid_delta_writes_its_instants_rows_again_and_the_chain_restores_bit_exact(
        tmp_path, monkeypatch):
    monkeypatch.setattr(W, "STREAM_ROWS", 500)
    src = _spilled_cluster(tmp_path / "src")
    mgr = CheckpointManager(str(tmp_path / "ckpt"), "job", groups=8, retry=RetryPolicy(initial_delay_s=0.01))
    dst = ShardCluster(1, {"emb": src.configs["emb"]}, local=1)
    try:
        mgr.save(src, "base", when=T0)
        keys = np.sort(np.asarray(list(src.dump("emb")), np.uint64))[::2]   # half the rows, most spilled
        src.push("emb", keys, np.full((len(keys), 4), 0.5, np.float32))
        assert src.tables[0]["emb"][0].stats()["rows_spilled"] > 15_000
        calls = _fail_12th_write(monkeypatch, ConnectionResetError("connection reset by peer (injected)"))
        m = mgr.save(src, "delta", when=T0 + dt.timedelta(hours=1))
        assert calls[0] > 12 and m["kind"] == "delta" and m["tables"]["sparse"]["emb"]["rows"] == len(keys)
        assert mgr.restore(dst)["name"] == m["name"] and dst.dump("emb") == src.dump("emb")
    finally:
        dst.close()
        src.close()
