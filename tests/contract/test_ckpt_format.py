"""Checkpoint format on every storage backend (local, moto S3): save -> restore is bit-exact for every
row (RAM and spilled), optimizer state and dense blocks; base + deltas == live state at the last delta;
N -> M servers; damaged checkpoints name the file; fallback; half-written checkpoints are ignored;
retention. The cluster here is SparseTable shards in this process driven through the same server-side
writer/reader the PS servers use."""
from __future__ import annotations

import contextlib
import datetime as dt
import json

import numpy as np
import pytest

import hdfs_io
from engine.checkpoint import (CheckpointManager, CheckpointNotFoundError, DenseBlockState, DenseState,
                               load_server_parts, save_server_parts)
from engine.checkpoint.manifest import kind_of_uri
from engine.ps import routing
from hdfs_io import CheckpointCorruptError
from sparse_tables import SparseTable, TableConfig

NV = 64
T0 = dt.datetime(2024, 1, 1, 0, 0, tzinfo=dt.timezone.utc)


class ShardCluster:
    """``num_servers`` x ``local`` SparseTable shards per table + dense blocks, with the PS client's
    save/load shape (each "server" runs the real writer / reader)."""

    def __init__(self, num_servers: int, configs: dict, *, local: int = 2, storage_options=None, dense_size=0,
                 groups: int = 8):
        self.num_servers, self.local, self.configs, self.groups = num_servers, local, configs, groups
        self.storage_options = storage_options
        self.tables = [self._fresh(s) for s in range(num_servers)]
        self.dense_size = dense_size
        self.dense = [DenseState(dense_size) if dense_size else None for _ in range(num_servers)]
        self.fail_server: int | None = None

    def _fresh(self, s):
        out = {}
        for name, cfg in self.configs.items():
            shards = []
            for j in range(self.local):
                c = cfg
                if cfg.spill_path:
                    import dataclasses
                    c = dataclasses.replace(cfg, spill_path=f"{cfg.spill_path}/{name}-{s}-{j}-{id(self)}")
                shards.append(SparseTable(c, clock=lambda: 1000.0))
            out[name] = shards
        return out

    def owner(self, s):
        return routing.local_shard_owners(NV, self.num_servers, s, self.local)

    def push(self, name, keys, grads, shows=None):
        srv = routing.route(keys, NV, self.num_servers)
        for s in range(self.num_servers):
            m = srv == s
            if not m.any():
                continue
            local = routing.lookup(keys[m], NV, self.owner(s))
            for j in range(self.local):
                mm = local == j
                if mm.any():
                    sh = None if shows is None else shows[m][mm]
                    self.tables[s][name][j].push(keys[m][mm], grads[m][mm], shows=sh)

    def delete(self, name, keys):
        for s in range(self.num_servers):
            for shard in self.tables[s][name]:
                shard.delete(keys)

    def dump(self, name) -> dict:
        out = {}
        for s in range(self.num_servers):
            for shard in self.tables[s][name]:
                for b in shard.rows():
                    d = b.to_pydict()
                    for i, k in enumerate(d["key"]):
                        row = [np.float32(v).tobytes() for v in d["values"][i]]
                        row += [np.float32(v).tobytes() for v in d.get("state", [[]] * (i + 1))[i]]
                        row += [np.float32(d["show"][i]).tobytes(), np.float32(d["click"][i]).tobytes(),
                                d["last_seen"][i]]
                        assert k not in out, "a key lives on two shards"
                        out[k] = tuple(row)
        return out

    def storage(self, uri):
        return hdfs_io.Storage.from_uri(uri, storage_options=self.storage_options)

    def save(self, uri, parent=""):
        kind = kind_of_uri(uri)
        for s in range(self.num_servers):
            if s == self.fail_server:
                raise OSError(f"server {s} killed mid-write")
            dense = {"dense": self.dense[s]} if self.dense[s] is not None else {}
            save_server_parts(self.storage(uri), kind=kind, server=s, num_servers=self.num_servers,
                              num_vshards=NV, sparse=self.tables[s], dense=dense, groups=self.groups)
        return 0

    def load(self, uri, chain_end=""):
        ckpt = self.storage(uri)
        manifest = hdfs_io.read_manifest(ckpt, "")
        n = 0
        for s in range(self.num_servers):
            if manifest["kind"] == "base":
                for shards in self.tables[s].values():
                    for sh in shards:
                        sh.close()
                self.tables[s] = self._fresh(s)
            owns = (lambda name, b, s=s: b % self.num_servers == s)
            rows, _, dense = load_server_parts(ckpt, num_vshards=NV, local_owner=self.owner(s),
                                               sparse=self.tables[s], dense_owns=owns, manifest=manifest)
            n += sum(rows.values())
            if "dense" in dense:
                size, blocks = dense["dense"]
                self.dense[s] = DenseState(size, blocks)
        return n

    def close(self):
        for t in self.tables:
            for shards in t.values():
                for sh in shards:
                    sh.close()


