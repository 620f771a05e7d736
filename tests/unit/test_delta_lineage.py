"""A server accepts a delta Save only when its changes are counted from the delta's parent: the
checkpoint it last saved or loaded (``engine.ps.delta_lineage``). In-process servers; the real-process
case with two coordinators is in ``tests/integration/test_ckpt_two_coordinators.py``."""
from __future__ import annotations

import os

import numpy as np
import pytest

import engine.ps.checkpoint_handlers as server_mod
from engine.checkpoint import CheckpointManager
from engine.errors import DeltaParentError
from engine.ps import InProcessTransport, PSClient, PSServer
from engine.ps.delta_lineage import key
from sparse_tables import TableConfig

DIM = 4
KEYS = np.arange(1, 201, dtype=np.uint64)


def make():
    cfg = TableConfig(dim=DIM, optimizer="adagrad", learning_rate=0.1, num_threads=1, spill_path=None)
    server = PSServer({"emb": cfg}, index=0, num_servers=1, num_vshards=64, local_shards=2)
    return server, PSClient(InProcessTransport([server]))


def push(client, keys, value=1.0):
    client.push("emb", keys, np.full((len(keys), DIM), value, np.float32))


def rows_of(root, name, keys):
    """The rows of ``keys`` after restoring checkpoint ``name`` onto a fresh server."""
    _, fresh = make()
    CheckpointManager(root, "ctr").restore(fresh, name)
    return fresh.pull("emb", keys)


def test_a_delta_whose_parent_is_not_the_servers_last_save_is_refused_and_nothing_is_written_or_cleared(tmp_path):
    server, client = make()
    mgr = CheckpointManager(str(tmp_path), "ctr")
    push(client, KEYS)
    base = mgr.save(client, "base", when=0.0)["name"]
    push(client, KEYS[:20], 2.0)
    stray = mgr.uri_of("19700101/0001-delta")
    with pytest.raises(DeltaParentError, match="delta parent mismatch: server 0: .* names parent .*0000-delta, "
                       "but this server's changes are counted from .*0000-base"):
        client.save(stray, mgr.uri_of("19700101/0000-delta"))
    assert not os.path.exists(stray)                 # nothing written
    d = mgr.save(client, "delta", when=60.0)         # the same rows are still dirty: nothing cleared
    assert d["kind"] == "delta" and d["parent"] == base
    assert d["tables"]["sparse"]["emb"]["rows"] == 20
    np.testing.assert_array_equal(rows_of(str(tmp_path), d["name"], KEYS), client.pull("emb", KEYS))


def test_a_fresh_server_takes_only_a_base(tmp_path):
    _, client = make()
    mgr = CheckpointManager(str(tmp_path), "ctr")
    push(client, KEYS)
    with pytest.raises(DeltaParentError, match="counted from nothing"):
        client.save(mgr.uri_of("19700101/0001-delta"), mgr.uri_of("19700101/0000-base"))
    _, writer = make()
    push(writer, KEYS[:5])
    mgr.head = mgr.save(writer, "base", when=0.0)["name"]    # a checkpoint these servers never saved or loaded
    m = mgr.save(client, "delta", when=60.0)
    assert m["kind"] == "base"                        # refused as a delta: written as a base instead
    np.testing.assert_array_equal(rows_of(str(tmp_path), m["name"], KEYS), client.pull("emb", KEYS))


def test_after_a_load_the_loaded_checkpoint_is_the_parent_whatever_its_spelling(tmp_path, monkeypatch):
    _, client = make()
    mgr = CheckpointManager(str(tmp_path), "ctr")
    push(client, KEYS)
    base = mgr.save(client, "base", when=0.0)["name"]
    _, other = make()
    monkeypatch.chdir(tmp_path)
    CheckpointManager("file://" + str(tmp_path), "ctr").restore(other, base)    # loaded as file:///...
    push(other, KEYS[:10], 3.0)
    m = CheckpointManager(".", "ctr")                                          # saved as ./ctr/...
    m.head = base
    d = m.save(other, "delta", when=60.0)
    assert d["kind"] == "delta" and d["tables"]["sparse"]["emb"]["rows"] == 10
    assert key("file://" + str(tmp_path) + "/ctr/x/") == key(os.path.join(".", "ctr", "x")) == str(tmp_path / "ctr" / "x")


def test_a_failed_save_or_a_clearing_fence_leaves_only_a_base_acceptable(tmp_path, monkeypatch):
    server, client = make()
    mgr = CheckpointManager(str(tmp_path), "ctr")
    push(client, KEYS)
    base = mgr.save(client, "base", when=0.0)["name"]
    real = server_mod.save_server_parts

    def failing(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(server_mod, "save_server_parts", failing)
    with pytest.raises(Exception, match="disk full"):
        client.save(mgr.uri_of("19700101/0001-delta"), mgr.uri_of(base))
    monkeypatch.setattr(server_mod, "save_server_parts", real)
    with pytest.raises(DeltaParentError, match="counted from nothing"):
        client.save(mgr.uri_of("19700101/0002-delta"), mgr.uri_of(base))
    again = mgr.save(client, "base", when=180.0)["name"]
    client.save(mgr.uri_of("19700101/0004-delta"), mgr.uri_of(again))       # accepted again after a base
    client.fence(client.generations(), "test", clear=True)
    client2 = PSClient(InProcessTransport([server]))
    with pytest.raises(DeltaParentError, match="counted from nothing"):
        client2.save(mgr.uri_of("19700101/0005-delta"), mgr.uri_of("19700101/0004-delta"))


def test_the_zombie_coordinators_fork_its_successors_next_checkpoint_has_every_row(tmp_path):
    """The checkpoint audit's case: a zombie rank 0 saves a delta (its Save takes the changed rows out
    of the servers' dirty state) after a new coordinator took over from the same base; the new one's
    next checkpoint used to be a delta without those rows, and its chain restored values that never
    existed. It is now a base, and restores to exactly the live rows."""
    _, client = make()
    root = str(tmp_path)
    zombie = CheckpointManager(root, "ctr")
    push(client, KEYS)
    base = zombie.save(client, "base", when=0.0)["name"]
    new = CheckpointManager(root, "ctr")
    new.head = base                                   # took over from the base
    push(client, KEYS[:50], 2.0)
    z = zombie.save(client, "delta", when=60.0)       # the zombie's save ran: rows 0..49 leave the dirty state
    assert z["kind"] == "delta"
    push(client, KEYS[100:150], 3.0)
    n = new.save(client, "delta", when=120.0)
    assert n["kind"] == "base", n["name"]
    live = client.pull("emb", KEYS)
    np.testing.assert_array_equal(rows_of(root, n["name"], KEYS), live)
    assert not np.array_equal(rows_of(root, z["name"], KEYS), live)     # the fork: its own, older state
    d = new.save(client, "delta", when=180.0)         # and the new chain goes on as deltas
    assert d["kind"] == "delta" and d["parent"] == n["name"]
