"""Checkpoint names and retention around saves still in flight and operators' roll-backs, through
in-process PS servers: a clock behind the newest name never takes the name of an incomplete directory
(a save in flight); retention keeps every checkpoint a kept checkpoint's chain reaches (a delta written
after a ``--resume`` of an older delta); retention leaves recently written incomplete directories alone."""
from __future__ import annotations

import datetime as dt
import os
import threading
import time

import numpy as np
import pytest

import engine.checkpoint.coordinator as co
from engine.checkpoint import CheckpointManager
from engine.checkpoint.manifest import chain_of
from engine.config import DenseTableConfig
from engine.ps import InProcessTransport, PSClient, PSServer
from sparse_tables import TableConfig
from tests.faults import ServerClock

DIM = 4
CLOCK = ServerClock()
KEYS = np.arange(1, 301, dtype=np.uint64)


def make():
    cfg = TableConfig(dim=DIM, optimizer="adagrad", learning_rate=0.1, num_threads=1, memory_rows=1000,
                      spill_path=None, expire_after=1e9)
    servers = [PSServer({"emb": cfg}, {"d": DenseTableConfig(optimizer="adam")}, index=0, num_servers=1,
                        num_vshards=64, local_shards=2, clock=CLOCK)]
    return PSClient(InProcessTransport(servers))


def T(h, m, s=0):
    return dt.datetime(2024, 1, 1, h, m, s, tzinfo=dt.timezone.utc).timestamp()


def push(client, keys):
    client.push("emb", keys, np.ones((len(keys), DIM), np.float32))


def in_flight(mgr, name, age_s: float = 0.0) -> str:
    """An incomplete checkpoint directory with one part file, as a save still writing leaves it; with
    ``age_s`` its file and directories were last modified that long ago. Its file's path below the root."""
    f = f"{name}/sparse/emb/g00-s0000-j00.arrow"
    mgr.storage.write_bytes(f, b"x" * 64)
    if age_s:
        t = time.time() - age_s
        for p in (f, f"{name}/sparse/emb", f"{name}/sparse", name):
            os.utime(mgr.storage.full_path(p), (t, t))
    return f


# ---------------------------------------------------------------------------------------------- naming
def test_a_clock_behind_the_newest_name_skips_the_names_of_saves_in_flight(tmp_path):
    client = make()
    push(client, KEYS)
    mgr = CheckpointManager(str(tmp_path), "ctr")
    assert mgr.save(client, "base", when=T(10, 0))["name"] == "20240101/1000-base"
    part = in_flight(mgr, "20240101/1000-delta.1")              # another coordinator's save, not published
    push(client, KEYS[:10])
    m = mgr.save(client, "delta", when=T(9, 59))                # this clock is a minute behind
    assert m["name"] == "20240101/1000-delta.2"                 # after every name at 10:00, not .1
    assert mgr.storage.exists(part)                             # the save in flight was not cleaned away
    assert [r.name for r in mgr.list()] == ["20240101/1000-base", "20240101/1000-delta.2"]


def held_delta(monkeypatch, zombie: CheckpointManager, client) -> tuple[threading.Event, threading.Thread, dict]:
    """``zombie`` saving a delta at 10:00:30 on a thread held before publish (``checkpoint.before_publish``)
    until the returned event is set; ``out["z"]`` gets the name it published or the error it raised."""
    go, held = threading.Event(), threading.Event()

    def hit(name):
        if name == "checkpoint.before_publish" and threading.current_thread().name == "zombie":
            held.set()
            assert go.wait(30)

    monkeypatch.setattr(co.failpoints, "hit", hit)
    out = {}

    def run():
        try:
            out["z"] = zombie.save(client, "delta", when=T(10, 0, 30))["name"]
        except Exception as e:  # noqa: BLE001
            out["z"] = e

    t = threading.Thread(target=run, name="zombie")
    t.start()
    assert held.wait(30)
    return go, t, out


def test_a_held_save_and_a_save_by_a_clock_behind_both_publish_under_their_own_names(tmp_path, monkeypatch):
    """The audit's zombie: a coordinator held before publish at 10:00:30 while a new one (clock at 09:59)
    saves; each publishes its own directory. The new one's is a base: the zombie's Save took the changed
    rows from the servers' dirty state (``engine.ps.delta_lineage``; tests/unit/test_delta_lineage.py)."""
    client = make()
    push(client, KEYS)
    zombie = CheckpointManager(str(tmp_path), "ctr")
    base = zombie.save(client, "base", when=T(10, 0))["name"]
    go, t, out = held_delta(monkeypatch, zombie, client)
    new = CheckpointManager(str(tmp_path), "ctr")
    new.head = base
    push(client, KEYS[:5])
    name = new.save(client, "delta", when=T(9, 59))["name"]
    go.set()
    t.join(30)
    assert out["z"] == "20240101/1000-delta.1" and name == "20240101/1000-base.2", (out, name)
    for n in (out["z"], name):
        assert CheckpointManager(str(tmp_path), "ctr").restore(make(), n)["name"] == n


