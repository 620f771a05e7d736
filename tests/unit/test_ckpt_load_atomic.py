"""A Load is all or nothing on each server (in-process servers): a damaged base or delta, or one that
would pass a table's ``max_rows``, is refused with the file / table named and every table (sparse, RAM
or spilled, and dense) keeps exactly its values; the shards a base was being read into and their spill
directories are gone. An intact base then loads and swaps in.

The checkpoints are written by two servers and loaded onto one, which reads every part file: with
several servers, a server whose vshards the damaged file does not cover loads its part as usual (each
server's Load is atomic, the cluster's restore is the coordinator's business)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from engine.checkpoint import CheckpointManager
from engine.config import DenseTableConfig
from engine.errors import RemoteError, RequestRejectedError
from engine.ps import InProcessTransport, PSClient, PSServer
from sparse_tables import TableConfig
from tests.faults import ServerClock

DIM = 4
N_KEYS = 600


CLOCK = ServerClock()          # the servers' clock: expiry passes use it, never a client's time

def make(tmp_path, tag: str, *, n: int = 2, spill: bool = False, max_rows: int = 0):
    cfg = TableConfig(dim=DIM, optimizer="adagrad", learning_rate=0.1, num_threads=1, memory_rows=50, expire_after=100.0,
                      spill_path=str(tmp_path / f"spill-{tag}") if spill else None, max_rows=max_rows)
    servers = [PSServer({"emb": cfg}, {"d": DenseTableConfig(optimizer="adam")}, index=i, num_servers=n,
                        num_vshards=64, local_shards=2, clock=CLOCK) for i in range(n)]
    return servers, PSClient(InProcessTransport(servers))


def state(client, servers, keys) -> tuple:
    """Everything a Load could change: sparse values, row counts per shard, dense params."""
    return (client.pull("emb", keys).copy(), [s.sparse["emb"].stats()["rows_per_shard"] for s in servers],
            client.pull_dense("d").copy())


def assert_same(a, b):
    np.testing.assert_array_equal(a[0], b[0])
    assert a[1] == b[1]
    np.testing.assert_array_equal(a[2], b[2])


def flip_byte(path: str, offset: int = 300) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def spill_dirs(tmp_path, tag: str) -> list[str]:
    root = tmp_path / f"spill-{tag}"
    return sorted(os.listdir(root)) if root.exists() else []


@pytest.fixture
def trained(tmp_path):
    """Two servers with rows and dense state, a base and a delta of them, then more training."""
    rng = np.random.default_rng(0)
    keys = rng.choice(1 << 40, N_KEYS, replace=False).astype(np.uint64)

    def build(tag, **kw):
        servers, client = make(tmp_path, tag, **kw)
        client.push("emb", keys, rng.normal(size=(N_KEYS, DIM)).astype(np.float32))
        client.init_dense("d", rng.normal(size=1000).astype(np.float32))
        client.push_dense("d", rng.normal(size=1000).astype(np.float32))
        return servers, client

    mgr = CheckpointManager(str(tmp_path / "ckpt"), "job")
    return keys, build, mgr, rng


@pytest.mark.parametrize("spill", [False, True], ids=["ram", "spill"])
def test_damaged_base_changes_nothing_and_names_the_file(trained, tmp_path, spill):
    keys, build, mgr, rng = trained
    src, src_client = build("src")
    base = mgr.save(src_client, "base", when=0.0)
    servers, client = make(tmp_path, "a", n=1, spill=spill)
    assert client.load(mgr.uri_of(base["name"])) == N_KEYS
    client.push("emb", keys[:100], rng.normal(size=(100, DIM)).astype(np.float32))   # live != base
    new_keys = np.arange(1, 51, dtype=np.uint64) + np.uint64(1 << 45)
    client.push("emb", new_keys, np.ones((50, DIM), np.float32))
    client.push_dense("d", rng.normal(size=1000).astype(np.float32))
    if spill:
        assert sum(s.sparse["emb"].stats()["rows_spilled"] for s in servers) > 0
    live_dirs = spill_dirs(tmp_path, "a")
    all_keys = np.concatenate([keys, new_keys])
    before = state(client, servers, all_keys)
    parts = sorted(n for n in base["files"] if n.startswith("sparse/"))
    for victim in (parts[0], parts[-1]):          # damage first and last: no order gets past the check
        path = mgr.storage.full_path(f"{base['name']}/{victim}")
        flip_byte(path)
        with pytest.raises(RemoteError) as ei:
            client.load(mgr.uri_of(base["name"]))
        assert ei.value.code == "DATA_LOSS" and victim in str(ei.value) and "crc32" in str(ei.value)
        assert_same(state(client, servers, all_keys), before)
        assert spill_dirs(tmp_path, "a") == live_dirs        # the fresh shards' directories are gone
        flip_byte(path)                                      # repair
    # intact, it loads: the base's values replace the live ones and the new keys are gone
    assert client.load(mgr.uri_of(base["name"])) == N_KEYS
    after = client.pull("emb", all_keys)
    assert not np.array_equal(after[:100], before[0][:100])
    np.testing.assert_array_equal(after[N_KEYS:], np.zeros((50, DIM), np.float32))
    assert sum(sum(s.sparse["emb"].stats()["rows_per_shard"]) for s in servers) == N_KEYS
    if spill:    # swapped to the other spill directory name; the old ones were removed
        other = sorted(d[:-2] if d.endswith(".1") else d + ".1" for d in live_dirs)
        assert spill_dirs(tmp_path, "a") == other
        assert client.load(mgr.uri_of(base["name"])) == N_KEYS        # and back
        assert spill_dirs(tmp_path, "a") == live_dirs
        np.testing.assert_array_equal(client.pull("emb", all_keys), after)
    for s in servers + src:
        s.close()


def test_damaged_delta_changes_nothing(trained, tmp_path):
    keys, build, mgr, rng = trained
    servers, client = build("a", spill=True)
    mgr.save(client, "base", when=0.0)
    client.push("emb", keys, rng.normal(size=(N_KEYS, DIM)).astype(np.float32))
    CLOCK.advance(1e6)
    client.shrink("emb")          # expires everything: the delta carries tombstones too
    fresh = np.arange(1, 201, dtype=np.uint64)
    client.push("emb", fresh, rng.normal(size=(200, DIM)).astype(np.float32))
    delta = mgr.save(client, "delta", when=60.0)
    assert delta["tables"]["sparse"]["emb"]["tombstones"] == N_KEYS
    # a second cluster restored to the base: the delta would delete its rows and add 200
    servers2, client2 = make(tmp_path, "b", n=1, spill=True)
    mgr2 = CheckpointManager(str(tmp_path / "ckpt"), "job")
    mgr2.restore(client2, mgr2.list()[0].name)
    all_keys = np.concatenate([keys, fresh])
    before = state(client2, servers2, all_keys)
    assert sum(sum(b) for b in before[1]) == N_KEYS
    files = sorted(n for n in delta["files"] if n.startswith(("sparse/", "tombstones/")))
    for victim in (files[-1], files[0]):
        path = mgr.storage.full_path(f"{delta['name']}/{victim}")
        flip_byte(path, 100)
        with pytest.raises(RemoteError) as ei:
            client2.load(mgr.uri_of(delta["name"]))
        assert ei.value.code == "DATA_LOSS" and victim in str(ei.value)
        assert_same(state(client2, servers2, all_keys), before)
        flip_byte(path, 100)
    assert client2.load(mgr.uri_of(delta["name"])) == 200
    np.testing.assert_array_equal(client2.pull("emb", all_keys), client.pull("emb", all_keys))
    for s in servers + servers2:
        s.close()


def test_base_past_max_rows_is_refused_before_anything_changes(trained, tmp_path):
    keys, build, mgr, rng = trained
    servers, client = build("a")
    base = mgr.save(client, "base", when=0.0)
    # one server with room for 400 rows (200 per local shard) gets a 600-row base
    small, sclient = make(tmp_path, "s", n=1, max_rows=400)
    few = keys[:300]
    sclient.push("emb", few, np.ones((300, DIM), np.float32))
    sclient.init_dense("d", np.zeros(1000, np.float32))
    before = state(sclient, small, keys)
    with pytest.raises(RequestRejectedError) as ei:
        sclient.load(mgr.uri_of(base["name"]))
    msg = str(ei.value)
    assert ei.value.code == "FAILED_PRECONDITION"
    assert "'emb'" in msg and "max_rows of 400" in msg and f"{N_KEYS} rows" in msg
    assert_same(state(sclient, small, keys), before)
    # room enough: it loads
    roomy, rclient = make(tmp_path, "r", n=1, max_rows=2000)
    assert rclient.load(mgr.uri_of(base["name"])) == N_KEYS
    np.testing.assert_array_equal(rclient.pull("emb", keys), client.pull("emb", keys))
    for s in servers + small + roomy:
        s.close()


def test_delta_past_max_rows_is_refused_before_anything_changes(trained, tmp_path):
    keys, build, mgr, rng = trained
    servers, client = build("a")
    base = mgr.save(client, "base", when=0.0)
    more = np.arange(1, 401, dtype=np.uint64)
    client.push("emb", more, np.ones((400, DIM), np.float32))
    client.push("emb", keys[:10], np.ones((10, DIM), np.float32))
    delta = mgr.save(client, "delta", when=60.0)
    limited, lclient = make(tmp_path, "l", n=1, max_rows=800)     # the base fits, base + delta not
    assert lclient.load(mgr.uri_of(base["name"])) == N_KEYS
    all_keys = np.concatenate([keys, more])
    before = state(lclient, limited, all_keys)
    with pytest.raises(RequestRejectedError) as ei:
        lclient.load(mgr.uri_of(delta["name"]))
    assert ei.value.code == "FAILED_PRECONDITION"
    assert "'emb'" in str(ei.value) and "max_rows of 800" in str(ei.value) and "1000 rows" in str(ei.value)
    assert_same(state(lclient, limited, all_keys), before)
    for s in servers + limited:
        s.close()


def test_a_full_table_whose_expiry_made_room_restores_its_delta(tmp_path):
    """A table at max_rows expires rows and new keys take their room: its delta (new rows and
    tombstones, the same row count) restores. The reader loaded the delta's rows before deleting its
    tombstones, so the shard passed max_rows midway and the load was refused."""
    rng = np.random.default_rng(5)
    servers, client = make(tmp_path, "src", n=1, max_rows=200)       # 100 rows a shard
    shards = servers[0].sparse["emb"].shards
    old = rng.choice(1 << 40, 400, replace=False).astype(np.uint64)
    client.push("emb", old, np.ones((400, DIM), np.float32))          # both shards full, the rest refused
    held = old[np.any([sh.contains(old) for sh in shards], axis=0)]
    assert len(held) == 200
    mgr = CheckpointManager(str(tmp_path / "ckpt"), "job")
    base = mgr.save(client, "base", when=0.0)
    CLOCK.advance(60.0)
    client.push("emb", held[20:], np.ones((180, DIM), np.float32))    # the first 20 are not seen again
    CLOCK.advance(60.0)
    assert client.shrink("emb") == 20
    new = rng.choice(1 << 40, 400, replace=False).astype(np.uint64) + np.uint64(1 << 41)
    client.push("emb", new, np.ones((400, DIM), np.float32))          # new keys take the room back
    assert sum(len(sh) for sh in shards) == 200
    delta = mgr.save(client, "delta", when=120.0)
    every = np.concatenate([old, new])
    want = client.pull("emb", every)
    dst, dclient = make(tmp_path, "dst", n=1, max_rows=200)
    dclient.load(mgr.uri_of(base["name"]))
    dclient.load(mgr.uri_of(delta["name"]))
    np.testing.assert_array_equal(dclient.pull("emb", every), want)
    assert sum(len(sh) for sh in dst[0].sparse["emb"].shards) == 200
    for s in servers + dst:
        s.close()


def test_a_checkpoint_with_the_old_float32_metrics_table_still_loads(tmp_path):
    """Before exact metric sums, CTR configs declared a float32 ``metrics`` dense table and every
    checkpoint saved it; a config without that table restores such a checkpoint, ignoring it."""
    cfg = TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros")
    keys = np.arange(1, 301, dtype=np.uint64)
    old = PSServer({"emb": cfg}, {"d": DenseTableConfig(optimizer="adam"),
                                  "metrics": DenseTableConfig(optimizer="sgd", learning_rate=1.0)},
                   num_vshards=64, local_shards=2)
    with PSClient(InProcessTransport([old])) as c:
        c.push("emb", keys, np.ones((300, DIM), np.float32))
        c.init_dense("d", np.arange(10, dtype=np.float32))
        c.init_dense("metrics", np.full(2 * 65536 + 4, 3.0, np.float32))
        mgr = CheckpointManager(str(tmp_path / "ckpt"), "job")
        base = mgr.save(c, "base", when=0.0)
        assert any(n.startswith("dense/metrics/") for n in base["files"])
    new = PSServer({"emb": cfg}, {"d": DenseTableConfig(optimizer="adam")}, num_vshards=64, local_shards=2)
    with PSClient(InProcessTransport([new])) as c:
        assert c.load(mgr.uri_of(base["name"])) == 300
        np.testing.assert_array_equal(c.pull("emb", keys), -np.ones((300, DIM), np.float32))
        np.testing.assert_array_equal(c.pull_dense("d"), np.arange(10, dtype=np.float32))
    old.close()
    new.close()


def test_a_delta_whose_dense_table_does_not_fit_changes_no_sparse_row(trained, tmp_path):
    """The dense part of a delta is checked before its sparse rows are applied (a dense table of
    another size used to be refused only after the rows had changed)."""
    keys, build, mgr, rng = trained
    servers, client = build("a")
    mgr.save(client, "base", when=0.0)
    client.push("emb", keys, rng.normal(size=(N_KEYS, DIM)).astype(np.float32))
    delta = mgr.save(client, "delta", when=60.0)
    other, oclient = make(tmp_path, "o", n=1)
    oclient.push("emb", keys[:50], np.ones((50, DIM), np.float32))
    oclient.init_dense("d", np.zeros(999, np.float32))          # the checkpoint's table has 1000
    before = state(oclient, other, keys)
    with pytest.raises(RequestRejectedError) as ei:
        oclient.load(mgr.uri_of(delta["name"]))
    assert ei.value.code == "FAILED_PRECONDITION" and "1000 values" in str(ei.value)
    assert_same(state(oclient, other, keys), before)
    for s in servers + other:
        s.close()
