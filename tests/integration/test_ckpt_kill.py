"""Kill -9 a parameter-server process while it writes its part of a checkpoint: the save fails, the
half-written checkpoint has no ``_SUCCESS`` and does not exist for readers, and the previous checkpoint
still restores (onto a different number of servers) to the values pulled before."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np

import hdfs_io
from engine.checkpoint import CheckpointManager, list_checkpoints
from engine.config import from_dict
from engine.launch.local import LocalCluster
from engine.ps import InProcessTransport, PSClient, PSServer
from sparse_tables import TableConfig

DIM = 32


def test_server_killed_mid_write_leaves_previous_checkpoint_restorable(tmp_path):
    root = str(tmp_path / "ckpt")       # the servers save and load only below their checkpoint.root
    cfg = from_dict({"cluster": {"servers": 2, "workers": 1, "local_shards": 4}, "checkpoint": {"root": root},
                     "tables": {"sparse": {"emb": {"dim": DIM, "optimizer": "adagrad", "num_threads": 1}}},
                     "model": {"kind": "logreg", "table": "emb"}})
    rng = np.random.default_rng(0)
    keys = rng.choice(1 << 50, 600_000, replace=False).astype(np.uint64)
    with LocalCluster(cfg, tmp_path / "run") as cluster:
        endpoints = cluster.start_servers()
        with PSClient(endpoints, timeout_s=120) as client:
            client.wait_ready(60)
            client.push("emb", keys, rng.normal(size=(len(keys), DIM)).astype(np.float32))
            mgr = CheckpointManager(root, "job")
            first = mgr.save(client, "base", when=0.0)
            want = client.pull("emb", keys[:5000])
            client.push("emb", keys, rng.normal(size=(len(keys), DIM)).astype(np.float32))
            errors = []

            def save():
                try:
                    mgr.save(client, "base", when=3600.0)
                except Exception as e:  # noqa: BLE001 - the failure is the point
                    errors.append(e)

            t = threading.Thread(target=save)
            t.start()
            st = mgr.storage
            victim = cluster.servers[1].proc.pid
            deadline = time.monotonic() + 60
            while True:                      # kill server 1 as soon as its first part file exists
                try:
                    names = st.listdir("19700101/0100-base/sparse/emb")
                except FileNotFoundError:
                    names = []
                if any("-s0001-" in n for n in names):
                    os.kill(victim, signal.SIGKILL)
                    break
                assert t.is_alive() and time.monotonic() < deadline, "save finished before the kill"
                time.sleep(0.002)
            t.join(120)
        assert errors, "the save must fail when a server dies mid-write"
        assert not hdfs_io.is_complete(st, "19700101/0100-base")
        assert not st.exists("19700101/0100-base/_parts/s0001.json")
    assert [r.name for r in mgr.list()] == [first["name"]]
    assert len(list_checkpoints(mgr.storage, complete_only=False)) == 2
    servers = [PSServer({"emb": TableConfig(dim=DIM, optimizer="adagrad", num_threads=1)}, index=i,
                        num_servers=3) for i in range(3)]
    client3 = PSClient(InProcessTransport(servers))
    got = CheckpointManager(root, "job").restore(client3)
    assert got["name"] == first["name"]
    np.testing.assert_array_equal(client3.pull("emb", keys[:5000]), want)
    # the leftovers are pruned once a newer checkpoint exists and they are older than the grace that
    # spares a slow save in flight (engine.checkpoint.coordinator.INCOMPLETE_GRACE_S): aged here
    from engine.checkpoint.coordinator import INCOMPLETE_GRACE_S
    old = time.time() - INCOMPLETE_GRACE_S - 60
    for p in [Path(root) / "job" / "19700101" / "0100-base", *(Path(root) / "job" / "19700101" / "0100-base").rglob("*")]:
        os.utime(p, (old, old))
    m = CheckpointManager(root, "job", keep_bases=1)
    m.head = first["name"]
    m.save(client3, "base", when=7200.0)
    assert not mgr.storage.exists("19700101/0100-base")
