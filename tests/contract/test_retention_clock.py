"""Retention's grace for an incomplete directory (a save or an export still in flight) is measured on the
store's clock, not on the pruning host's.

Before, ``CheckpointManager.prune`` and ``prune_bundles`` compared the directory's newest modification
time (stamped by the store: S3's servers, an HDFS NameNode, an NFS server; on a local disk, this host)
with the pruning host's ``time.time()``. A coordinator whose clock ran 20 minutes ahead of the store's
(or stepped forward: NTP, a resumed VM) took every directory for 20 minutes older than it was, and
deleted a save or export written to seconds ago, under the writer. Now the age is the store's times
compared with each other (``hdfs_io.Storage.clock_now``: a probe's modification time). The machine's
clock is shared and never changed: the pruner's clock is the coordinator module's own ``time``, run
20 minutes ahead; the store is real (a local directory, moto's S3 server).
"""
from __future__ import annotations

import time

import pytest

import engine.checkpoint.coordinator as coordinator
import engine.export.retention as retention
import hdfs_io
from engine.checkpoint import CheckpointManager
from engine.export.retention import prune_bundles

AHEAD_S = 20 * 60.0


class _AheadTime:
    """``time`` whose wall clock runs ``AHEAD_S`` ahead of the real one (a pruning host's clock)."""

    def time(self) -> float:
        return time.time() + AHEAD_S

    def __getattr__(self, name):
        return getattr(time, name)


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """(URI, storage options) of a fresh root on a real backend."""
    if request.param == "local":
        return str(tmp_path / "root"), None
    return request.getfixturevalue("s3_root_uri"), request.getfixturevalue("s3_storage_options")


def _layout(st: hdfs_io.Storage) -> str:
    """A published directory named 11:00 and one named 10:05 still being written (no ``_SUCCESS``): a
    slow or held save / export. Returns the in-flight file's path."""
    st.write_bytes("20240101/1100-base/_SUCCESS", b"")
    f = "20240101/1005-delta/sparse/emb/g00-s0000-j00.arrow"
    st.write_bytes(f, b"x" * 64)
    return f


def test_a_pruner_whose_clock_is_ahead_keeps_a_save_in_flight(store, monkeypatch):
    uri, opts = store
    monkeypatch.setattr(coordinator, "time", _AheadTime())
    mgr = CheckpointManager(uri, "ctr", storage_options=opts)
    f = _layout(mgr.storage)
    assert mgr.prune() == []
    assert mgr.storage.exists(f)
    assert not [n for n in mgr.storage.listdir("") if n.startswith("_clock")]     # the probe is gone


def test_a_pruner_whose_clock_is_ahead_keeps_an_export_in_flight(store, monkeypatch):
    uri, opts = store
    monkeypatch.setattr(coordinator, "time", _AheadTime())
    monkeypatch.setattr(retention, "time", _AheadTime(), raising=False)     # it used the clock before
    st = hdfs_io.Storage.from_uri(uri, storage_options=opts)
    f = _layout(st)
    assert prune_bundles(uri, 2, storage_options=opts) == []
    assert st.exists(f)


def test_the_store_clock_still_ages_leftovers(store):
    """A leftover as old as the grace on the store's clock goes (here: a grace of 0 s)."""
    uri, opts = store
    st = hdfs_io.Storage.from_uri(uri, storage_options=opts)
    _layout(st)
    assert prune_bundles(uri, 2, storage_options=opts, incomplete_grace_s=0) == ["20240101/1005-delta"]
    assert st.clock_now() == pytest.approx(time.time(), abs=5.0)     # moto and this host share a clock
