"""Checkpoints through the PS RPCs (in-process servers): every row (RAM and spilled) with its optimizer
state, and the dense parameters with Adam state, restore bit-exactly onto another cluster size; base +
deltas (with expiry tombstones) equal the live state at the last delta; a damaged file is named through
the RPC error and fallback works."""
from __future__ import annotations

import numpy as np
import pytest

from engine.checkpoint import CheckpointManager
from engine.config import DenseTableConfig
from engine.ps import InProcessTransport, PSClient, PSServer
from hdfs_io import CheckpointCorruptError
from sparse_tables import TableConfig
from tests.faults import ServerClock

DIM = 4


CLOCK = ServerClock()          # the servers' clock: expiry passes use it, never a client's time

def make(n, tmp_path, tag, spill=True):
    cfg = TableConfig(dim=DIM, optimizer="adagrad", learning_rate=0.1, num_threads=1, memory_rows=200,
                      spill_path=str(tmp_path / f"spill-{tag}") if spill else None, expire_after=100.0)
    servers = [PSServer({"emb": cfg}, {"d": DenseTableConfig(optimizer="adam")}, index=i, num_servers=n,
                        num_vshards=64, local_shards=2, clock=CLOCK) for i in range(n)]
    return servers, PSClient(InProcessTransport(servers))


def rows_of(servers) -> dict:
    out = {}
    for s in servers:
        for shard in s.sparse["emb"].shards:
            for b in shard.rows():
                cols = {f.name: b.column(f.name) for f in b.schema}
                keys = cols["key"].to_numpy()
                raw = np.concatenate([cols["values"].flatten().to_numpy().view(np.uint32).reshape(len(keys), -1),
                                      cols["state"].flatten().to_numpy().view(np.uint32).reshape(len(keys), -1),
                                      cols["show"].to_numpy().view(np.uint32)[:, None],
                                      cols["click"].to_numpy().view(np.uint32)[:, None],
                                      cols["last_seen"].to_numpy()[:, None]], axis=1)
                for k, r in zip(keys, raw):
                    out[int(k)] = r.tobytes()
    return out


def dense_of(servers) -> dict:
    out = {}
    for s in servers:
        st = s.dense["d"].snapshot()
        for b, blk in (st.blocks.items() if st is not None else ()):
            out[b] = (blk.params.tobytes(), blk.m.tobytes(), blk.v.tobytes(), blk.t)
    return out


def test_rpc_roundtrip_base_deltas_and_resharding(tmp_path):
    rng = np.random.default_rng(0)
    servers, client = make(2, tmp_path, "a")
    mgr = CheckpointManager(str(tmp_path / "ckpt"), "ctr")
    keys = rng.choice(1 << 40, 1000, replace=False).astype(np.uint64)
    client.push("emb", keys, rng.normal(size=(1000, DIM)).astype(np.float32))
    client.init_dense("d", rng.normal(size=600_000).astype(np.float32))   # 2 blocks over 2 servers
    client.push_dense("d", rng.normal(size=600_000).astype(np.float32))
    assert sum(s.sparse["emb"].stats()["rows_spilled"] for s in servers) > 0
    snapshot = {"tables": {"sparse": {"emb": {"min_bound": float("-inf"), "max_bound": float("inf")}}}}
    base = mgr.save(client, "base", when=0.0, step=1, config=snapshot)
    assert base["config"]["tables"]["sparse"]["emb"]["min_bound"] == "-.inf"
    assert base["tables"]["sparse"]["emb"]["rows"] == 1000
    client.push("emb", keys[:100], rng.normal(size=(100, DIM)).astype(np.float32))
    CLOCK.advance(1e6)
    client.shrink("emb")         # everything expires: tombstones for all rows
    new = rng.choice(1 << 40, 50, replace=False).astype(np.uint64) + np.uint64(1 << 41)
    client.push("emb", new, rng.normal(size=(50, DIM)).astype(np.float32))
    client.push_dense("d", rng.normal(size=600_000).astype(np.float32))
    d1 = mgr.save(client, "delta", when=3600.0, step=2)
    assert d1["tables"]["sparse"]["emb"]["tombstones"] == 1000
    client.push("emb", new[:10], rng.normal(size=(10, DIM)).astype(np.float32))
    d2 = mgr.save(client, "delta", when=7200.0, step=3)
    assert d2["tables"]["sparse"]["emb"]["rows"] == 10 and d2["parent"] == d1["name"]
    want_rows, want_dense = rows_of(servers), dense_of(servers)
    assert len(want_rows) == 50
    servers3, client3 = make(3, tmp_path, "b")
    got = CheckpointManager(str(tmp_path / "ckpt"), "ctr").restore(client3)
    assert got["name"] == d2["name"] and got["step"] == 3
    assert rows_of(servers3) == want_rows
    assert dense_of(servers3) == want_dense
    np.testing.assert_array_equal(client3.pull("emb", new), client.pull("emb", new))
    # the base alone restores the state at the base, on one server without spill
    servers1, client1 = make(1, tmp_path, "c", spill=False)
    CheckpointManager(str(tmp_path / "ckpt"), "ctr").restore(client1, base["name"])
    assert len(rows_of(servers1)) == 1000


def test_damaged_file_named_through_rpc_and_fallback(tmp_path):
    rng = np.random.default_rng(1)
    servers, client = make(2, tmp_path, "a", spill=False)
    mgr = CheckpointManager(str(tmp_path / "ckpt"), "ctr")
    keys = rng.choice(1 << 40, 300, replace=False).astype(np.uint64)
    client.push("emb", keys, rng.normal(size=(300, DIM)).astype(np.float32))
    client.init_dense("d", np.zeros(10, np.float32))
    mgr.save(client, "base", when=0.0)
    want = rows_of(servers)
    client.push("emb", keys, rng.normal(size=(300, DIM)).astype(np.float32))
    d = mgr.save(client, "delta", when=60.0)
    part = sorted(n for n in d["files"] if n.startswith("sparse/"))[-1]
    path = mgr.storage.full_path(f"{d['name']}/{part}")
    with open(path, "r+b") as f:
        f.seek(200)
        b = f.read(1)
        f.seek(200)
        f.write(bytes([b[0] ^ 1]))
    servers2, client2 = make(2, tmp_path, "b", spill=False)
    with pytest.raises(CheckpointCorruptError, match="crc32") as ei:
        CheckpointManager(str(tmp_path / "ckpt"), "ctr").restore(client2)
    assert part in str(ei.value)
    got = CheckpointManager(str(tmp_path / "ckpt"), "ctr").restore(client2, fallback=True)
    assert got["kind"] == "base" and rows_of(servers2) == want