def _cfg(tmp_path, spill: bool):
    return TableConfig(dim=4, optimizer="adagrad", learning_rate=0.1, memory_rows=300 if spill else 1_000_000,
                       spill_path=str(tmp_path / "spill") if spill else None, num_threads=1)


def _grads(rng, n, dim=4):
    return rng.normal(size=(n, dim)).astype(np.float32)


def _dense_blocks(cluster, rng):
    for s in range(cluster.num_servers):
        blocks = {b: DenseBlockState(rng.normal(size=5).astype(np.float32), rng.normal(size=5).astype(np.float32),
                                     rng.random(5).astype(np.float32), 7 + b)
                  for b in range(4) if b % cluster.num_servers == s}
        cluster.dense[s] = DenseState(20, blocks)


def _dense_all(cluster):
    out = {}
    for st in cluster.dense:
        for b, blk in st.blocks.items():
            out[b] = (blk.params.tobytes(), blk.m.tobytes(), blk.v.tobytes(), blk.t)
    return out


@pytest.fixture
def mk(storage, tmp_path, request):
    """(make_cluster(num_servers, spill=False), CheckpointManager) on the parametrized backend."""
    opts = request.getfixturevalue("s3_storage_options") if storage.fs.type_name == "s3" else None
    clusters = []

    def make(num_servers, spill=False, **kw):
        c = ShardCluster(num_servers, {"emb": _cfg(tmp_path / f"c{len(clusters)}", spill)},
                         storage_options=opts, dense_size=20, **kw)
        clusters.append(c)
        return c

    make.manager = lambda groups=8: CheckpointManager(storage.uri, "job", storage_options=opts, keep_bases=2,
                                                     groups=groups)
    yield make, make.manager()
    for c in clusters:
        c.close()


@pytest.mark.parametrize("spill", [False, True], ids=["ram", "spill"])
def test_base_restore_bit_exact_and_resharded(mk, spill):
    make, mgr = mk
    rng = np.random.default_rng(0)
    src = make(2, spill=spill)
    keys = rng.choice(1 << 40, 2000, replace=False).astype(np.uint64)
    for _ in range(3):
        src.push("emb", keys, _grads(rng, len(keys)), shows=np.ones(len(keys), np.float32))
    _dense_blocks(src, rng)
    if spill:
        assert sum(sh.stats()["rows_spilled"] for t in src.tables for sh in t["emb"]) > 0
    m = mgr.save(src, "base", when=T0, step=42, sources={"train": {"file_index": 3, "batch_index": 7}})
    assert m["tables"]["sparse"]["emb"]["rows"] == 2000 and m["num_servers"] == 2
    want = src.dump("emb")
    for n in (2, 3, 1):
        dst = make(n, spill=spill)
        got = mgr.restore(dst)
        assert got["step"] == 42 and got["sources"]["train"]["batch_index"] == 7
        assert dst.dump("emb") == want, f"restore onto {n} servers differs"
        assert _dense_all(dst) == _dense_all(src)


