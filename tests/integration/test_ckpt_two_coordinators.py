"""Two coordinators on the same real server processes (a zombie rank 0 and its successor, each with its
own gRPC client): the zombie's delta Save takes the changed rows out of the servers' dirty state, so
the servers refuse the successor's next delta (its parent is not what they last saved) and the
successor writes a base. Both checkpoints restore; the successor's to exactly the live rows."""
from __future__ import annotations

import numpy as np

from engine.checkpoint import CheckpointManager
from engine.config import from_dict
from engine.launch.local import LocalCluster
from engine.ps import InProcessTransport, PSClient, PSServer
from sparse_tables import TableConfig

DIM = 8


def restored_rows(root: str, name: str, keys: np.ndarray) -> np.ndarray:
    servers = [PSServer({"emb": TableConfig(dim=DIM, optimizer="adagrad", num_threads=1)}, index=i,
                        num_servers=2) for i in range(2)]
    with PSClient(InProcessTransport(servers)) as client:
        CheckpointManager(root, "job").restore(client, name)
        return client.pull("emb", keys)


def test_a_zombie_coordinators_delta_makes_its_successors_next_checkpoint_a_base(tmp_path, caplog):
    root = str(tmp_path / "ckpt")
    cfg = from_dict({"cluster": {"servers": 2, "workers": 1, "local_shards": 2}, "checkpoint": {"root": root},
                     "tables": {"sparse": {"emb": {"dim": DIM, "optimizer": "adagrad", "num_threads": 1}}},
                     "model": {"kind": "logreg", "table": "emb"}})
    rng = np.random.default_rng(0)
    keys = rng.choice(1 << 50, 20_000, replace=False).astype(np.uint64)

    def grads(n):
        return rng.normal(size=(n, DIM)).astype(np.float32)
    with LocalCluster(cfg, tmp_path / "run") as cluster:
        endpoints = cluster.start_servers()
        with PSClient(endpoints, timeout_s=60) as old, PSClient(endpoints, timeout_s=60) as new:
            old.wait_ready(60)
            zombie, successor = CheckpointManager(root, "job"), CheckpointManager(root, "job")
            old.push("emb", keys, grads(len(keys)))
            base = zombie.save(old, "base", when=0.0)["name"]
            successor.head = base                                   # took over from the base
            old.push("emb", keys[:5000], grads(5000))
            z = zombie.save(old, "delta", when=60.0)                # ran anyway, and published
            new.push("emb", keys[10_000:15_000], grads(5000))
            n = successor.save(new, "delta", when=120.0)
            live = new.pull("emb", keys)
            d = successor.save(new, "delta", when=180.0)            # the successor's chain goes on
    assert z["kind"] == "delta" and n["kind"] == "base" and d["parent"] == n["name"], (z["name"], n["name"])
    refusals = [r.getMessage() for r in caplog.records if "delta parent mismatch" in r.getMessage()]
    assert refusals and "writing a base instead of a delta" in refusals[0], refusals
    np.testing.assert_array_equal(restored_rows(root, n["name"], keys), live)
    np.testing.assert_array_equal(restored_rows(root, d["name"], keys), live)
    zrows = restored_rows(root, z["name"], keys)                    # the fork restores to its own state
    np.testing.assert_array_equal(zrows[10_000:15_000], restored_rows(root, base, keys[10_000:15_000]))
