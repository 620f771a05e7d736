"""A server keeps a bounded number of client names (``Health``'s ``writers`` and ``clients``,
``engine.ps.names``): thousands of short-lived clients, each with its own name, no longer grow the server
and every ``Health`` reply for ever; the running workers' names stay; a starting worker that cannot tell
whether its name was dropped is not let in (it rolls back, ``engine.roles._agreed``)."""
from __future__ import annotations

import numpy as np
import pytest

from engine import roles
from engine.ps import InProcessTransport, PSClient, PSServer, names
from sparse_tables import TableConfig

SGD1 = TableConfig(dim=4, optimizer="sgd", learning_rate=1.0, initializer="zeros")
KEYS = np.arange(1, 5, dtype=np.uint64)


def test_recent_names_keep_the_most_recently_seen_and_count_the_dropped():
    n = names.RecentNames(cap=3)
    for name in ("a", "b", "c"):
        n.add(name)
    n.add("a")                      # refreshed: "b" is now the oldest
    n.add("d")
    assert n.sorted() == ["a", "c", "d"] and n.dropped == 1 and "b" not in n and len(n) == 3
    n.clear()
    assert n.sorted() == [] and n.dropped == 0
    with pytest.raises(ValueError, match="cap"):
        names.RecentNames(cap=0)


def test_many_short_lived_clients_leave_a_bounded_health_and_the_running_worker_in_it(monkeypatch):
    monkeypatch.setattr(names, "MAX_NAMES", 16)
    core = PSServer({"emb": SGD1}, local_shards=1)
    try:
        with PSClient(InProcessTransport([core]), name="worker0") as w0:
            w0.push("emb", KEYS, np.ones((4, 4), np.float32))
            for i in range(200):        # tools, each its own process (name), reading and writing
                with PSClient(InProcessTransport([core]), name=f"tool{i}", threads=1) as c:
                    c.pull("emb", KEYS)
                    c.push("emb", KEYS, np.zeros((4, 4), np.float32))
                if i % 8 == 0:          # the worker keeps training: its name stays among the kept
                    w0.push("emb", KEYS, np.zeros((4, 4), np.float32))
            health = w0.health()[0]
            w0.fence([health["generation"]], "test: a new generation")
            after = w0.health()[0]
        assert after["clients"] == [] and after["clients_dropped"] == 0      # a new generation starts empty
        assert len(health["clients"]) <= 16 and len(health["writers"]) <= 16, health
        assert "worker0" in health["clients"] and "worker0" in health["writers"]
        assert health["clients_dropped"] > 0 and health["writers_dropped"] > 0
        # a starting worker1 is not listed, but it may have been dropped: not agreed (roll back)
        assert roles._took_part(health, "worker1")
        assert roles._agreed([health], "worker1") == (False, None)
    finally:
        core.close()


def test_a_fresh_server_lets_a_first_worker_in_and_nothing_is_dropped():
    core = PSServer({"emb": SGD1}, local_shards=1)
    try:
        with PSClient(InProcessTransport([core]), name="tool") as c:
            c.pull("emb", KEYS)
            health = c.health()[0]
        assert health["clients_dropped"] == 0 and health["writers_dropped"] == 0
        assert roles._agreed([health], "worker0") == (True, None)
    finally:
        core.close()


def test_a_job_of_many_workers_keeps_four_names_a_worker():
    """With more workers than ``MAX_NAMES`` a job's own names would be dropped, and every start roll
    back: the servers of a config keep at least four names a worker."""
    from pathlib import Path

    from engine.config import load_config
    demo = Path(__file__).resolve().parents[2] / "configs" / "logreg_demo.yaml"
    small = PSServer.from_config(load_config(demo, ["cluster.warm_up=false"]), 0)
    big = PSServer.from_config(load_config(demo, ["cluster.workers=5000", "cluster.warm_up=false"]), 0)
    try:
        assert small.clients.cap == names.MAX_NAMES and small.writers.cap == names.MAX_NAMES
        assert big.clients.cap == 20_000 and big.writers.cap == 20_000
    finally:
        small.close()
        big.close()