def test_deltas_restore_equals_live_state(mk):
    make, mgr = mk
    rng = np.random.default_rng(1)
    live = make(2, spill=True)
    keys = rng.choice(1 << 40, 1500, replace=False).astype(np.uint64)
    live.push("emb", keys, _grads(rng, len(keys)))
    mgr.save(live, "base", when=T0)
    alive = set(keys.tolist())
    for h in range(1, 4):
        touched = rng.choice(keys, 100, replace=False)
        new = rng.choice(1 << 40, 50, replace=False).astype(np.uint64) + np.uint64(1 << 41)
        keys = np.concatenate([keys, new])
        live.push("emb", np.concatenate([touched, new]), _grads(rng, 150))
        gone = rng.choice(keys, 20, replace=False)
        live.delete("emb", gone)
        _dense_blocks(live, rng)
        m = mgr.save(live, "delta", when=T0 + dt.timedelta(hours=h))
        assert m["kind"] == "delta" and m["chain_index"] == h
        # a tombstone for each deleted key the parent held (not the keys created in this hour)
        assert m["tables"]["sparse"]["emb"]["tombstones"] == len(alive & set(gone.tolist()))
        alive = (alive | set(touched.tolist()) | set(new.tolist())) - set(gone.tolist())
        assert m["tables"]["sparse"]["emb"]["rows"] <= 150
    want = live.dump("emb")
    dst = make(3)
    got = mgr.restore(dst)
    assert got["name"] == "20240101/0300-delta"
    assert dst.dump("emb") == want
    assert _dense_all(dst) == _dense_all(live)
    # restoring an older checkpoint of the chain gives the older state
    assert mgr.restore(make(2), "20240101/0000-base")["kind"] == "base"


def test_same_minute_names_and_listing(mk):
    make, mgr = mk
    c = make(1)
    c.push("emb", np.arange(1, 10, dtype=np.uint64), _grads(np.random.default_rng(2), 9))
    names = [mgr.save(c, k, when=T0)["name"] for k in ("base", "delta", "delta")]
    assert names == ["20240101/0000-base", "20240101/0000-delta.1", "20240101/0000-delta.2"]
    assert [r.name for r in mgr.list()] == names


