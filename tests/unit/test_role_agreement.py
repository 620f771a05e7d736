"""Role-mode agreement at a worker's start (``engine.roles._restored_by_servers``), on real in-process
servers and a real checkpoint. Found by ``tests/integration/test_k8s_pods.py``'s preemption of one
worker: both workers restarted together, worker 1 looked while rank 0's roll-back was half done (server
1 loaded, server 0 not yet) and fenced both; its fence of server 1 landed and undid the roll-back there,
rank 0 waited for an agreement nobody would make, and both exited 1 after ``cluster.startup_timeout_s``.
Now a restarted worker fences only the servers its earlier self took part in, and rank 0 rolls back
again while the servers disagree after its roll-back."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.config import load_config
from engine.ps import InProcessTransport, PSClient, PSServer
from sparse_tables import TableConfig

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "logreg_demo.yaml"
DIM = 8
SGD1 = TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros")


def test_rank0_rolls_back_again_when_a_server_moved_after_its_roll_back(tmp_path):
    from engine import job_checkpoints
    from engine.roles import _agreed, _restored_by_servers
    cfg = load_config(DEMO_CONFIG, [f"checkpoint.root={tmp_path / 'ckpt'}", "cluster.startup_timeout_s=10"])
    cores = [PSServer({"emb": SGD1}, index=i, num_servers=2, local_shards=1) for i in range(2)]
    keys = np.arange(1, 41, dtype=np.uint64)
    fenced, seen = [], []

    class Fenced(InProcessTransport):
        """Rank 0's transport: right after its Load reaches server 1, worker 1, restarted, fences what it
        saw a moment before (server 1 loaded, server 0 not yet: its fence of server 0 carries the
        generation before the Load, and is refused)."""
        def call(self, server, method, request, timeout):
            if method == "Load" and server == 0 and not fenced:
                seen.append(other.health()[0]["generation"])          # server 0 before its Load
            reply = super().call(server, method, request, timeout)
            if method == "Load" and server == 1 and not fenced:
                fenced.append(other.fence([seen[0], other.health()[1]["generation"]], "worker 1 restarted"))
            return reply

    with PSClient(InProcessTransport(cores), name="worker0") as before, \
            PSClient(InProcessTransport(cores), name="worker1") as other:
        before.push("emb", keys, np.ones((40, DIM), np.float32))
        mgr, _ = job_checkpoints.manager_for(cfg, None)
        base = mgr.save(before, "base", when=0.0)
        before.push("emb", keys, np.ones((40, DIM), np.float32))      # trained since: rank 0 must roll back
        with PSClient(Fenced(cores), name="worker0") as rank0:
            out = _restored_by_servers(cfg, rank0, 0, 2)
            assert fenced == [[False, True]]
            health = rank0.health()
            assert [h["restored"] for h in health] == [mgr.uri_of(base["name"])] * 2
            assert _agreed(health, "worker1") == (True, mgr.uri_of(base["name"]))
            assert out.checkpoint.restored == mgr.uri_of(base["name"])
            np.testing.assert_array_equal(rank0.pull("emb", keys), -np.ones((40, DIM), np.float32))
    for core in cores:
        core.close()


def test_a_restarted_worker_fences_only_the_servers_its_earlier_self_took_part_in(tmp_path):
    """Server 0 names worker 1 among its writers (not rolled back yet), server 1 does not (rank 0 has
    just loaded it): worker 1 fences server 0 only, and waits for rank 0."""
    import pytest

    from engine import job_checkpoints
    from engine.errors import LaunchError
    from engine.ps import routing
    from engine.roles import NotAgreedError, _restored_by_servers
    cfg = load_config(DEMO_CONFIG, [f"checkpoint.root={tmp_path / 'ckpt'}", "cluster.startup_timeout_s=1"])
    cores = [PSServer({"emb": SGD1}, index=i, num_servers=2, local_shards=1) for i in range(2)]
    keys = np.arange(1, 201, dtype=np.uint64)
    on0 = keys[routing.route(keys, routing.DEFAULT_NUM_VSHARDS, 2) == 0]
    with PSClient(InProcessTransport(cores), name="worker0") as rank0, \
            PSClient(InProcessTransport(cores), name="worker1") as worker1:
        mgr, _ = job_checkpoints.manager_for(cfg, None)
        base = mgr.save(rank0, "base", when=0.0)
        mgr.restore(rank0, base["name"])
        worker1.push("emb", on0, np.ones((len(on0), DIM), np.float32))      # its earlier self, server 0 only
        before = rank0.health()
        assert [h["writers"] for h in before] == [["worker1"], []]
        with PSClient(InProcessTransport(cores), name="worker1") as restarted:
            with pytest.raises((NotAgreedError, LaunchError)):                 # rank 0 is not running here
                _restored_by_servers(cfg, restarted, 1, 2)
        after = rank0.health()
        assert after[0]["fenced"] and after[0]["generation"] != before[0]["generation"]
        assert not after[1]["fenced"] and after[1]["generation"] == before[1]["generation"]
        assert after[1]["restored"] == mgr.uri_of(base["name"])
    for core in cores:
        core.close()