# ------------------------------------------------------------------------------------- chain retention
def rolled_back(tmp_path):
    """The audit's roll-back: job 1 writes 1000-base, 1005-delta, 1100-base; job 2 resumes 1005-delta and
    writes 1200-delta (parent 1005-delta), then 1300-base (keep_bases 2: its prune runs)."""
    c1 = make()
    push(c1, KEYS)
    j1 = CheckpointManager(str(tmp_path), "ctr", keep_bases=2)
    b1 = j1.save(c1, "base", when=T(10, 0))["name"]
    push(c1, KEYS[:10])
    d1 = j1.save(c1, "delta", when=T(10, 5))["name"]
    j1.save(c1, "base", when=T(11, 0))
    c2 = make()
    j2 = CheckpointManager(str(tmp_path), "ctr", keep_bases=2)
    j2.restore(c2, d1)
    push(c2, KEYS[:20])
    d3 = j2.save(c2, "delta", when=T(12, 0))
    assert d3["parent"] == d1
    j2.save(c2, "base", when=T(13, 0))
    return j2, c2, b1, d1, d3["name"]


def test_retention_keeps_what_the_chain_of_a_kept_delta_reaches_after_a_roll_back(tmp_path):
    j2, c2, b1, d1, d3 = rolled_back(tmp_path)
    left = [r.name for r in j2.list()]
    assert b1 in left and d1 in left, left                      # 1200-delta's chain: 1000-base, 1005-delta
    want = {}
    for name in left:                                           # every listed checkpoint restores
        assert [m["name"] for m in chain_of(j2.storage, name)][-1] == name
        dst = make()
        assert CheckpointManager(str(tmp_path), "ctr").restore(dst, name)["name"] == name
        want[name] = dst.pull("emb", KEYS).copy()
    assert np.array_equal(want[d3], want["20240101/1300-base"])  # 1300-base was saved right after d3


def test_retention_deletes_a_rolled_back_chain_once_no_kept_checkpoint_reaches_it(tmp_path):
    j2, c2, b1, d1, d3 = rolled_back(tmp_path)
    push(c2, KEYS[:3])
    j2.save(c2, "base", when=T(14, 0))                         # kept bases: 1300, 1400; nothing reaches d1
    assert [r.name for r in j2.list()] == ["20240101/1300-base", "20240101/1400-base"]
    assert not j2.storage.exists(b1) and not j2.storage.exists(d1) and not j2.storage.exists(d3)


def test_repeated_prunes_read_each_manifest_once(tmp_path, monkeypatch):
    j2, *_ = rolled_back(tmp_path)
    reads = []
    real = CheckpointManager.manifest
    monkeypatch.setattr(CheckpointManager, "manifest", lambda self, n: reads.append(n) or real(self, n))
    fresh = CheckpointManager(str(tmp_path), "ctr", keep_bases=2)
    assert fresh.prune() == []
    assert sorted(reads) == ["20240101/1005-delta", "20240101/1200-delta"]
    reads.clear()
    assert fresh.prune() == [] and j2.prune() == []
    assert reads == []                                          # complete checkpoints never change: cached


def test_a_base_after_deltas_this_manager_wrote_reads_no_manifest(tmp_path, monkeypatch):
    """Retention knows the parents of the checkpoints its own manager wrote: the prune of the base after
    a period of deltas read each kept delta's manifest back (one GET each on S3, while the save waited)."""
    client = make()
    push(client, KEYS)
    mgr = CheckpointManager(str(tmp_path), "ctr", keep_bases=2)
    for h in (10, 11):
        mgr.save(client, "base", when=T(h, 0))
        for m in range(1, 4):
            push(client, KEYS[:10])
            mgr.save(client, "delta", when=T(h, m))
    reads = []
    real = CheckpointManager.manifest
    monkeypatch.setattr(CheckpointManager, "manifest", lambda self, n: reads.append(n) or real(self, n))
    mgr.save(client, "base", when=T(12, 0))     # its prune walks the chains of the kept deltas (11:01-11:03)
    assert reads == []
    assert [r.name for r in mgr.list()][0] == "20240101/1100-base"


# ----------------------------------------------------------------------------------- incomplete grace
def test_retention_leaves_recently_written_incomplete_directories_alone(tmp_path):
    client = make()
    push(client, KEYS)
    mgr = CheckpointManager(str(tmp_path), "ctr")
    mgr.save(client, "base", when=T(10, 0))
    fresh = in_flight(mgr, "20240101/1005-delta")                               # a slow save, in flight
    stale = in_flight(mgr, "20240101/1006-delta", age_s=co.INCOMPLETE_GRACE_S + 60)   # a crashed one
    mgr.save(client, "base", when=T(11, 0))                     # its prune runs
    assert mgr.storage.exists(fresh)
    assert not mgr.storage.exists("20240101/1006-delta"), stale
    t = time.time() - co.INCOMPLETE_GRACE_S - 60               # later, once the slow save is old, it goes
    for p in (fresh, "20240101/1005-delta/sparse/emb", "20240101/1005-delta/sparse", "20240101/1005-delta"):
        os.utime(mgr.storage.full_path(p), (t, t))
    assert mgr.prune() == ["20240101/1005-delta"]
    assert [r.name for r in mgr.list()] == ["20240101/1000-base", "20240101/1100-base"]


def test_a_save_held_before_publish_survives_a_newer_base_and_restores(tmp_path, monkeypatch):
    """The audit's e3: a coordinator held before publish while another writes a base named later; that
    base's prune must not delete the held save's files."""
    client = make()
    push(client, KEYS)
    zombie = CheckpointManager(str(tmp_path), "ctr")
    zombie.save(client, "base", when=T(10, 0))
    push(client, KEYS[:50])
    go, t, out = held_delta(monkeypatch, zombie, client)
    CheckpointManager(str(tmp_path), "ctr").save(client, "base", when=T(10, 1))
    go.set()
    t.join(30)
    assert out["z"] == "20240101/1000-delta.1", out
    dst = make()
    assert CheckpointManager(str(tmp_path), "ctr").restore(dst, out["z"])["name"] == out["z"]