def test_damaged_checkpoints_name_the_file_and_fallback(mk):
    make, mgr = mk
    rng = np.random.default_rng(3)
    c = make(2)
    keys = rng.choice(1 << 40, 500, replace=False).astype(np.uint64)
    c.push("emb", keys, _grads(rng, 500))
    mgr.save(c, "base", when=T0)
    before = c.dump("emb")
    c.push("emb", keys[:100], _grads(rng, 100))
    m = mgr.save(c, "delta", when=T0 + dt.timedelta(hours=1))
    st = mgr.storage
    part = sorted(n for n in m["files"] if n.startswith("sparse/"))[0]
    path = f"{m['name']}/{part}"
    raw = st.read_bytes(path)
    for damage in ("missing", "corrupt", "truncated"):
        if damage == "missing":
            st.delete(path)
        elif damage == "corrupt":
            st.write_bytes(path, raw[:100] + bytes([raw[100] ^ 0xFF]) + raw[101:])
        else:
            st.write_bytes(path, raw[: len(raw) // 2])
        with pytest.raises(CheckpointCorruptError) as ei:
            mgr.restore(make(2))
        assert part in str(ei.value), str(ei.value)
        dst = make(3)
        got = mgr.restore(dst, fallback=True)
        assert got["name"] == "20240101/0000-base"
        assert dst.dump("emb") == before
        st.write_bytes(path, raw)
    # a truncated Arrow file whose manifest entry matches (written so) still names the file
    st.write_bytes(path, raw[: len(raw) // 2])
    man = json.loads(st.read_bytes(f"{m['name']}/manifest.json"))
    man["files"][part] = hdfs_io.FileEntry.of_bytes(raw[: len(raw) // 2]).to_json()
    st.write_bytes(f"{m['name']}/manifest.json", json.dumps(man).encode())
    with pytest.raises(CheckpointCorruptError, match="not a readable Arrow IPC file") as ei:
        mgr.restore(make(2))
    assert part in str(ei.value)


@pytest.mark.parametrize("kind, what", [("base", "rows"), ("delta", "rows"), ("delta", "tombstones")])
def test_a_manifest_whose_counts_differ_from_its_files_fails_the_restore(mk, kind, what):
    """Every file of a table is read by the one server here, so the rows and tombstones its files hold
    must add up to the manifest's counts: a checkpoint that lost or gained rows behind its manifest's back
    (files rewritten with matching checksums) is refused, naming the table, the count and the manifest."""
    make, mgr = mk
    rng = np.random.default_rng(4)
    c = make(1)
    keys = rng.choice(1 << 40, 200, replace=False).astype(np.uint64)
    c.push("emb", keys, _grads(rng, 200))
    m = mgr.save(c, "base", when=T0)
    if kind == "delta":
        c.push("emb", keys[:30], _grads(rng, 30))
        c.delete("emb", keys[-5:])
        m = mgr.save(c, "delta", when=T0 + dt.timedelta(hours=1))
    st = mgr.storage
    man = json.loads(st.read_bytes(f"{m['name']}/manifest.json"))
    want = man["tables"]["sparse"]["emb"][what]
    assert want == {"base": 200, "delta": 30 if what == "rows" else 5}[kind]
    man["tables"]["sparse"]["emb"][what] = want + 1
    st.write_bytes(f"{m['name']}/manifest.json", json.dumps(man).encode())
    with pytest.raises(CheckpointCorruptError,
                       match=f"manifest.json: table 'emb': the manifest counts {want + 1} {what}, its files "
                             f"hold {want}"):
        mgr.restore(make(1))


def test_half_written_checkpoint_is_ignored(mk):
    make, mgr = mk
    rng = np.random.default_rng(4)
    c = make(2)
    keys = rng.choice(1 << 40, 300, replace=False).astype(np.uint64)
    c.push("emb", keys, _grads(rng, 300))
    mgr.save(c, "base", when=T0)
    want = c.dump("emb")
    c.push("emb", keys, _grads(rng, 300))
    c.fail_server = 1                                   # server 0 wrote its parts, server 1 died
    with pytest.raises(OSError, match="killed"):
        mgr.save(c, "delta", when=T0 + dt.timedelta(hours=1))
    assert mgr.storage.exists("20240101/0100-delta")   # the leftovers are there ...
    assert [r.name for r in mgr.list()] == ["20240101/0000-base"]   # ... but do not exist for readers
    dst = make(2)
    assert make.manager().restore(dst)["name"] == "20240101/0000-base"
    assert dst.dump("emb") == want
    c.fail_server = None                                # server 0 already cleared its dirty rows:
    m = mgr.save(c, "delta", when=T0 + dt.timedelta(hours=2))
    assert m["kind"] == "base"                          # so the next checkpoint must be a base
    make.manager().restore(dst)
    assert dst.dump("emb") == c.dump("emb")


def test_retention_keeps_last_bases_and_their_deltas(mk):
    make, mgr = mk
    c = make(1)
    c.push("emb", np.arange(1, 50, dtype=np.uint64), _grads(np.random.default_rng(5), 49))
    names = []
    for day in range(4):
        for h, kind in ((0, "base"), (1, "delta"), (2, "delta")):
            names.append(mgr.save(c, kind, when=T0 + dt.timedelta(days=day, hours=h))["name"])
    left = [r.name for r in mgr.list()]
    assert left == names[-6:]
    assert not mgr.storage.exists("20240101") and not mgr.storage.exists("20240102")
    assert mgr.restore(make(1))["name"] == names[-1]


def test_nothing_to_restore(mk):
    _, mgr = mk
    with pytest.raises(CheckpointNotFoundError):
        mgr.restore(ShardCluster(1, {}))


def test_groups_that_do_not_divide_the_vshards_restore_every_row_on_any_cluster_size(mk):
    """Group g holds the vshards v with v * groups // NV == g (the writer's group_of); a reader that took
    [g * NV // groups, (g + 1) * NV // groups) instead skipped a file holding some of its vshards when
    groups does not divide NV (64 / 7 here), and lost those rows on 2 and 3 servers."""
    make, _ = mk
    mgr = make.manager(groups=7)
    rng = np.random.default_rng(5)
    src = make(2, spill=True, groups=7)
    keys = rng.choice(1 << 40, 2000, replace=False).astype(np.uint64)
    src.push("emb", keys, _grads(rng, len(keys)), shows=np.ones(len(keys), np.float32))
    mgr.save(src, "base", when=T0)
    want = src.dump("emb")
    for n in (3, 2, 1):
        dst = make(n, spill=True, groups=7)
        mgr.restore(dst)
        got = dst.dump("emb")
        assert len(got) == 2000 and got == want, f"restore onto {n} servers differs"
        spilled = sum(sh.stats()["rows_spilled"] + sh.stats()["rows_in_ram"] for t in dst.tables for sh in t["emb"])
        assert spilled == 2000          # a base loads with bulk_load(distinct=True): each row counted once


@contextlib.contextmanager
def _misfiling(monkeypatch, key):
    """A writer that files ``key`` in the next vshard group: its checksums are right, so only the
    reader's group check can see it."""
    from engine.checkpoint import writer
    real = writer.group_of
    monkeypatch.setattr(writer, "group_of", lambda k, nv, g: np.where(k == key, (real(k, nv, g) + 1) % g,
                                                                      real(k, nv, g)))
    try:
        yield
    finally:
        monkeypatch.setattr(writer, "group_of", real)


def test_a_row_in_the_wrong_group_file_fails_the_restore_naming_file_row_and_key(mk, monkeypatch):
    make, mgr = mk
    rng = np.random.default_rng(6)
    src = make(1)
    keys = rng.choice(1 << 40, 500, replace=False).astype(np.uint64)
    src.push("emb", keys, _grads(rng, len(keys)))
    with _misfiling(monkeypatch, keys[7]):
        mgr.save(src, "base", when=T0)
    dst = make(1)
    with pytest.raises(CheckpointCorruptError, match=rf"sparse/emb/g\d+-s0000-j\d+\.arrow: row \d+: key "
                                                     rf"{int(keys[7])} is in vshard \d+, outside this file's group"):
        mgr.restore(dst)


def test_a_distinct_bulk_load_needs_an_empty_table(tmp_path):
    from sparse_tables import TableInputError
    t = SparseTable(_cfg(tmp_path, spill=True))
    try:
        t.push(np.arange(1, 11, dtype=np.uint64), np.ones((10, 4), np.float32))
        with pytest.raises(TableInputError, match="needs an empty table, this one holds 10 rows"):
            with t.bulk_load(distinct=True):
                pass
        with t.bulk_load():             # not distinct: any table
            pass
    finally:
        t.close()


def test_a_delta_with_a_misfiled_row_changes_no_row(mk, monkeypatch):
    """A delta is verified whole before any live row changes: the group check is part of that."""
    make, mgr = mk
    rng = np.random.default_rng(7)
    live = make(1)
    keys = rng.choice(1 << 40, 500, replace=False).astype(np.uint64)
    live.push("emb", keys, _grads(rng, len(keys)))
    mgr.save(live, "base", when=T0)
    base = live.dump("emb")
    live.push("emb", keys[:200], _grads(rng, 200))
    with _misfiling(monkeypatch, keys[150]):
        mgr.save(live, "delta", when=T0 + dt.timedelta(hours=1))
    dst = make(1)
    mgr.restore(dst, "20240101/0000-base")
    assert dst.dump("emb") == base
    with pytest.raises(CheckpointCorruptError, match=rf"row \d+: key {int(keys[150])} is in vshard"):
        dst.load(mgr.uri_of("20240101/0100-delta"))
    assert dst.dump("emb") == base          # nothing of the delta applied, though most of it was fine


def test_the_manifest_records_the_groups_the_servers_cut(mk):
    """Servers cut their part files into 4 groups, the manager expects 8: the manifest must say 4, or a
    reader on several servers would look for rows in the wrong files (the group check refuses them)."""
    make, mgr = mk
    rng = np.random.default_rng(8)
    src = make(2, groups=4)
    keys = rng.choice(1 << 40, 1000, replace=False).astype(np.uint64)
    src.push("emb", keys, _grads(rng, len(keys)))
    m = mgr.save(src, "base", when=T0)
    assert m["groups"] == 4
    want = src.dump("emb")
    for n in (3, 1):
        dst = make(n)
        mgr.restore(dst)
        assert dst.dump("emb") == want


def test_a_delta_whose_parent_is_gone_names_the_parent_and_the_chain(mk):
    """Said before: '<parent> is not published: no _SUCCESS marker (incomplete or in progress)', as if
    the parent were being written; it names the delta whose parent it is, and that it is missing."""
    from engine.checkpoint.manifest import chain_of
    make, mgr = mk
    c = make(1)
    c.push("emb", np.arange(1, 50, dtype=np.uint64), _grads(np.random.default_rng(6), 49))
    base = mgr.save(c, "base", when=T0)["name"]
    d1 = mgr.save(c, "delta", when=T0 + dt.timedelta(hours=1))["name"]
    d2 = mgr.save(c, "delta", when=T0 + dt.timedelta(hours=2))["name"]
    st = mgr.storage
    st.delete(base)
    with pytest.raises(hdfs_io.NotPublishedError) as ei:
        chain_of(st, d2)
    assert str(ei.value).startswith(f"{st.uri_of(base)}, the parent of {st.uri_of(d1)} (the chain of "
                                    f"{st.uri_of(d2)}), is missing: the chain cannot be restored"), str(ei.value)
    with pytest.raises(hdfs_io.NotPublishedError, match="is not published"):       # the named one itself
        chain_of(st, base)
