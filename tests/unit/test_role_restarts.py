"""``engine_restarts_total`` in role mode (Kubernetes, any scheduler): no supervisor counts restarts
there (the kubelet and the Job controller restart the pods), and the metric stayed 0 however often the
job rolled back. The servers now count the roll-backs they live through (``rollbacks`` in ``Health``:
a Load or a Fence that ends an attempt which wrote to them, once per attempt), and a worker adds the
most any server counted when it agrees on the state to start from. Real in-process servers, a real
checkpoint, the real agreement (``engine.roles._restored_by_servers``) and real metric registries."""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from engine.config import load_config
from engine.observability import prometheus
from engine.ps import InProcessTransport, PSClient, PSServer
from sparse_tables import TableConfig

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "logreg_demo.yaml"
DIM = 4
SGD1 = TableConfig(dim=DIM, optimizer="sgd", learning_rate=1.0, initializer="zeros")


def restarts(m: prometheus.RoleMetrics) -> float:
    return m.registry.get_sample_value("engine_restarts_total")


def test_roll_backs_in_role_mode_count_in_engine_restarts_total(tmp_path, monkeypatch):
    from engine import job_checkpoints
    from engine.roles import _restored_by_servers
    cfg = load_config(DEMO_CONFIG, [f"checkpoint.root={tmp_path / 'ckpt'}", "cluster.startup_timeout_s=20"])
    cores = [PSServer({"emb": SGD1}, index=i, num_servers=2, local_shards=1) for i in range(2)]
    server0 = prometheus.RoleMetrics("server", 0)
    server0.watch_server(cores[0])
    per_thread: dict[int, prometheus.RoleMetrics] = {}      # one process's metrics per worker thread
    monkeypatch.setattr(prometheus, "current", lambda: per_thread.get(threading.get_ident()))
    keys = np.arange(1, 101, dtype=np.uint64)
    ones = np.ones((len(keys), DIM), np.float32)

    def rollbacks() -> list[int]:
        with PSClient(InProcessTransport(cores), name="monitor") as c:
            return [h["rollbacks"] for h in c.health()]

    def start_worker(rank: int, out: dict) -> None:
        """A worker process's start: its metrics, then the agreement with the servers."""
        per_thread[threading.get_ident()] = out["metrics"] = prometheus.RoleMetrics("worker", rank)
        with PSClient(InProcessTransport(cores), name=f"worker{rank}") as c:
            out["cfg"] = _restored_by_servers(cfg, c, rank, 2)

    with PSClient(InProcessTransport(cores), name="worker0") as w0, \
            PSClient(InProcessTransport(cores), name="worker1") as w1:
        w0.push("emb", keys, ones)
        mgr, _ = job_checkpoints.manager_for(cfg, None)
        mgr.save(w0, "base", when=0.0)
        w1.push("emb", keys, ones)                       # trained since the checkpoint
    assert restarts(server0) == 0
    # worker 1 replaced alone (a Job controller): it fences, worker 0 exits and, restarted, rolls back
    one, zero = {}, {}
    t = threading.Thread(target=start_worker, args=(1, one))
    t.start()
    with PSClient(InProcessTransport(cores), name="monitor") as c:
        while not all(h["fenced"] for h in c.health()):
            t.join(0.05)
    start_worker(0, zero)
    t.join(30)
    assert zero["cfg"].checkpoint.restored and one["cfg"].checkpoint.restored
    assert restarts(zero["metrics"]) == restarts(one["metrics"]) == restarts(server0) == 1
    assert rollbacks() == [1, 1]    # the fence and the load after it: one roll-back
    # the job trains on; then worker 0 is restarted (a crash) and rolls back alone
    with PSClient(InProcessTransport(cores), name="worker0") as w0:
        w0.push("emb", keys, ones)
    again = {}
    start_worker(0, again)
    assert rollbacks() == [2, 2]
    assert restarts(again["metrics"]) == restarts(server0) == 2
    # a server restarted (it counts from 0 again): the workers take the most any server counted
    with PSClient(InProcessTransport(cores), name="worker0") as w0:
        w0.push("emb", keys, ones)
    cores[1].close()
    cores[1] = PSServer({"emb": SGD1}, index=1, num_servers=2, local_shards=1)
    third = {}
    start_worker(0, third)
    assert rollbacks() == [3, 0]
    assert restarts(third["metrics"]) == 3
    # a restore onto servers nothing wrote to (the local launcher's restart: new servers) is no roll-back
    fresh = [PSServer({"emb": SGD1}, index=i, num_servers=2, local_shards=1) for i in range(2)]
    with PSClient(InProcessTransport(fresh), name="launcher") as launcher:
        mgr.restore(launcher)
        assert [h["rollbacks"] for h in launcher.health()] == [0, 0]
    for core in cores + fresh:
        core.close()
